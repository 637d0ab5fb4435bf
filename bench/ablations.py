"""The CS336 ablations on this CPU proxy: each RL variant at one fixed budget, several seeds, one table and
one plot.

    uv run python bench/ablations.py --quick          # 4 steps per run, 40 runs two at a time: 64 min on 2 cores
    uv run python bench/ablations.py                  # 10 steps per run
    uv run python bench/ablations.py --only grpo_clip,no_baseline --seeds 0
    uv run python bench/ablations.py --only grpo_clip,adaptive_groups_16 --x generated_tokens   # against tokens sampled

Every run is `python -m alignment.train_rl` from checkpoints/math_sft on --dataset (default: the RL
default task) with the defaults, changed only by its variant's flags; the answer rate on the task's test
split (whose questions are left out of training) is greedy, measured every few steps. The start model's
score is the same greedy evaluation for every run with the same prompt and seed (a reasoning-gym task's
test split is the same for every seed; each seed's first run measures it anyway), and the others start with
--no_eval_before_train and share it. `--jobs 2` (the default) runs two at a
time with one thread each: the s/step column is then a loaded core's, comparable between rows only. A run
that is already complete is not repeated, one that was interrupted continues with --resume, so an
interrupted sweep resumes where it stopped. Writes <out>/ablations.md (final accuracy mean and range over
seeds, seconds per step) and <out>/ablations.png.
"""

import argparse
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from steps_demo import check_own, one_line, write_own

from alignment import models
from alignment.args import DEFAULT_RL_TASK

ROOT = Path(__file__).resolve().parent.parent

# name -> flags; the first is the reference the others change one thing of
VARIANTS = {  # CS336 assignment 5's GRPO experiments, then the estimators, then how groups are filled
    "grpo_clip": [],
    "lr_1e-5": ["--learning_rate", "1e-5"],
    "lr_1e-4": ["--learning_rate", "1e-4"],
    "no_baseline": ["--loss_type", "no_baseline"],
    "reinforce_with_baseline": ["--loss_type", "reinforce_with_baseline"],
    "std_normalization": ["--use_std_normalization"],
    "token-mean": ["--loss_agg_mode", "token-mean"],
    "seq-mean-token-sum-norm": ["--loss_agg_mode", "seq-mean-token-sum-norm"],
    # off-policy: more epochs over each rollout batch, or several optimizer steps per batch (the budget's
    # rollout batch is 16 or 32 responses, so a train batch of 8 is 2 or 4 steps per batch)
    "off-policy_2_epochs": ["--epochs_per_rollout_batch", "2", "--train_batch_size", "16"],
    "off-policy_4_epochs": ["--epochs_per_rollout_batch", "4", "--train_batch_size", "16"],
    "off-policy_train_batch_8": ["--train_batch_size", "8"],
    "no-clip_2_epochs": ["--loss_type", "grpo_no_clip", "--epochs_per_rollout_batch", "2", "--train_batch_size", "16"],
    "question_only": ["--prompt", "question_only"],
    "rloo": ["--advantage_estimator", "rloo"],
    "reinforce_pp": ["--advantage_estimator", "reinforce_pp"],
    "reinforce_pp_baseline": ["--advantage_estimator", "reinforce_pp_baseline"],
    "gae": ["--advantage_estimator", "gae", "--critic_learning_rate", "1e-4"],
    "gspo": ["--loss_type", "gspo"],
    "dynamic_sampling": ["--filter_low", "0"],
    "adaptive_groups_16": ["--group_size_max", "16"],
}
BUDGETS = {  # (flags, description)
    "full": (["--n_steps", "10", "--eval_every", "5", "--eval_limit", "50"], "10 steps, eval on 50 every 5"),
    "quick": (["--n_steps", "4", "--eval_every", "4", "--eval_limit", "30", "--rollout_batch_size", "16",
               "--train_batch_size", "16"], "4 steps of 16 responses, eval on 30 at the start (shared) and end"),
}


def prompt_of(flags: list[str]) -> str:
    """What decides the start model's evaluation among the variants: the prompt (the rest is shared)."""
    return flags[flags.index("--prompt") + 1] if "--prompt" in flags else "r1_zero"


