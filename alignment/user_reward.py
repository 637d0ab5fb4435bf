"""A reward of your own: `--reward_fn path/to/file.py:name` or `--reward_fn package.module:name`.

    def name(response: str, ground_truth: str, **columns) -> float | dict

`columns` are the question's row, every column but the answer one, by name (a file's own columns; `question`
for the built-in sets); a column named `response` or `ground_truth` would collide with the first two arguments and
is refused before any model loads (`check_columns`). It returns a real number (a float, an int, a bool as 0/1, a
numpy scalar), or a dict with `reward` and optionally `format_reward` and `answer_reward` (evaluate's three
metrics; one it does not return is reported as absent, not as zero; pass@k reads answer_reward 1 as right).

It runs as the built-in grader's slow checks do (alignment/grading_worker.py): in a worker process that imports
the file once and forks a child per call, killed at `--reward_timeout` (at most a day). A call that passes its time,
raises, or returns something that is not a finite real number scores that sample 0 and is counted (`reward_failed`); it
never stops or hangs the run. The same function scores training and evaluation; its file's sha256 goes into
the run's config, so a resume after the file changed is refused unless asked for.

The parent side is stdlib only; this file doubles as the worker's script.
"""

import hashlib
import importlib
import importlib.util
import json
import math
import numbers
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from alignment.errors import UserError

START_TIMEOUT_S = 60.0  # the worker imports the user's file once; a loaded machine can be slow
MAX_TIMEOUT_S = 86400.0  # --reward_timeout: a day per call is no bound at all; far above it select() overflows
ARGUMENTS = ("response", "ground_truth")  # the function's own arguments, which no column may be named
KEYS = ("format_reward", "answer_reward")  # the optional parts of a reward dict


def zero_failed_parts(scores: list[dict]) -> list[dict]:
    """The scores with a failed call's parts set to 0 where another call returned that part: a failure scores its
    sample 0, format and answer included, so a mean over the samples counts it; a part no working call returned stays
    absent (NaN). Without this, a reward that raises on bad answers would leave them out of the format and answer rates."""
    returned = {key for s in scores if not s.get("reward_failed") for key in KEYS if not math.isnan(s.get(key, math.nan))}
    return [{**s, **dict.fromkeys(returned, 0.0)} if s.get("reward_failed") else s for s in scores]


def split_spec(spec: str) -> tuple[str, str]:
    """`file.py:name` or `module:name` -> (file or module, name), refused in one line when malformed."""
    where, colon, name = spec.rpartition(":")
    if not colon or not where or not name.isidentifier():
        raise UserError(f"--reward_fn {spec}: write path/to/file.py:function_name or package.module:function_name.")
    if where.endswith(".py") and not Path(where).is_file():
        raise UserError(f"--reward_fn {spec}: {where} does not exist; check the path.")
    if not where.endswith(".py") and not all(part.isidentifier() for part in where.split(".")):
        raise UserError(f"--reward_fn {spec}: {where} is neither a .py file nor a module name (package.module); write "
                        f"path/to/file.py:function_name or package.module:function_name.")
    return where, name


def check_timeout(timeout: float):
    """--reward_timeout up to MAX_TIMEOUT_S: a larger one overflowed the worker's clock with a traceback."""
    if timeout > MAX_TIMEOUT_S:
        raise UserError(f"--reward_timeout {timeout:g} is above the largest, {MAX_TIMEOUT_S:g} s (a day per call): "
                        f"lower it.")


def check_columns(spec: str, rows) -> None:
    """A column named as one of the function's own arguments would reach it twice (`got multiple values for
    argument`, on every call): refused before any model loads, naming the column to rename."""
    clash = sorted({key for row in rows for key in row.get("columns", {})} & set(ARGUMENTS))
    if clash:
        raise UserError(f"--reward_fn {spec}: the data has a column named {clash[0]}, which would collide with the "
                        f"reward's own argument {clash[0]} (it is called as name(response, ground_truth, **columns)): "
                        f"rename the column in the file.")


