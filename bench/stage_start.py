"""What a driver's stage costs before its first step: a fresh `python -m alignment.<script>` against a fork of the
driver that imported the script once (bench/steps_demo.py's ForkedStage, the default since 2026-12-07).

    uv run python bench/stage_start.py --repeats 3

Each trial starts `-m alignment.evaluate --help` (the whole import, then the help and exit 0) both ways, alternating,
and prints the median seconds of each and their ratio, with the CPU's flags (compare only numbers of one run).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import steps_demo  # noqa: E402


def started(command: list[str], fork: bool) -> float:
    steps_demo.FORK_STAGES = fork
    with tempfile.TemporaryFile("w+") as log:
        start = time.perf_counter()
        status = steps_demo.start_stage(command, log).wait()
        seconds = time.perf_counter() - start
        log.seek(0)
        assert status == 0 and "usage:" in log.read(), f"the stage failed (exit status {status})"
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="trials of each way (default 3)")
    parser.add_argument("--module", default="alignment.evaluate", help="the script a stage runs")
    args = parser.parse_args()
    flags = sorted({flag for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")
                    for flag in line.split()} & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    command = ["-m", args.module, "--help"]
    start = time.perf_counter()
    started(command, True)  # the first fork imports the script into the driver (torch: in already)
    first_import = time.perf_counter() - start
    times = {"spawn": [], "fork": []}
    for _ in range(args.repeats):
        times["spawn"].append(started(command, False))
        times["fork"].append(started(command, True))
    spawn, fork = (statistics.median(times[k]) for k in ("spawn", "fork"))
    print(f"CPU flags: {' '.join(flags)}; {args.module}, {args.repeats} trials each")
    print(f"fresh interpreter: {spawn:.2f} s a stage (median; {', '.join(f'{t:.2f}' for t in times['spawn'])})")
    print(f"fork of the driver: {fork:.3f} s a stage (median); the first, which imports the script into the driver "
          f"(steps_demo's own imports hold torch already), {first_import:.2f} s")
    print(f"saved per stage: {spawn - fork:.2f} s ({spawn / fork:.0f}x)")


if __name__ == "__main__":
    main()