def run(name: str, flags: list[str], budget: list[str], seed: int, out: Path, dataset: str | None,
        evaluate_start: bool = True, threads: int | None = None) -> Path:
    run_dir = out / f"{name}-seed{seed}"
    metrics = run_dir / "metrics.jsonl"
    n_steps = int(budget[budget.index("--n_steps") + 1])
    done = metrics.exists() and any(json.loads(line).get("step") == n_steps and "eval_count" in line
                                    for line in open(metrics))
    if done:
        print(f"[ablations] {run_dir.name}: complete, kept", flush=True)
        return run_dir
    # the variant's flags come last, so they win over the budget's (the off-policy train batch)
    command = [sys.executable, "-m", "alignment.train_rl", *budget, *flags, "--seed", str(seed),
               "--output_dir", str(run_dir), "--save_every", "1", *(["--dataset", dataset] if dataset else []),
               *([] if evaluate_start else ["--no_eval_before_train"])]
    if (run_dir / "checkpoint" / "trainer_state.pt").exists():
        command += ["--resume", str(run_dir)]
        print(f"[ablations] {run_dir.name}: resuming", flush=True)
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
        print(f"[ablations] {run_dir.name}: {' '.join(command[3:])}", flush=True)
    with open(out / f"{run_dir.name}.log", "a") as log:
        env = {**os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
        subprocess.run(command, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)  # the numbers are kept, the weights are not
    return run_dir


def eval_curve(run_dir: Path) -> list[tuple[int, float, int]]:
    """(step, held-out answer rate, tokens sampled so far) at each evaluation."""
    records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    return [(r["step"], r["eval_avg_answer_rewards"], r.get("generated_tokens", 0))
            for r in records if "eval_avg_answer_rewards" in r]


def summarise(name: str, run_dirs: list[Path], starts: list[float]) -> dict:
    """`starts`: the start model's score for each run's seed, from whichever run with this variant's prompt
    and that seed measured it."""
    curves, seconds, rewards, tokens = [], [], [], []
    for run_dir, start in zip(run_dirs, starts, strict=True):
        records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
        curve = eval_curve(run_dir)
        curves.append(curve if curve[0][0] == 0 else [(0, start, 0), *curve])
        steps = [r for r in records if "seconds_sample" in r]
        seconds.append(statistics.mean(r["seconds_step"] for r in steps))
        rewards.append(steps[-1]["reward"])
        tokens.append(sum(r.get("sampled_tokens", 0) for r in steps))
    finals = [c[-1][1] for c in curves]
    return {"name": name, "first": statistics.mean(c[0][1] for c in curves), "final": statistics.mean(finals),
            "low": min(finals), "high": max(finals), "seconds": statistics.mean(seconds),
            "reward": statistics.mean(rewards), "tokens": statistics.mean(tokens), "curves": curves}


def write_outputs(rows: list[dict], out: Path, budget_text: str, seeds: list[int], dataset: str, x: str = "step"):
    lines = [f"Budget: {budget_text}; seeds {', '.join(map(str, seeds))}; task {dataset}; greedy answer rate on "
             f"the task's test split (its questions are left out of training).", "",
             "| variant | start (mean) | final (mean) | final (range) | final train reward | sampled tokens | s/step |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['first']:.3f} | {r['final']:.3f} | {r['low']:.2f}-{r['high']:.2f} | "
                     f"{r['reward']:.3f} | {r['tokens']:.0f} | {r['seconds']:.1f} |")
    write_own(out / "ablations.md", "\n".join(lines) + "\n")  # never over a file of the user's
    print("\n".join(lines))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 5.5))
    if all(len(c) <= 2 for r in rows for c in r["curves"]):  # start and end only: bars, not a fan of lines
        y = range(len(rows))[::-1]  # the reference on top
        ax.barh(y, [r["final"] for r in rows], color=["tab:blue"] + ["tab:gray"] * (len(rows) - 1),
                xerr=[[r["final"] - r["low"] for r in rows], [r["high"] - r["final"] for r in rows]], capsize=3)
        ax.scatter([r["first"] for r in rows], y, marker="|", s=200, color="black", zorder=3, label="start")
        ax.set_yticks(list(y), [r["name"] for r in rows], fontsize=8)
        ax.set_xlabel("test-split answer rate at the end (greedy; bar: mean over seeds, whiskers: range)")
        ax.legend(fontsize=8)
    else:
        for index, r in enumerate(rows):
            points = range(len(r["curves"][0]))  # every seed evaluates at the same steps
            where = [statistics.mean(c[i][0 if x == "step" else 2] for c in r["curves"]) for i in points]
            mean = [statistics.mean(c[i][1] for c in r["curves"]) for i in points]
            ax.plot(where, mean, marker="o", markersize=3, label=r["name"], linestyle="-" if index < 10 else "--",
                    linewidth=2.5 if r is rows[0] else 1.2)  # ten colours, then they repeat dashed
        ax.set_xlabel("RL step" if x == "step" else "tokens sampled so far (mean over seeds)")
        ax.set_ylabel("test-split answer rate (greedy, mean over seeds)")
        ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"ablations: {budget_text}")
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    write_own(out / "ablations.png", png.getvalue())
    print(f"[ablations] wrote {out / 'ablations.md'} and {out / 'ablations.png'}")


