"""Errors the user can fix, and the command-line wrapper that prints them as one line.

A bad flag, a missing file, an unknown model or dataset: each raises `UserError` (or `MissingFileError`)
with one sentence that says what to do. `cli(main, args)` runs a script's `main` and turns those into
`error: <sentence>` on stderr and exit status 2, without a traceback; any other exception is a bug and
keeps its traceback. Both subclass the builtin errors they replace, so `except ValueError` still works.
"""

import errno
import os
import sys
import time


def one_line_error(message: str):
    """A command line's complaint (argparse's `parser.error`, a flag's check) as `error: <message>`, exit status 2,
    without argparse's usage block above it."""
    if os.environ.get("RANK", "0") == "0":  # under torchrun every rank parses: the line is said once, by rank 0
        print(f"error: {message}", file=sys.stderr)
    else:  # and the others end after it: the first rank to fail makes torchrun stop the rest, maybe before it printed
        time.sleep(3)
    sys.exit(2)


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
    except OSError as e:  # the machine's files, not a bug: a full disk, a folder deleted mid-run, a long name
        why = _file_system_problem(e)
        if why is None:
            raise
        where = f" ({e.filename})" if isinstance(e.filename, str) else ""
        print(f"error: {why}{where}; a checkpoint saved before this is kept (a save cut short leaves the "
              f"previous one in place).", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt as e:  # a run says what it kept (run.py); elsewhere nothing was saved
        print(f"\n{e.args[0] if e.args else 'stopped.'}", file=sys.stderr)
        sys.exit(getattr(e, "exit_status", 130))


def _file_system_problem(e: OSError) -> str | None:
    """One sentence for an OSError the user's machine caused, None for anything else (a bug keeps its traceback)."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no space left on the device (or the disk quota is spent): free some, then continue the run"
    if e.errno == errno.ENAMETOOLONG:
        return "a file name is longer than the file system allows: choose a shorter --output_dir"
    if e.errno == errno.EROFS:
        return "the file system is read-only: choose another --output_dir"
    if e.errno == errno.ENOENT and e.filename and not os.path.isdir(os.path.dirname(os.path.abspath(e.filename))):
        return "a folder the program was writing no longer exists (deleted or unmounted while it ran)"
    return None
