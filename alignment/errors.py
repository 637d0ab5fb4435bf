"""Errors the user can fix, and the command-line wrapper that prints them as one line.

A bad flag, a missing file, an unknown model or dataset: each raises `UserError` (or `MissingFileError`)
with one sentence that says what to do. `cli(main, args)` runs a script's `main` and turns those into
`error: <sentence>` on stderr and exit status 2, without a traceback; any other exception is a bug and
keeps its traceback. Both subclass the builtin errors they replace, so `except ValueError` still works.
"""

import sys


class UserError(ValueError):
    """A problem in what the user asked for; the message says what to change."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user pointed at (or must create first) is not there."""


class StoppedAtOnce(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM stopped a run inside a step; the message says what was kept, and the
    program exits 128 + the signal's number (130 for Ctrl-C, 143 for SIGTERM), as the shell expects."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = 128 + signum


def cli(main, args):
    """Run `main(args)`; a UserError ends the program with its one sentence and exit status 2, and a Ctrl-C
    that stops the run at once (the second one; the first saves after the step, see run.py) with one line
    and status 128 + the signal (130 for Ctrl-C, 143 for SIGTERM)."""
    try:
        return main(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:  # a run says what it kept (run.py); elsewhere nothing was saved
        print(f"\n{e.args[0] if e.args else 'stopped.'}", file=sys.stderr)
        sys.exit(getattr(e, "exit_status", 130))
