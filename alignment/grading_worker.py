"""Bounded-time symbolic equivalence for the grader: sympy and math-verify behind a watchdog.

sympy can hang on a short string (`9^9^9^9`) inside C code that no signal or thread can interrupt, and
signal-based timeouts (math-verify's own) only work on the main thread. So the slow checks run in a
separate "zygote" process that imports sympy once and forks a child per request; the zygote kills any
child that passes its deadline and answers "not equal". The zygote is started with subprocess (not
multiprocessing), so it also works inside daemonic multiprocessing.Pool workers and worker threads.

The parent side (`symbolic_equal`) is stdlib only; this file doubles as the zygote's script.
"""

import json
import math
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

STARTUP_TIMEOUT_S = 60.0  # importing sympy + math-verify takes ~2 s; a loaded CI box can be far slower
MAX_MAGNITUDE_DIGITS = 400  # numbers bigger than 10**400 are never real answers; refuse to build them


class _Zygote:
    """One per process (re-created after fork); calls are serialised by a lock."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None
        self.pid = None  # the owning process; a forked child must not talk to its parent's zygote
        self.buffer = b""
        self.ready = False

    def _start(self):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        self.proc = subprocess.Popen(
            [sys.executable, "-P", "-u", os.path.abspath(__file__)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
        )
        self.pid, self.buffer, self.ready = os.getpid(), b"", False

    def _read_line(self, deadline):
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
        return line

    def ensure_started(self):
        if self.proc is None or self.pid != os.getpid() or self.proc.poll() is not None:
            self._start()

    def call(self, request, deadline):
        # Waiting for the lock counts against the deadline, so a busy zygote means "not equal", not a stall.
        if not self.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return None
        try:
            self.ensure_started()
            if not self.ready:  # the one-off import cost is not charged to the caller's deadline
                if self._read_line(time.monotonic() + STARTUP_TIMEOUT_S) != b"ready":
                    raise RuntimeError("grading worker failed to start (could not import sympy/math-verify?)")
                self.ready = True
                deadline = max(deadline, time.monotonic() + 1.0)
            request = dict(request, timeout=max(0.05, deadline - time.monotonic()))
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            line = self._read_line(deadline + 0.5)  # the zygote answers by the deadline itself
            if line is None:  # the zygote itself is stuck: replace it
                self.proc.kill()
                self.proc = None
                return None
            return json.loads(line)
        finally:
            self.lock.release()


_ZYGOTE = _Zygote()


def warm_up():
    """Start the worker (non-blocking) so the first slow comparison does not wait for its imports."""
    if _ZYGOTE.proc is None or _ZYGOTE.pid != os.getpid():
        with _ZYGOTE.lock:
            _ZYGOTE.ensure_started()


def symbolic_equal(given, truth, deadline, use_math_verify=False):
    """True if sympy (or math-verify) shows the two answer strings are equal before `deadline`."""
    reply = _ZYGOTE.call({"given": given, "truth": truth, "math_verify": use_math_verify}, deadline)
    return bool(reply and reply.get("equal"))


# ---------------------------------------------------------------------------------------------------
# Zygote side: everything below runs only in the worker process.

_FUNCTIONS = {"sqrt", "pi", "oo", "I", "E", "log", "exp", "sin", "cos", "tan", "cot", "sec", "csc",
              "asin", "acos", "atan", "Abs"}
_LATEX_WORDS = {r"\pi": " pi ", r"\infty": " oo ", r"\cdot": "*", r"\times": "*", r"\div": "/",
                r"\ln": " log ", r"\log": " log ", r"\exp": " exp ", r"\sin": " sin ", r"\cos": " cos ",
                r"\tan": " tan ", r"\cot": " cot ", r"\sec": " sec ", r"\csc": " csc ",
                r"\arcsin": " asin ", r"\arccos": " acos ", r"\arctan": " atan "}


def _braced(s, i):
    """(content, index after) for the brace group starting at s[i], or a single character argument."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_sympy_text(s):
    """A small LaTeX -> sympy-syntax translation: \\frac, \\sqrt, ^, named constants and functions."""
    out, i = [], 0
    while i < len(s):
        if s.startswith(r"\frac", i):
            num, i = _braced(s, i + 5)
            den, i = _braced(s, i)
            out.append(f"(({latex_to_sympy_text(num)})/({latex_to_sympy_text(den)}))")
        elif s.startswith(r"\sqrt", i):
            root = "2"
            if s.startswith("[", i + 5):
                end = s.index("]", i + 5)
                root, i = latex_to_sympy_text(s[i + 6:end]), end + 1
            else:
                i += 5
            arg, i = _braced(s, i)
            out.append(f"(({latex_to_sympy_text(arg)})**(1/({root})))")
        elif s[i] == "\\":
            word = next((w for w in sorted(_LATEX_WORDS, key=len, reverse=True) if s.startswith(w, i)), None)
            if word is None:
                raise ValueError(f"unsupported LaTeX at {s[i:i + 10]!r}")
            out.append(_LATEX_WORDS[word])
            i += len(word)
        else:
            out.append({"{": "(", "}": ")", "^": "**"}.get(s[i], s[i]))
            i += 1
    return "".join(out)


