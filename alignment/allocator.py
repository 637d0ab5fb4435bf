"""One process-wide allocator setting for the training scripts (glibc only; no heavy imports, so the TRL side of
bench/rl_step.py can use it too)."""

import ctypes
import sys

# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3


def keep_freed_memory(limit: int = 1 << 30) -> bool:
    """Let glibc's allocator keep the memory a training step frees, for the next step to reuse.

    By default glibc serves blocks above a (dynamic, at most 32 MiB) threshold with a fresh mmap and returns
    them to the OS on free, and trims the heap's free top: every step then touches its activations' pages
    anew, one page fault per 4 KiB (about 500,000 a GRPO step of SmolLM2-135M on CPU), dearer still once a
    vLLM-CPU engine runs in the same process (measured: a train step 9.0 -> 11.3 s after the engine's start).
    With both thresholds at `limit` the blocks stay in the heap and are reused: the same numbers, fewer
    faults. The price: freed blocks that no later request fits stay resident, so with steps of varying
    lengths the heap grows (the default RL run: peak RSS 5.2 -> 6.3 GiB for 10% faster steps; docs/results.md
    "The train phase, lever by lever"). Trimming the heap after a step does not lower that peak, which is reached
    inside a step (measured there too). True where it took effect (glibc), False elsewhere."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, limit)) and bool(libc.mallopt(M_TRIM_THRESHOLD, limit))
    except (OSError, AttributeError):  # not glibc (musl, ...): its allocator as it is
        return False


def apply(wanted: bool):
    """The training scripts' `--keep_freed_memory`: set it, or say why it could not be (speed only, never numbers)."""
    if wanted and not keep_freed_memory():
        print("[alignment] --keep_freed_memory: this is not glibc on Linux; the allocator is left as it is")
