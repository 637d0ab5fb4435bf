"""Attack and normal cases for alignment.sandbox. Each attack checks the result seen from inside (ok /
error / timed_out) and that the host is unharmed as seen from outside."""

import os
import platform
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from alignment import sandbox
from alignment.sandbox import ExecResult, Sandbox, run_code

REPO = Path(__file__).resolve().parents[1]
CANARY = "sandbox-canary-" + uuid.uuid4().hex


@pytest.fixture(scope="module")
def sb():
    os.environ["SANDBOX_TEST_SECRET"] = CANARY  # set before the zygotes start: they must not inherit it
    box = Sandbox(workers=2)
    box.run("pass")
    yield box
    box.close()
    del os.environ["SANDBOX_TEST_SECRET"]


def test_layers_active_here(sb):
    assert {"seccomp", "rlimits", "namespaces", "uid drop"} <= set(sb.layers)


# ---- normal use --------------------------------------------------------------------------------------


def test_print_numpy_sympy(sb):
    assert sb.run("print(1 + 1)") == ExecResult(ok=True, stdout="2\n", error=None, timed_out=False)
    r = sb.run("import numpy as np\nprint(np.linalg.solve([[2.0, 0], [0, 4]], [2, 8]).tolist())")
    assert r.ok and r.stdout == "[1.0, 2.0]\n"
    r = sb.run("import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**2 - 1), sp.integrate(2*x, x))")
    assert r.ok and r.stdout == "(x - 1)*(x + 1) x**2\n"
    r = sb.run("import fractions, statistics, itertools\nprint(fractions.Fraction(2, 6), statistics.mean([1, 2]))")
    assert r.ok and r.stdout == "1/3 1.5\n"


def test_threads_work(sb):
    r = sb.run("import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n"
               "[t.start() for t in ts]; [t.join() for t in ts]\nprint(sorted(out))")
    assert r.ok and r.stdout == "[0, 1, 2, 3]\n"


def test_exceptions_give_last_traceback_line(sb):
    r = sb.run("print('before')\nprint(a)")
    assert r == ExecResult(ok=False, stdout="before\n", error="NameError: name 'a' is not defined", timed_out=False)
    assert sb.run("def f():\n    return 1 / 0\nf()").error == "ZeroDivisionError: division by zero"
    assert sb.run("print(1").error.startswith("SyntaxError")
    assert sb.run("import sys; sys.exit(0)").ok
    r = sb.run("import sys; sys.exit(3)")
    assert not r.ok and r.error == "SystemExit: 3"


def test_output_is_capped(sb):
    r = sb.run("import sys; sys.stdout.write('a' * 200 + 'b' * 1000 + 'c' * 200)")
    assert r.ok and r.stdout == "a" * 128 + "..." + "c" * 128
    assert sb.run("print('x' * 255, end='')").stdout == "x" * 255


def test_huge_output(sb):
    r = sb.run("import sys\nsys.stdout.write('h' * 10 + 'm' * (200 << 20) + 't' * 10)", timeout=10)
    assert r.ok and r.stdout.startswith("h" * 10 + "m") and r.stdout.endswith("m" + "t" * 10)
    assert len(r.stdout) == 259
    r = sb.run("while True:\n    print('y' * 1000)", timeout=1)
    assert r.timed_out and len(r.stdout) == 259


def test_scratch_dir_is_fresh_each_call(sb):
    first = sb.run("import os\nopen('state.txt', 'w').write('x')\nprint(os.getcwd())")
    assert first.ok
    second = sb.run(f"import os\nprint(os.listdir('.'), os.path.exists({first.stdout.strip()!r}))")
    assert second.ok and second.stdout == "[] False\n"


def test_concurrent_callers(sb):
    code = "import sympy\nprint(sympy.factorint({n}))"
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda n: sb.run(code.format(n=n)), range(2, 34)))
    assert [r.stdout for r in results] == [f"{__import__('sympy').factorint(n)}\n" for n in range(2, 34)]


def test_module_level_run_code(sb, monkeypatch):
    monkeypatch.setattr(sandbox, "_default", sb)  # reuse the started pool: a new one costs seconds
    assert run_code("print(6 * 7)").stdout == "42\n"


# ---- attacks -----------------------------------------------------------------------------------------


def test_network_loopback_blocked(sb):
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = sb.run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert not r.ok and r.error.startswith("PermissionError")
        r = sb.run("import socket\ns = socket.socket(socket.AF_UNIX)")
        assert not r.ok and r.error.startswith("PermissionError")
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected


def test_fork_bomb(sb):
    before = len(os.listdir("/proc"))
    r = sb.run("import os\nwhile True:\n    os.fork()")
    assert not r.ok and r.error.startswith("PermissionError") and not r.timed_out
    r = sb.run("import multiprocessing as mp\np = mp.Process(target=print)\np.start()")
    assert not r.ok
    assert len(os.listdir("/proc")) < before + 10


def test_os_system_and_subprocess(sb, tmp_path):
    marker = tmp_path / "ran"
    r = sb.run(f"import os\nprint(os.system('touch {marker}'))")
    assert r.ok and r.stdout.strip() != "0"  # the shell never started
    r = sb.run(f"import subprocess\nsubprocess.run(['touch', '{marker}'])")
    assert not r.ok and r.error.startswith("PermissionError")
    r = sb.run(f"import os\nos.execv('/usr/bin/touch', ['touch', '{marker}'])")
    assert not r.ok and r.error.startswith("PermissionError")
    assert not marker.exists()


