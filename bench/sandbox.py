"""Executions per second and per-call latency: alignment.sandbox versus a fresh `python -c` per snippet.

    uv run python bench/sandbox.py [--calls 100]

The sandbox forks a pre-warmed zygote per snippet; the baseline starts a new interpreter (no isolation
at all) that must import sympy itself. Timings are end to end as a caller sees them.
"""

import argparse
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from alignment.sandbox import Sandbox

CASES = {  # name: (code, baseline calls per row; a fresh interpreter importing sympy takes ~0.5 s or more)
    "print(1+1)": ("print(1 + 1)", 20),
    "sympy factor": ("import sympy as sp\nx = sp.symbols('x')\nprint(sp.factor(x**2 - 1))", 4),
}


def measure(run, code, calls, concurrency):
    """Returns (executions per second, mean latency in ms)."""
    def timed(_):
        start = time.perf_counter()
        run(code)
        return time.perf_counter() - start
    run(code)  # warm-up
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        latencies = list(pool.map(timed, range(calls)))
    return calls / (time.perf_counter() - start), 1000 * sum(latencies) / calls


def run_subprocess(code):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def main(args):
    box = Sandbox(workers=args.workers)
    start = time.perf_counter()
    assert box.run("print(1)").ok

    def run_sandboxed(code):
        assert box.run(code).ok

    print(f"sandbox: {box.workers} zygotes started in {time.perf_counter() - start:.1f}s, layers: {box.layers}")
    print(f"{'snippet':<14} {'threads':>7} | {'sandbox exec/s':>14} {'ms/call':>8} | {'subprocess exec/s':>17} "
          f"{'ms/call':>8} | {'speed-up':>8}")
    for name, (code, baseline_calls) in CASES.items():
        for concurrency in (1, 4):
            rate, ms = measure(run_sandboxed, code, args.calls, concurrency)
            base_rate, base_ms = measure(run_subprocess, code, baseline_calls, concurrency)
            print(f"{name:<14} {concurrency:>7} | {rate:>14.1f} {ms:>8.1f} | {base_rate:>17.1f} {base_ms:>8.1f} | "
                  f"{rate / base_rate:>7.1f}x", flush=True)
    box.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=100, help="sandbox calls per row")
    parser.add_argument("--workers", type=int, default=None, help="zygotes (default: one per core, at least 2)")
    main(parser.parse_args())