def main():
    parser = one_line(argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--quick", action="store_true", help="the smaller budget (4 steps of 16 responses)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--only", default=None, help="comma-separated variant names (default: all)")
    parser.add_argument("--dataset", default=None, help="training task, as train_rl --dataset takes (default: its default)")
    parser.add_argument("--out", default=None, help="folder (default outputs/ablations[-quick])")
    parser.add_argument("--x", choices=["step", "generated_tokens"], default="step",
                        help="the plot's horizontal axis: RL step, or tokens sampled (sample efficiency)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time, each with cores/jobs threads (1: one "
                        "at a time with every core, for s/step on an idle machine)")
    args = parser.parse_args()
    names = args.only.split(",") if args.only else list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    if not models.is_model_folder(ROOT / "checkpoints" / "math_sft"):
        parser.error("checkpoints/math_sft does not exist: run `uv run -m alignment.sft` first")
    budget, budget_text = BUDGETS["quick" if args.quick else "full"]
    if len(set(args.seeds)) < len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))} names a seed twice")
    out = Path(args.out or ROOT / "outputs" / ("ablations-quick" if args.quick else "ablations"))
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file: give a folder")
    out.mkdir(parents=True, exist_ok=True)
    for name in ("ablations.md", "ablations.png"):  # a user's report refused before the first run, not after
        check_own(out / name)
    os.environ.setdefault("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    if args.jobs < 1:
        parser.error("--jobs must be 1 or more")
    threads = max(1, (os.cpu_count() or 1) // args.jobs) if args.jobs > 1 else None
    # one run per prompt and seed measures the start model; the others share it
    measures = {(prompt_of(VARIANTS[name]), seed): (name, seed) for name in reversed(names) for seed in args.seeds}
    jobs = [(name, seed) for name in names for seed in args.seeds]
    stop = threading.Event()  # set by Ctrl-C or a failed run: no further run starts

    def guarded(job):
        if stop.is_set():
            return None
        try:
            return run(job[0], VARIANTS[job[0]], budget, job[1], out, args.dataset,
                       evaluate_start=job in measures.values(), threads=threads)
        except BaseException:
            stop.set()
            raise
    try:
        with ThreadPoolExecutor(args.jobs) as pool:
            futures = {job: pool.submit(guarded, job) for job in jobs}
            try:
                dirs = {job: future.result() for job, future in futures.items()}
            except BaseException:  # before the pool waits for the runs under way
                stop.set()
                raise
    except KeyboardInterrupt:  # the runs got the signal too: they stop after their step, with a checkpoint
        stop.set()
        sys.exit("[ablations] interrupted: the runs under way keep their last checkpoint; run the same command "
                 "again to continue the sweep")
    except subprocess.CalledProcessError as e:
        sys.exit(f"[ablations] a run ended with exit status {e.returncode} ({' '.join(e.cmd[2:4])} ... "
                 f"{e.cmd[e.cmd.index('--output_dir') + 1]}): see its .log in {out}; no further run was started")
    starts = {}
    for key, job in measures.items():
        step, score, _ = eval_curve(dirs[job])[0]
        if step != 0:
            sys.exit(f"[ablations] {dirs[job]} has no evaluation of the start model (a run kept from before starts "
                     f"were measured per seed): delete that folder and run again")
        starts[key] = score
    rows = [summarise(name, [dirs[name, seed] for seed in args.seeds],
                      [starts[prompt_of(VARIANTS[name]), seed] for seed in args.seeds]) for name in names]
    write_outputs(rows, out, budget_text, args.seeds, args.dataset or DEFAULT_RL_TASK, args.x)


if __name__ == "__main__":
    main()
