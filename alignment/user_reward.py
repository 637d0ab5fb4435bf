"""A reward of your own: `--reward_fn path/to/file.py:name` or `--reward_fn package.module:name`.

    def name(response: str, ground_truth: str, **columns) -> float | dict

`columns` are the question's row, every column but the answer one, by name (a file's own columns; `question`
for the built-in sets); a column named `response` or `ground_truth` would collide with the first two arguments and
is refused before any model loads (`check_columns`). It returns a real number (a float, an int, a bool as 0/1, a
numpy scalar), or a dict with `reward` and optionally `format_reward` and `answer_reward` (evaluate's three
metrics; one it does not return is reported as absent, not as zero; pass@k reads answer_reward 1 as right).

A batched reward, for one that scores many answers at once (a reward model, a verifier), says so with an attribute:

    def name(responses: list[str], ground_truths: list[str], columns: list[dict]) -> list[float | dict]
    name.batched = True

It gets lists (one entry per answer; `columns[i]` is answer i's row) and returns a list (a tuple, a 1-D array) of
the same length, each entry as above. `UserReward.many` sends it a whole list in one call; one answer is a list of one.

It runs in one worker process per run, started as `python -P` with the user's import path (a file's own folder
first, then the working directory and the run's sys.path, never alignment/: `import evaluate` is Hugging Face's),
which imports the file once and calls the function for every answer: what it loads, caches or imports stays for
the next call. `--reward_timeout` (at most a day) bounds each call of the function, a batched call as a whole. A call
that passes its time, raises, or returns something that is not a finite real number scores its sample 0 (a batched
call that raises, passes its time or returns a wrong length: each of its samples) and is counted (`reward_failed`); it
never stops or hangs the run. A call past its time, or one that ends the worker (os._exit, a crash), costs its
samples and the worker: the next call starts a new one (its module state starts over, as at a resume), which
refuses to load the file if it changed since the run began. The worker leads a process group of its own: what a
reward forks is killed with it, at close, at a restart and when the run ends (the worker's stdin closing, even by
kill -9, ends the group). The same function scores training and evaluation; its file's sha256 goes into the run's
config, so a resume after the file changed is refused unless asked for.

The parent side is stdlib only; this file doubles as the worker's script.
"""

import atexit
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from alignment.errors import UserError

START_TIMEOUT_S = 60.0  # the worker imports the user's file once (or --reward_timeout where longer: a model it loads)
MAX_TIMEOUT_S = 86400.0  # --reward_timeout: a day per call is no bound at all; far above it select() overflows
ARGUMENTS = ("response", "ground_truth")  # the function's own arguments, which no column may be named
KEYS = ("format_reward", "answer_reward")  # the optional parts of a reward dict
PACKAGE_DIR = Path(__file__).resolve().parent  # never on a user's import path (its evaluate.py, data.py, ...)


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
        found = where if where.endswith(".py") else importlib.util.find_spec(where)
    except Exception as e:  # ModuleNotFoundError for a missing parent package, or whatever its __init__ raised
        raise UserError(f"--reward_fn {spec}: no module {where} is importable here ({type(e).__name__}: {e}); "
                        f"give a file path instead.") from None
    if found is None:
        raise UserError(f"--reward_fn {spec}: no module {where} is importable here; give a file path instead.")
    path = found if isinstance(found, str) else found.origin
    if not path or not Path(path).is_file():  # os.path is posixpath, frozen into Python; sys is built in
        raise UserError(f"--reward_fn {spec}: {where} is importable, but it has no source file ({path or 'none'}) "
                        f"whose sha256 the run could record, so it is no reward of yours: write your reward in a .py "
                        f"file and give path/to/file.py:function_name.")
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def recall_returned(score, records: list[dict]):
    """After --resume: the parts the run's earlier steps and evaluations read (not null) were returned by the
    function, so a later step whose calls all fail reads 0 there, as in a run never stopped (a new process's worker
    has seen no call)."""
    reward = getattr(score, "user_reward", None)
    if reward is not None:
        reward.returned |= {key for record in records for key in KEYS for name in (key, f"eval_avg_{key}s")
                            if isinstance(record.get(name), (int, float)) and not math.isnan(record[name])}


def import_path() -> str:
    """The worker's PYTHONPATH: the working directory and the run's sys.path, without the package's own folder, whose
    modules would shadow the user's. (A file's own folder goes first once the worker has imported its own modules:
    `_load`.)"""
    paths = [os.getcwd(), *sys.path]
    return os.pathsep.join(dict.fromkeys(p for p in paths if p and Path(p).resolve() != PACKAGE_DIR))


OPEN = []  # the workers this process started and has not closed (closes_workers ends them with the call)