def _magnitude(expr):
    """Upper bound on log10|value| of a numeric subtree; huge means 'refuse to evaluate'."""
    import math

    import sympy

    if expr.is_Integer:
        return len(str(abs(int(expr))))
    if expr.is_Rational:
        return max(_magnitude(sympy.Integer(expr.p)), _magnitude(sympy.Integer(expr.q)))
    if expr.is_Float or expr.is_Atom:
        return 1.0
    kids = [_magnitude(a) for a in expr.args]
    if expr.is_Pow:
        base, power = kids
        if power > 7:  # exponent above ~10**7: a tower
            return math.inf
        try:  # safe to evaluate now that the exponent is known to be small
            power_value = abs(complex(expr.args[1]))
        except (TypeError, ValueError):
            power_value = 10 ** power
        return (base + 1) * max(1.0, power_value)
    return sum(kids) + 1


def _to_sympy(text):
    import sympy
    from sympy.parsing.sympy_parser import (convert_xor, implicit_multiplication_application,
                                            parse_expr, standard_transformations)

    body = latex_to_sympy_text(text)
    # parse_expr evaluates Python: allow only arithmetic characters, and split every unknown name into
    # single-letter symbols (`xy` -> `x*y`) so no Python builtin can ever be named.
    if any(c not in "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ+-*/()., " for c in body):
        raise ValueError("characters outside arithmetic")
    if re.search(r"\.(?!\d)", body):
        raise ValueError("attribute access")
    body = re.sub(r"[A-Za-z]+", lambda m: m[0] if m[0] in _FUNCTIONS else "*".join(m[0]), body)
    transformations = standard_transformations + (implicit_multiplication_application, convert_xor)
    local = {w: sympy.Symbol(w) for w in set(re.findall(r"[A-Za-z]+", body)) if w not in _FUNCTIONS}
    local["i"] = sympy.I  # MATH answers use i for the imaginary unit
    expr = parse_expr(body, local_dict=local, transformations=transformations, evaluate=False)
    if _magnitude(expr) > MAX_MAGNITUDE_DIGITS:
        raise OverflowError("number too large")
    return expr


def _exact(x):
    """`x` with each float in it as the decimal it writes, exactly (`4.56 \\times 10^{7}` is 45600000, `0.07 \\times
    100` is 7, `1.2345678901e10` is 12345678901), for comparing against an integer gold: sympy's binary floats would
    leave them a rounding away (and Float == Integer is False in sympy)."""
    import sympy

    return x.xreplace({f: sympy.Rational(str(f)) for f in x.atoms(sympy.Float) if f.is_finite})


def _sympy_equal(given, truth):
    import sympy

    if given.count("=") != truth.count("=") or given.count("=") > 1:
        return False
    if "=" in truth:  # equations: same up to moving terms across and flipping sides
        g, t = (_to_sympy(a) - _to_sympy(b) for a, b in (given.split("="), truth.split("=")))
        return sympy.simplify(g - t) == 0 or sympy.simplify(g + t) == 0
    g, t = _to_sympy(given), _to_sympy(truth)
    if g.is_number and t.is_number:  # an integer gold (`1.2345678901e10` too) only by the same integer (a 10-digit
        exact_truth = sympy.simplify(_exact(t))  # (evaluated: `2 \cdot 617283945`, `10^3` are integers too)
        if exact_truth.is_Integer:  # product one off, or half off, is wrong), the answer's decimals taken as written
            return sympy.simplify(_exact(g) - exact_truth) == 0
        difference = sympy.simplify(g - t)  # exact numbers exactly; with a float or an irrational in it, within a
        if difference == 0 or difference.is_Rational:  # relative 1e-9 (`0.3333333333333` against 1/3)
            return difference == 0
        diff = abs(complex(sympy.N(difference, 30)))
        scale = max(abs(complex(sympy.N(g, 30))), abs(complex(sympy.N(t, 30))))
        return math.isfinite(scale) and diff <= 1e-9 * scale  # an infinity is equal only as itself (above)
    return sympy.simplify(g - t) == 0


def _math_verify_equal(given, truth):
    from math_verify import parse, verify

    gold = parse(f"${truth}$", parsing_timeout=None)
    answer = parse(f"${given}$", parsing_timeout=None)
    return bool(gold and answer and verify(gold, answer, timeout_seconds=None))


def _answer(request):
    equal = False
    try:
        equal = _sympy_equal(request["given"], request["truth"])
    except OverflowError:  # a number bomb: math-verify would only grind on it too
        return False
    except Exception:  # unparsable input simply means "not shown equal"; math-verify may still try
        equal = False
    if not equal and request.get("math_verify"):
        try:
            equal = _math_verify_equal(request["given"], request["truth"])
        except Exception:  # math-verify's own parse errors: not equal
            equal = False
    return equal


def _serve():
    import logging

    # a Ctrl-C at the terminal reaches the whole process group: the parent decides what stops (a training step
    # is finished and saved first, and needs its grades); the worker ends when the parent closes its stdin
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    import math_verify  # noqa: F401  (imported once here so every forked child starts warm)
    import sympy  # noqa: F401

    logging.disable(logging.WARNING)  # math-verify warns once that its own timeout is off: ours is on
    _answer({"given": "(x+1)^2", "truth": "x^2+2x+1", "math_verify": True})  # fill caches forks inherit
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        read_fd, write_fd = os.pipe()
        child = os.fork()
        if child == 0:
            os.close(read_fd)
            os.write(write_fd, b"1" if _answer(request) else b"0")
            os._exit(0)
        os.close(write_fd)
        done = select.select([read_fd], [], [], request["timeout"])[0]
        result = os.read(read_fd, 1) if done else b""
        os.close(read_fd)
        if not done:
            os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        print(json.dumps({"equal": result == b"1", "timed_out": not done}), flush=True)


if __name__ == "__main__":
    try:
        _serve()
    except BrokenPipeError:  # the parent exited (e.g. right after starting us): nothing left to answer
        sys.exit(0)