def source_hash(spec: str) -> str:
    """The sha256 of the reward's source file (a module's, found without importing it; a dotted name imports its
    parent package, whose failure to import is the user's to see in one line)."""
    where, _ = split_spec(spec)
    try:
        path = where if where.endswith(".py") else getattr(importlib.util.find_spec(where), "origin", None)
    except Exception as e:  # ModuleNotFoundError for a missing parent package, or whatever its __init__ raised
        raise UserError(f"--reward_fn {spec}: no module {where} is importable here ({type(e).__name__}: {e}); "
                        f"give a file path instead.") from None
    if not path or not Path(path).is_file():
        raise UserError(f"--reward_fn {spec}: no module {where} is importable here; give a file path instead.")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def recall_returned(score, records: list[dict]):
    """After --resume: the parts the run's earlier steps and evaluations read (not null) were returned by the
    function, so a later step whose calls all fail reads 0 there, as in a run never stopped (a new process's worker
    has seen no call)."""
    reward = getattr(score, "user_reward", None)
    if reward is not None:
        reward.returned |= {key for record in records for key in KEYS for name in (key, f"eval_avg_{key}s")
                            if isinstance(record.get(name), (int, float)) and not math.isnan(record[name])}


class UserReward:
    """`reward(response, ground_truth, columns) -> {reward, format_reward, answer_reward, reward_failed}` (the
    optional parts NaN when the function does not return them), and `errors`: each failure's line, in order."""

    def __init__(self, spec: str, timeout: float):
        self.spec, self.timeout, self.errors, self.returned = spec, timeout, [], set()  # the parts a call returned
        self.told = set()  # the failures' lines said in the run's log (news)
        split_spec(spec)
        check_timeout(timeout)
        self.sha256 = source_hash(spec)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), *sys.path] if p),
                   ALIGNMENT_REWARD_TIMEOUT=str(timeout))
        self.proc = subprocess.Popen([sys.executable, "-u", os.path.abspath(__file__), spec], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, bufsize=0)
        self.buffer = b""
        ready = self._reply(time.monotonic() + START_TIMEOUT_S)
        if not ready or "error" in ready:
            try:  # an import that ended the process (os._exit, a crash) is not a slow start
                ended = self.proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                ended = None
            self.close()
            why = (ready["error"] if ready else f"the worker did not start in {START_TIMEOUT_S:.0f} s" if ended is None
                   else f"the worker ended (exit status {ended}) while importing it; what it printed above says why")
            raise UserError(f"--reward_fn {spec}: {why}.")

    def __call__(self, response: str, ground_truth: str, columns: dict) -> dict:
        request = json.dumps({"response": response, "ground_truth": ground_truth, "columns": columns},
                             default=str) + "\n"
        try:
            self.proc.stdin.write(request.encode())
            reply = self._reply(time.monotonic() + self.timeout + 5.0)  # the worker answers by the timeout itself
        except (BrokenPipeError, OSError):
            reply = None
        if reply is None:  # the worker itself is gone or stuck (it never should be): a failure, and a new worker
            self.close()
            kept = self.errors, self.returned, self.told  # the failures so far are still the run's
            self.__init__(self.spec, self.timeout)
            self.errors, self.returned, self.told = kept
            reply = {"error": "the reward worker stopped answering"}
        if "error" in reply:
            self.errors.append(reply["error"])
            # 0 in the parts an earlier call returned (a step whose calls all fail reads 0, not absent); the batch's
            # other calls settle the rest (zero_failed_parts)
            return {"reward": 0.0, **{key: 0.0 if key in self.returned else math.nan for key in KEYS}, "reward_failed": 1.0}
        self.returned.update(key for key in KEYS if key in reply)
        return {"reward": reply["reward"], **{key: reply.get(key, math.nan) for key in KEYS}, "reward_failed": 0.0}

    def news(self, kinds: int = 5) -> list[str]:
        """The first failure line of each kind not told before (its text up to the first colon: `ValueError`,
        `TimeoutError`), at most `kinds` kinds in a run: where a step line's "reward failures N" comes from
        (evaluate's summary gives its first)."""
        fresh = []
        for error in self.errors:
            kind = error.split(":")[0]
            if len(self.told) >= kinds:
                break
            if kind not in self.told:
                self.told.add(kind)
                fresh.append(error)
        return fresh

    def _reply(self, deadline: float) -> dict | None:
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---------------------------------------------------------------------------------------------------
# Worker side: everything below runs only in the worker process.