def closes_workers(main):
    """`main` that ends every reward worker it started when it returns or raises (train_rl and expert_iteration
    called in-process, as tests and notebooks do, left theirs running until the interpreter exited)."""
    @functools.wraps(main)  # (its __wrapped__ is `main`)
    def wrapped(*args, **kwargs):
        before = len(OPEN)
        try:
            return main(*args, **kwargs)
        finally:
            for reward in OPEN[before:]:
                reward.close()
    return wrapped


class UserReward:
    """`reward(response, ground_truth, columns) -> {reward, format_reward, answer_reward, reward_failed}` (the
    optional parts NaN when the function does not return them), `many(responses, ground_truths, columns)` for a list
    of them, and `errors`: each failed sample's line, in order."""

    def __init__(self, spec: str, timeout: float):
        self.spec, self.timeout, self.errors, self.returned = spec, timeout, [], set()  # the parts a call returned
        self.told = set()  # the failures' lines said in the run's log (news)
        split_spec(spec)
        check_timeout(timeout)
        self.sha256 = source_hash(spec)
        self.proc, self.owner = None, os.getpid()  # a forked copy of the run must not end the run's worker
        atexit.register(self.close)  # a worker that died between calls may have left children behind
        OPEN.append(self)
        why = self._start()
        if why:
            raise UserError(f"--reward_fn {spec}: {why}.")

    def __call__(self, response: str, ground_truth: str, columns: dict) -> dict:
        return self.many([response], [ground_truth], [columns])[0]

    def many(self, responses: list[str], ground_truths: list[str], columns: list[dict]) -> list[dict]:
        """One score per answer: a batched function in one call, any other in one call per answer."""
        if self.batched:
            replies = self._call(responses, ground_truths, columns)
        else:
            replies = [reply for one in zip(responses, ground_truths, columns) for reply in self._call(*map(list, zip(one)))]
        return [self._score(reply) for reply in replies]

    def _score(self, reply: dict) -> dict:
        if "error" in reply:
            self.errors.append(reply["error"])
            # 0 in the parts an earlier call returned (a step whose calls all fail reads 0, not absent); the batch's
            # other calls settle the rest (zero_failed_parts)
            return {"reward": 0.0, **{key: 0.0 if key in self.returned else math.nan for key in KEYS}, "reward_failed": 1.0}
        self.returned.update(key for key in KEYS if key in reply)
        return {"reward": reply["reward"], **{key: reply.get(key, math.nan) for key in KEYS}, "reward_failed": 0.0}

    def _call(self, responses: list[str], ground_truths: list[str], columns: list[dict]) -> list[dict]:
        """One call of the function in the worker: a reply per answer (a score, or {error}). A worker that is gone
        is started first (not charged to the call's time); one that passes the time or ends is replaced after it."""
        if self.proc is None:
            why = self._start()
            if why:
                return [{"error": f"the reward worker did not restart: {why}"}] * len(responses)
        request = json.dumps({"responses": responses, "ground_truths": ground_truths, "columns": columns}, default=str)
        try:
            self.proc.stdin.write(request.encode() + b"\n")
            reply = self._reply(time.monotonic() + self.timeout)
        except OSError:  # BrokenPipeError: it ended between calls
            reply = None
        if reply is None:
            try:
                ended = self.proc.wait(timeout=0.2)  # a worker that closed its end of the pipe is ending
            except subprocess.TimeoutExpired:
                ended = None
            self.close()
            why = f"it took more than {self.timeout:g} s (--reward_timeout)" if ended is None else \
                f"it ended the reward worker (exit status {ended})"
            reply = {"error": f"{why}; the next call starts a new worker"}
        return reply.get("scores") or [reply] * len(responses)

    def _start(self) -> str | None:
        """Start the worker and wait for it to import the file: None once it is ready, else why not."""
        env = dict(os.environ, PYTHONPATH=import_path(), ALIGNMENT_REWARD_SHA256=self.sha256)
        self.proc = subprocess.Popen([sys.executable, "-P", "-u", os.path.abspath(__file__), self.spec], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True)
        self.buffer = b""
        start_timeout = max(START_TIMEOUT_S, self.timeout)
        ready = self._reply(time.monotonic() + start_timeout)
        if ready and "ready" in ready:
            self.batched = ready["batched"]
            return None
        try:  # an import that ended the process (os._exit, a crash) is not a slow start
            ended = self.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            ended = None
        self.close()
        if ready:
            return ready["error"]
        if ended is None:
            return (f"its import took more than {start_timeout:g} s (the longer of {START_TIMEOUT_S:g} s and "
                    f"--reward_timeout): raise --reward_timeout for a file that loads something slow")
        return f"the worker ended (exit status {ended}) while importing it; what it printed above says why"

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
        """The worker's next line, or None past `deadline` or once the worker is gone. A child the reward forked
        holds the pipe open after the worker's end, so its exit is watched too, not only the pipe's end."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not select.select([fd], [], [], min(left, 0.5))[0]:
                if self.proc.poll() is not None and not select.select([fd], [], [], 0)[0]:
                    return None
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def close(self):
        """End the worker and everything in its process group (what the reward forked), in the run's own process."""
        if self.proc is None or os.getpid() != self.owner:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:  # the group is empty: nothing left to end
            pass
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()
        self.proc = None
        if self in OPEN:
            OPEN.remove(self)


