"""alignment: RL fine-tuning of reasoning LLMs on math; the scripts are `uv run -m alignment.<script>`."""

import signal
import sys


def _interrupted_at_start(signum, frame):
    # once: the same press often arrives twice (uv forwards what the process group got), and a second
    # SystemExit raised while the interpreter shuts down would print a traceback
    signal.signal(signum, signal.SIG_IGN)
    print("\ninterrupted outside a training step: the work in progress is not saved (checkpoints and results "
          "saved before are kept).", file=sys.stderr)
    raise SystemExit(128 + signum)


# Started as a script (`python -m alignment.<script>`: sys.argv[0] is "-m" while the package is imported), a
# Ctrl-C during the imports and the loading ends in one line instead of an import's traceback; the run loop
# installs its own handler (stop after the step, with a checkpoint) and restores this one after it.
if sys.argv[:1] == ["-m"]:
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_at_start)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:  # a `kill` or a scheduler: the same one line
        signal.signal(signal.SIGTERM, _interrupted_at_start)