def _load(spec: str):
    where, name = spec.rpartition(":")[::2]
    if where.endswith(".py"):
        loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{where} has no function {name}")
    return function


def _checked(value) -> dict:
    """A number, or {reward, format_reward?, answer_reward?} of numbers, as finite floats; anything else is nonsense.
    A number is what a reward naturally returns: a float, an int, a bool (0/1), a numpy scalar or 0-d array (numpy's
    bool is no numbers.Real, hence the dtype) or a 0-d torch tensor; text, None, complex and arrays are refused, not
    guessed at."""
    def number(v, what):
        dtype = getattr(v, "dtype", None)
        real = isinstance(v, numbers.Real) or (getattr(v, "shape", None) == () and (
            getattr(dtype, "kind", None) in ("b", "i", "u", "f")  # numpy
            or getattr(dtype, "is_complex", True) is False))  # torch: a real dtype (float, int or bool)
        if not real:
            raise TypeError(f"{what} is {json.dumps(v, default=repr)[:60]}, not a real number")
        if not math.isfinite(float(v)):
            raise TypeError(f"{what} is {json.dumps(float(v))}, not a finite number")
        return float(v)
    if not isinstance(value, dict):
        return {"reward": number(value, "the return value")}
    unknown = set(value) - {"reward", *KEYS}
    if "reward" not in value or unknown:
        raise TypeError(f"it returned a dict with keys {sorted(value)}; give reward and optionally {', '.join(KEYS)}")
    return {key: number(value[key], key) for key in ("reward", *KEYS) if key in value}


def _serve(spec: str):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle: it closes our stdin, which ends us
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own copy of stdout
    os.dup2(2, 1)  # what the user's code prints goes to stderr, never into the replies
    try:
        function = _load(spec)
    except SystemExit as e:  # exit() at import (a script's guard, argparse): say so, not "did not start"
        print(json.dumps({"error": f"cannot load it (its import raised SystemExit: {e})"}), file=replies)
        return
    except Exception as e:  # the user's file: any error is theirs to see, in one line
        print(json.dumps({"error": f"cannot load it ({type(e).__name__}: {e})"}), file=replies)
        return
    print(json.dumps({"ready": True}), file=replies)
    for line in sys.stdin:
        request = json.loads(line)
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:  # one call, in its own process: a hang or a crash takes only it
            os.close(read_fd)
            try:
                result = _checked(function(request["response"], request["ground_truth"], **request["columns"]))
            except BaseException as e:  # SystemExit too: the child must reach os._exit, not run on as a worker
                result = {"error": f"{type(e).__name__}: {e}"[:300]}
            os.write(write_fd, json.dumps(result).encode())
            os._exit(0)
        os.close(write_fd)
        limit, answer = float(os.environ.get("ALIGNMENT_REWARD_TIMEOUT", "10")), b""
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            ready = select.select([read_fd, 0], [], [], max(left, 0))[0] if left > 0 else []
            if ready == [0]:  # the run sends nothing during a call: its stdin readable is its end (EOF), a run
                os.kill(child, signal.SIGKILL)  # stopped at once: the call ends with it, not at its time limit
                os.waitpid(child, 0)
                return
            if not ready:
                os.kill(child, signal.SIGKILL)
                answer = json.dumps({"error": f"it took more than {limit:g} s (--reward_timeout)"}).encode()
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            answer += chunk
        os.close(read_fd)
        os.waitpid(child, 0)
        print((answer or b'{"error": "it ended its process without an answer"}').decode(), file=replies)


if __name__ == "__main__":
    try:
        _serve(sys.argv[1])
    except BrokenPipeError:  # the parent exited
        sys.exit(0)