# ---------------------------------------------------------------------------------------------------
# Worker side: everything below runs only in the worker process.

def _load(spec: str):
    """(the function, whether it is batched), from the file the run recorded and no other."""
    where, name = spec.rpartition(":")[::2]
    recorded, now = os.environ.get("ALIGNMENT_REWARD_SHA256"), source_hash(spec)
    if recorded and now != recorded:
        raise RuntimeError(f"its file changed since the run began (sha256 {recorded[:12]} then, {now[:12]} now): "
                           f"restore it")
    if where.endswith(".py"):  # its folder first, as `python file.py` has it; added only now, after the worker's own
        sys.path.insert(0, str(Path(where).resolve().parent))  # imports (a reward file named numbers.py shadowed them)
        loaded = importlib.util.spec_from_file_location(Path(where).stem, where)
        module = importlib.util.module_from_spec(loaded)
        loaded.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    function = getattr(module, name, None)
    if not callable(function):
        raise AttributeError(f"{where} has no function {name}")
    batched = getattr(function, "batched", False) is True
    form = f"{name}(responses, ground_truths, columns)" if batched else f"{name}(response, ground_truth, **columns)"
    try:
        inspect.signature(function).bind_partial(*["x"] * (3 if batched else 2))  # (columns come by name)
    except ValueError:  # a builtin without a signature: its calls will say
        pass
    except TypeError:  # a function of other arguments: every call would fail
        raise TypeError(f"{name}{inspect.signature(function)} cannot be called as {form}") from None
    return function, batched


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


def _error(e: BaseException) -> dict:
    return {"error": f"{type(e).__name__}: {e}"[:300]}


def _answer(function, batched: bool, request: dict) -> dict:
    """{"scores": one per answer} or, when the whole call failed, {"error": ...} (each of its answers' failure)."""
    responses, truths, columns = request["responses"], request["ground_truths"], request["columns"]
    try:
        if not batched:
            values = [function(responses[0], truths[0], **columns[0])]
        else:
            values = function(responses, truths, columns)
            if not isinstance(values, (list, tuple)) and getattr(values, "ndim", None) != 1:
                raise TypeError(f"a batched reward returns a list, one value per answer, not "
                                f"{json.dumps(values, default=repr)[:60]}")
            if len(values) != len(responses):
                raise TypeError(f"it returned {len(values)} values for {len(responses)} answers")
    except BaseException as e:  # SystemExit too: the worker serves the next call
        return _error(e)
    scores = []
    for value in values:
        try:
            scores.append(_checked(value))
        except TypeError as e:
            scores.append(_error(e))
    return {"scores": scores}


def _read(requests, lines: queue.SimpleQueue):
    """The run's requests into `lines`, read while a call runs: the end of stdin (the run closed it, or is gone,
    kill -9 included) ends the worker at once, mid-call too, with whatever its calls forked (its process group)."""
    for line in requests:
        lines.put(line)
    if os.getpgid(0) == os.getpid():  # started by UserReward: the group is ours alone
        os.killpg(0, signal.SIGKILL)
    os._exit(0)


def _serve(spec: str):
    replies = os.fdopen(os.dup(1), "w", buffering=1)  # the protocol's own copies of stdin and stdout
    requests = os.fdopen(os.dup(0), "r")
    os.dup2(2, 1)  # what the user's code prints goes to stderr, never into the replies
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # and what it reads is not the run's requests
    try:
        function, batched = _load(spec)
    except SystemExit as e:  # exit() at import (a script's guard, argparse): say so, not "did not start"
        print(json.dumps({"error": f"cannot load it (its import raised SystemExit: {e})"}), file=replies)
        return
    except Exception as e:  # the user's file: any error is theirs to see, in one line
        print(json.dumps({"error": f"cannot load it ({type(e).__name__}: {e})"}), file=replies)
        return
    print(json.dumps({"ready": True, "batched": batched}), file=replies)
    lines = queue.SimpleQueue()
    threading.Thread(target=_read, args=(requests, lines), daemon=True).start()
    while True:
        print(json.dumps(_answer(function, batched, json.loads(lines.get()))), file=replies)


if __name__ == "__main__":
    try:
        _serve(sys.argv[1])
    except BrokenPipeError:  # the parent exited
        sys.exit(0)