def test_large_allocations_fail(sb):
    r = sb.run("x = bytearray(8 << 30)")
    assert not r.ok and r.error == "MemoryError"
    r = sb.run("import numpy as np\nx = np.ones(1 << 30)")  # 8 GiB of float64
    assert not r.ok and "Unable to allocate" in r.error
    assert sb.run("print('alive')").stdout == "alive\n"


def test_infinite_loop_is_killed(sb):
    start = time.monotonic()
    r = sb.run("import os, threading\nprint(os.getpid(), flush=True)\n"
               "threading.Thread(target=lambda: [0 for _ in iter(int, 1)]).start()\nwhile True:\n    pass", timeout=1)
    assert r.timed_out and not r.ok and r.error.startswith("TimeoutError")
    assert time.monotonic() - start < 3
    assert not os.path.exists(f"/proc/{int(r.stdout)}")  # it did not outlive its timeout
    r = sb.run("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)", timeout=0.5)
    assert r.timed_out


def test_writes_outside_scratch_fail(sb):
    name = "sandbox-pwned-" + uuid.uuid4().hex
    targets = [REPO / name, REPO / "alignment" / "__init__.py", Path("/tmp") / name, Path("/var/tmp") / name,
               Path("/dev/shm") / name, Path.home() / name]
    before = (REPO / "alignment" / "__init__.py").read_bytes()
    for target in targets:
        r = sb.run(f"open({str(target)!r}, 'a').write('pwned')")
        assert not r.ok and r.error.split(":")[0] in ("PermissionError", "OSError", "FileNotFoundError"), r.error
    assert not any(t.exists() for t in targets if t.name == name)
    assert (REPO / "alignment" / "__init__.py").read_bytes() == before


def test_secrets_are_unreadable(sb):
    r = sb.run("print(open('/etc/shadow').read())")
    assert not r.ok and r.error.startswith("PermissionError") and "root" not in r.stdout
    code = ("import glob, os\nfound = [k for k, v in os.environ.items() if 'canary' in v]\n"
            "for p in glob.glob('/proc/*/environ'):\n    try:\n        found += [p] * ('canary' in open(p).read())\n"
            "    except OSError:\n        pass\n"
            f"try:\n    print(open('/proc/{os.getpid()}/environ').read())\nexcept OSError as e:\n    print(e)\n"
            "print('found', found)")
    r = sb.run(code)
    assert r.ok and "found []" in r.stdout and CANARY not in r.stdout
    assert os.environ["SANDBOX_TEST_SECRET"] == CANARY  # the canary really was set in the host


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw syscall numbers are x86_64")
def test_ctypes_tricks(sb):
    code = ("import ctypes\nlibc = ctypes.CDLL(None)\n"
            "print(libc.fork(), libc.syscall(57), libc.syscall(41, 2, 1, 0), libc.setuid(0), libc.kill(-1, 9))")
    r = sb.run(code)
    assert r.ok and r.stdout == "-1 -1 -1 -1 -1\n"  # fork, raw fork, raw socket, setuid(0), kill everyone
    r = sb.run("import ctypes\nctypes.string_at(0)")
    assert not r.ok and r.error == "Killed by signal SIGSEGV"
    assert sb.run("print('alive')").ok


def test_deep_recursion(sb):
    r = sb.run("def f(n):\n    return f(n + 1)\nf(0)")
    assert not r.ok and r.error.startswith("RecursionError")
    start = time.monotonic()  # without a recursion limit it ends in MemoryError, a crash or the timeout
    r = sb.run("import sys\nsys.setrecursionlimit(10**8)\ndef f(n):\n    return f(n + 1)\nf(0)", timeout=2)
    assert not r.ok and time.monotonic() - start < 4
    assert sb.run("print('alive')").ok


def test_dead_zygote_is_replaced(sb):
    sb._all[0].proc.kill()
    results = [sb.run("print(2)") for _ in range(sb.workers)]  # each idle zygote serves one call
    assert sum(not r.ok and r.error.startswith("SandboxError") for r in results) == 1
    assert sb.run("print(3)").stdout == "3\n" and sb.run("print(4)").stdout == "4\n"


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
def test_a_signal_to_the_runs_process_group_leaves_the_zygotes_alone(signum):
    """`timeout`, Slurm or `kill -- -PGID` signal a run's whole process group, and a Ctrl-C the terminal's: the
    run handles it (stops after its step with a checkpoint). Zygotes that got it too died mid-start ("sandbox
    zygote failed to start", a crash with no checkpoint) or printed KeyboardInterrupt tracebacks."""
    import subprocess
    import sys
    script = f"""
import os, signal, threading
from alignment.sandbox import Sandbox
got = []
signal.signal(signal.{signum}, lambda *a: got.append(1))  # the run's own handler: stop after the step
box = Sandbox(workers=2)
threading.Timer(0.3, lambda: os.killpg(0, signal.{signum})).start()  # while the zygotes start (~1 s)
print(box.run("print(6 * 7)").stdout.strip(), got)
box.close()
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0 and done.stdout.split() == ["42", "[1]"], done.stdout + done.stderr
    assert "KeyboardInterrupt" not in done.stderr and "Traceback" not in done.stderr, done.stderr
