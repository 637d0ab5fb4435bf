import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# A 64 MiB block taken from glibc, written and freed six times (like a training step's activations); the
# page faults of each round. In a fresh process each: the setting is for the whole process and cannot be undone.
PROBE = """
import ctypes, resource, sys
from alignment import allocator
took = sys.argv[1] == "on" and allocator.keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
faults, counts = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt, []
for _ in range(6):
    start = faults(); block = libc.malloc(64 << 20); ctypes.memset(block, 1, 64 << 20)
    counts.append(faults() - start); libc.free(block)
print(took, *counts)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_keep_freed_memory_lets_a_freed_block_be_reused_without_page_faults():
    results = {}
    for mode in ("off", "on"):
        done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        took, *faults = done.stdout.split()
        results[mode] = (took == "True", [int(f) for f in faults])
    assert results["on"][0] is True, results
    assert min(results["off"][1]) > 10_000, results  # glibc's default: 16,384 pages of 4 KiB touched anew each round
    assert max(results["on"][1][1:]) < 100, results  # kept: only the first round touches new pages
