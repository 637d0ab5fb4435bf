"""Measure a model on GSM8K or a MATH-style set: format reward, answer reward, overall accuracy.

    uv run -m alignment.evaluate                                   # smollm2-135m, GSM8K subset, CPU-sized
    uv run -m alignment.evaluate --model checkpoints/math_sft --limit 200
    uv run -m alignment.evaluate --model Qwen/Qwen2.5-Math-1.5B --limit 0 --max_tokens 1024   # reference, GPU + vLLM

With `--n_samples k` (and a temperature above 0) it also reports pass@k and maj@k. pass@k: some sample is right,
i.e. has answer_reward 1 (the built-in graders' and TIR's answer_reward is 1/0 correctness, whatever the reward's
scale or penalty); absent (null) with a --reward_fn that returns no answer_reward. maj@k: only the answers the prompt's
grader reads vote (r1_zero: the `</think> <answer> ... </answer>` format; tir: a \\boxed{}; question_only: a box, else
the last number), compared after normalisation; a problem is right when one answer has more votes than any other and
was graded right. No vote, or a tie for the most votes, counts wrong, whatever the order of the samples
(`maj_rule` 2026-12-07 in the summary; earlier figures let unformatted answers vote by their last number and gave
a tie to the answer seen first). Absent with a --reward_fn, whose way of reading an answer (a tolerance, a format of
its own) the toolkit cannot know. Writes one JSON line per completion and a summary; a --reward_fn that failed on
every answer ends in one line instead (no summary that reads like a score of 0). An empty evaluation set, or one
question asked twice with different answers, is refused in one line before the model loads.
`evaluate(...)` is the reusable core that SFT and RL call for periodic evaluation.
"""

import dataclasses
import json
import math
import re
import time
from pathlib import Path

from alignment.args import EvalArgs, parse, to_dict

if __name__ == "__main__":  # the flags before torch loads: --help and a bad flag answer in 0.1 s, not 9
    ARGS = parse(EvalArgs)

import torch

from alignment import data, delethink, models, rollout, tir
from alignment.errors import UserError, cli
from alignment.drgrpo_grader import (extract_boxed, extract_last_number, grade, normalize, question_only_reward_fn,
                                     r1_zero_reward_fn)
from alignment.rollout import traces
from alignment.folders import LOCK_FILE
from alignment.run import lock_folder, run_config
from alignment.samplers import make_sampler, pick_backend
from alignment.user_reward import zero_failed_parts
from alignment.sampling import SamplingParams

# rollout mode -> its generate function; picked once, by name
ROLLOUT_MODES = {"standard": rollout.generate, "delethink": delethink.generate, "tir": tir.generate}

# prompt template -> (reward function, stop strings). r1_zero stops at `</answer>` as in the reference.
PROMPT_SETTINGS = {
    "r1_zero": (r1_zero_reward_fn, ("</answer>",)),
    "question_only": (question_only_reward_fn, ()),
    "tir": (tir.tir_reward_fn, ()),
}
CPU_DEFAULT_LIMIT = 100  # about 3-5 minutes for smollm2-135m on 2 cores
MAJ_RULE = "2026-12-07"  # maj@k's rule (graded answers vote, a tie is wrong), written beside it: older figures differ


def make_scorer(args, rows=()):
    """score(last row of a trace, question row) -> reward dict, for training and evaluation alike: --reward_fn's
    (alignment/user_reward.py, with the row's columns) when given, else the grader the prompt calls for; the TIR
    reward also reads the trace's execution record (ToRL's optional penalty for code that failed). `rows`, the
    questions it will score: a column the --reward_fn cannot receive is refused before its worker starts."""
    if args.reward_fn:
        from alignment.user_reward import UserReward, check_columns
        check_columns(args.reward_fn, rows)
        reward = UserReward(args.reward_fn, args.reward_timeout)
        columns = lambda row: row.get("columns", {"question": row["question"]})  # noqa: E731
        score = lambda trace_row, row: reward(trace_row.text, row["answer"], columns(row))  # noqa: E731
        score.many = lambda trace_rows, rows: reward.many([t.text for t in trace_rows], [r["answer"] for r in rows],
                                                          [columns(r) for r in rows])  # a batched reward: one call
        score.user_reward = reward  # its failures, and its file's hash for the run's config
        return score
    reward_fn, _ = PROMPT_SETTINGS[args.prompt]
    if args.prompt == "tir":
        return lambda trace_row, row: tir.tir_reward_fn(trace_row.text, row["answer"], args.tir_reward_scheme,
                                                        args.exec_penalty, bool(trace_row.stats.get("exec_failed")))
    return lambda trace_row, row: reward_fn(trace_row.text, row["answer"])


def score_all(score, trace_rows: list, rows: list[dict]) -> list[dict]:
    """`score` over many answers (each trace's last row, with its question row): a --reward_fn's in one call of its
    worker (`score.many`: a batched reward scores them all at once), any other answer by answer."""
    many = getattr(score, "many", None)
    return many(trace_rows, rows) if many else [score(t, row) for t, row in zip(trace_rows, rows)]


def build_prompts(tokenizer, rows, prompt_name: str, chat_template: bool = False,
                  prompt_file: str | None = None) -> tuple[list[str], list[list[int]]]:
    template = data.prompt_template(prompt_name, prompt_file)
    texts = [data.format_prompt(template, row["question"], row.get("columns")) for row in rows]
    if chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                               add_generation_prompt=True) for t in texts]
    ids = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    return texts, ids


def check_context(max_model_len: int | None, tokenizer, rows, prompt_name: str, chat_template: bool,
                  max_tokens: int, model: str | None = None, length: str = "the answer length",
                  prompt_file: str | None = None):
    """The longest prompt plus `max_tokens` must fit a vLLM engine's --vllm_max_model_len (checked before the
    engine's minute-long start: vLLM's own error comes only after it), or else the model's own context
    (`model`'s max_position_embeddings: past it vLLM cuts answers short and HF generates on for minutes).
    `length` names what to lower (delethink checks one chunk: --delethink_chunk_size)."""
    limit = max_model_len or (_model_context(model) if model else None)
    if not limit or not rows:
        return
    lengths = [len(ids) for ids in build_prompts(tokenizer, rows, prompt_name, chat_template, prompt_file)[1]]
    longest = max(lengths)
    drop = (f"shorten or drop the question starting {rows[lengths.index(longest)]['question'][:40]!r}"
            + ("" if longest < limit else f" (its prompt alone fills the {limit} tokens)"))  # the row, not the answer
    if longest + max_tokens > limit:
        raise UserError((f"--vllm_max_model_len {max_model_len} cannot hold the longest prompt ({longest} tokens) and "
                         f"an answer of up to {max_tokens}: raise it to at least {longest + max_tokens}, or {drop}.")
                        if max_model_len else
                        (f"the model's context ({limit} tokens, its max_position_embeddings) cannot hold the longest "
                         f"prompt ({longest} tokens) and an answer of up to {max_tokens} tokens: "
                         + (f"lower {length} to at most {limit - longest}, or {drop}." if longest < limit else f"{drop}.")))


def context_need(args, max_tokens: int) -> tuple[int, str]:
    """(the most tokens one generation call adds to a prompt, the flag that sets it) in args' rollout mode: a
    delethink call is one chunk (prompt + carryover + new tokens <= prompt + C)."""
    if args.rollout_mode == "delethink":
        return args.delethink_chunk_size, "--delethink_chunk_size"
    return max_tokens, "the answer length"


def _model_context(model: str) -> int | None:
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(models.resolve_model(model))
    return getattr(getattr(config, "text_config", None) or config, "max_position_embeddings", None)


def _refuse_used(out: Path):
    """Results are never replaced silently, and a training run's folder is not an evaluation's."""
    if (out / "summary.json").exists() or (out / "results.jsonl").exists():
        raise UserError(f"{out} already holds evaluation results: choose another --output_dir (or leave it out for a "
                        f"new dated folder), or delete that one.")
    if run_config(out) or (out / "checkpoint").exists():
        raise UserError(f"{out} is a training run's folder: evaluate writes its own; choose another --output_dir "
                        f"(--model {out} evaluates that run's weights).")
    others = sorted(p.name for p in out.iterdir() if p.name != LOCK_FILE) if out.is_dir() else []
    if others:
        raise UserError(f"{out} holds files evaluate did not write ({', '.join(others[:5])}"
                        f"{', ...' if len(others) > 5 else ''}): choose another --output_dir (or leave it out for a new "
                        f"dated folder).")


def extract_answer(response: str, prompt_name: str) -> str | None:
    """The answer the prompt's grader reads from a completion, for majority voting; None when it reads none, or an
    empty one (then the sample does not vote). Each branch is its grader's extraction: r1_zero_reward_fn,
    question_only_reward_fn, tir.tir_reward_fn (tests/test_evaluate.py checks them against each other)."""
    if prompt_name == "r1_zero":  # the format the reward requires, else no answer at all (not a last-number guess)
        if "</think> <answer>" not in response or "</answer>" not in response.split("</think> <answer>", 1)[1]:
            return None
        answer = response.split("</think> <answer>", 1)[1].split("</answer>", 1)[0]
        if "\\boxed" in answer or "\\fbox" in answer:
            answer = extract_boxed(answer)
    elif prompt_name == "question_only":
        answer = extract_boxed(response)
        answer = extract_last_number(response) if answer is None else answer
    else:  # tir: the last box; an unboxed or cut-off trace has no answer
        answer = extract_boxed(response)
    return answer if answer is not None and normalize(answer) else None


def evaluate(sampler, tokenizer, rows, prompt_name: str = "r1_zero", params: SamplingParams | None = None,
             chat_template: bool = False, rollout_mode: str = "standard", mode_args=None,
             progress: bool = False, score=None, prompt_file: str | None = None) -> tuple[dict, list[dict]]:
    """Generate for every row with the given rollout mode, grade each trace, and return (summary, records).
    `score(trace's last row, question row)` grades (default: the prompt's reward on the answer; training passes
    its own, a --reward_fn's too). `progress` shows the sampler's progress bar meanwhile (a sampler made with
    progress=True always does). A reward part no sample reports (a --reward_fn's) is None: absent, not 0."""
    reward_fn, stop = PROMPT_SETTINGS[prompt_name]
    score = score or (lambda trace_row, row: reward_fn(trace_row.text, row["answer"]))
    params = params or SamplingParams(temperature=0.0, max_tokens=256)
    params = dataclasses.replace(params, stop=tuple(params.stop) or stop)
    texts, prompt_ids = build_prompts(tokenizer, rows, prompt_name, chat_template, prompt_file)
    start, shown = time.perf_counter(), getattr(sampler, "progress", False)
    sampler.progress = shown or progress
    try:
        all_traces = traces(ROLLOUT_MODES[rollout_mode](sampler, tokenizer, prompt_ids, params, mode_args))
    finally:
        sampler.progress = shown
    seconds = time.perf_counter() - start
    records = []
    # a --reward_fn call that failed scored its sample 0, format and answer too (where other calls return them)
    scores = zero_failed_parts(score_all(score, [t[-1] for t in all_traces], [rows[t[-1].group_id] for t in all_traces]))
    for trace, scored in zip(all_traces, scores):
        last = trace[-1]
        rewards = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in scored.items()}  # absent: null
        records.append({"prompt": texts[last.group_id], "response": last.text,
                        "ground_truth": rows[last.group_id]["answer"], "problem": last.group_id,
                        "sample": last.trace_id - last.group_id * params.n,
                        "n_tokens": sum(sum(r.loss_mask) for r in trace), "n_rows": len(trace),
                        "finish_reason": last.finish_reason, "stats": last.stats, **rewards})
    n_tokens = sum(r["n_tokens"] for r in records)
    summary = {
        "count": len(rows),
        "n_samples": params.n,
        "avg_format_rewards": _mean(r["format_reward"] for r in records),
        "avg_answer_rewards": _mean(r["answer_reward"] for r in records),
        "avg_all_rewards": _mean(r["reward"] for r in records),
        **({"reward_failures": int(sum(r["reward_failed"] for r in records))} if records and "reward_failed" in records[0] else {}),
        "mean_response_tokens": n_tokens / max(len(records), 1),
        "tokens_per_s": n_tokens / max(seconds, 1e-9),
        "generation_s": seconds,
    }
    trace_stats = {k for r in records for k, v in r["stats"].items() if isinstance(v, (int, float))} - {"chunk"}
    for key in sorted(trace_stats):  # per-trace numbers; "chunk" is the index of a Delethink row, not a trace stat
        summary[f"mean_{key}"] = _mean(r["stats"].get(key, 0) for r in records)
    if params.n > 1:
        by_problem = [records[i:i + params.n] for i in range(0, len(records), params.n)]
        summary[f"pass@{params.n}"] = _pass_at_k(by_problem)
        summary[f"maj@{params.n}"] = (None if getattr(score, "user_reward", None) is not None else
                                      maj_at_k(records, prompt_name))
        if summary[f"maj@{params.n}"] is not None:
            summary["maj_rule"] = MAJ_RULE
    return summary, records


def summary_line(summary: dict) -> str:
    """`format 0.910 | answer 0.040 | reward 0.040`, a part no answer reported (a --reward_fn's) as absent, and the
    --reward_fn calls that failed (`| reward failures 3/100`) where any did."""
    shown = {k: "absent" if summary[k] is None else f"{summary[k]:.3f}" for k in
             ("avg_format_rewards", "avg_answer_rewards", "avg_all_rewards")}
    failures = summary.get("reward_failures")  # (scored 0: the means above count them as zeros)
    return (f"format {shown['avg_format_rewards']} | answer {shown['avg_answer_rewards']} | reward "
            f"{shown['avg_all_rewards']}" + (f" | reward failures {failures}/{summary['count'] * summary['n_samples']}"
                                             if failures else ""))


def _pass_at_k(by_problem) -> float | None:
    """pass@k: the share of problems with a right sample, right being answer_reward 1 (correctness, not the reward,
    which TIR's scheme and penalty move off 1); None when no sample reports an answer_reward (a --reward_fn's)."""
    if all(r["answer_reward"] is None for group in by_problem for r in group):
        return None
    return _mean(any(r["answer_reward"] == 1 for r in group) for group in by_problem)


def maj_at_k(records: list[dict], prompt_name: str) -> float:
    """maj@k of evaluate's records (a sample each, naming its problem): the share of problems whose vote is right
    (bench/gsm8k_card.py recomputes older evaluations' figures with it)."""
    by_problem = {}
    for record in records:
        by_problem.setdefault(record["problem"], []).append(record)
    return _mean(_majority_is_correct(group, prompt_name) for group in by_problem.values())


def _majority_is_correct(records, prompt_name) -> bool:
    """maj@k of one problem. A sample votes with the answer its grader reads (`extract_answer`); two answers are one
    when they normalise alike or the grader counts them equal (`grade`: 18 and 18.0, 1/2 and 0.5). Right when one answer has more votes than every other and each sample carrying it was graded right
    (the grader normalises before it compares, so they agree, unless a symbolic check ran out of time: then wrong).
    No vote counts wrong, and so does a tie for the most votes: the vote picked no answer. Breaking it by position
    made the figure depend on the order of the samples (reversing a 2-2 tie flipped it), and by the answers' text
    would favour some answers for no reason; counting it wrong keeps a problem 0 or 1 and maj@k a lower bound of
    any tie-break."""
    votes = []  # (an answer, the answer_reward of each sample whose answer the grader counts equal to it)
    for record in records:
        answer = extract_answer(record["response"], prompt_name)
        if answer is None:
            continue
        same = next((vote for vote in votes if normalize(vote[0]) == normalize(answer) or grade(answer, vote[0])),
                    None)  # 18 and 18.0, 1/2 and 0.5 vote together, as the grader counts them equal
        if same is None:
            votes.append((answer, [record["answer_reward"]]))
        else:
            same[1].append(record["answer_reward"])
    ranked = sorted((rewards for _, rewards in votes), key=len, reverse=True)
    if not ranked or (len(ranked) > 1 and len(ranked[1]) == len(ranked[0])):
        return False  # no vote, or a tie for the most votes
    return all(reward == 1 for reward in ranked[0])


def _mean(values) -> float | None:
    """The mean; None values (a part a --reward_fn did not return) are left out, and all of them is None: absent."""
    values = list(values)
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else (None if values else 0.0)


def main(args: EvalArgs) -> dict:
    device = models.resolve_device(args.device)
    out = Path(args.output_dir or f"outputs/eval/{Path(args.model).name}-"
               f"{re.sub(r'[^A-Za-z0-9._=-]+', '_', args.dataset)}-{time.strftime('%Y%m%d-%H%M%S')}")
    _refuse_used(out)
    models.resolve_model(args.model)  # an unusable --model fails before anything is written
    if args.prompt_file:  # read once: every prompt of this evaluation from the same text (not UTF-8: one line)
        data.read_prompt_file(args.prompt_file)
    rows = data.load_dataset(args.dataset, args.split, args.data_dir, question_key=args.question_key,
                             answer_key=args.answer_key)
    limit = args.limit if args.limit is not None else (0 if device.startswith("cuda") else CPU_DEFAULT_LIMIT)
    subset = rows[:limit] if limit else rows
    _refuse_unscorable(args, subset)
    backend = pick_backend(args.backend, device)
    why = " (the CPU default; --limit 0 evaluates all)" if args.limit is None and limit else ""
    decoding = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top_p {args.top_p}"
    print(f"[evaluate] {args.model} on {args.dataset} {args.split}: {len(subset)} of {len(rows)} problems{why}, "
          f"{args.prompt} prompt, {decoding}, n={args.n_samples}, "
          f"{args.delethink_budget() if args.rollout_mode == 'delethink' else f'max {args.max_tokens} tokens'}, "
          f"{backend} on {device}, "
          f"precision {models.resolve_precision(args.precision, device)} ({args.precision})")
    made = not out.exists()
    lock_folder(out)  # held until the process ends: a second evaluate into this folder is refused meanwhile
    try:
        _refuse_used(out)  # and after it, by the results it left
        return _evaluate_into(out, args, device, subset, backend)
    except BaseException:
        if made and out.is_dir() and [p.name for p in out.iterdir()] == [LOCK_FILE]:  # a failed evaluate leaves no empty folder
            (out / LOCK_FILE).unlink()
            out.rmdir()
        raise


def _refuse_unscorable(args: EvalArgs, rows: list[dict]):
    """No problems is not a score of 0 (it printed "0 of 0 problems" and averages of 0.0), and a prompt asked twice
    with different answers cannot be right both times: one line each, before the model loads. A copy with the same
    answer (as the grader compares them) is scored twice, as asked."""
    where = f"--dataset {args.dataset} --split {args.split}"
    if not rows:
        file_test = data.is_file(args.dataset) and args.split == "test"
        raise UserError(f"{where} holds no problems" + (
            " (a file's test split is the tenth of its questions a hash holds out, and none of its rows fell there): "
            "evaluate it with --split all, or add questions." if file_test else ": choose another --split or --dataset."))
    template, first = data.prompt_template(args.prompt, args.prompt_file), {}  # prompt -> the first problem asking it
    for i, row in enumerate(rows):
        j = first.setdefault(data.same_question(data.format_prompt(template, row["question"], row.get("columns"))), i)
        if j != i and not grade(str(row["answer"]), str(rows[j]["answer"])):
            which = (f"rows {j + 1} and {i + 1}" if data.is_file(args.dataset) and args.split == "all" else
                     f"problems {j} and {i} (0-based, as results.jsonl numbers them)")
            raise UserError(f"{where}: {which} ask the same question ({row['question'][:40]!r}) with different answers "
                            f"({rows[j]['answer']!r} and {row['answer']!r}), and no answer is right for both: fix the "
                            f"wrong one, or drop a copy.")


def _refuse_a_broken_reward(args: EvalArgs, score, records: list[dict]):
    """A --reward_fn that failed on every answer is a bug, not a score of 0: one line, and nothing written (as
    train_rl stops on a first step that failed everywhere). Some failures are counted in the summary instead."""
    reward = getattr(score, "user_reward", None)
    if reward is not None and records and all(r["reward_failed"] for r in records):
        reward.close()
        raise UserError(f"--reward_fn {args.reward_fn} failed on every answer ({len(records)} of {len(records)}), "
                        f"first: {reward.errors[0] if reward.errors else '?'}; fix it, then evaluate again.")


def _evaluate_into(out: Path, args: EvalArgs, device: str, subset: list[dict], backend: str) -> dict:
    """main's work once `out` is locked: load the model, sample, grade, write results.jsonl and summary.json."""
    torch.manual_seed(args.seed)
    tokenizer = models.load_tokenizer(args.model)
    if args.rollout_mode != "tir":  # (tir's context is bounded per call); delethink's by a chunk: prompt + C
        need, length = context_need(args, args.max_tokens)
        check_context(args.vllm_max_model_len if backend == "vllm" else None, tokenizer, subset, args.prompt,
                      args.chat_template, need, args.model, length, args.prompt_file)
    score = make_scorer(args, subset)  # a --reward_fn's worker starts (or is refused) before the weights load
    model = models.load_model(args.model, device, models.default_dtype(device, args.precision)) if backend == "hf" else None
    sampler = make_sampler(backend, model, tokenizer, models.resolve_model(args.model), device,
                           batch_size=args.batch_size, seed=args.seed, progress=True, decoding=args.hf_decoding,
                           **args.vllm_options())
    params = SamplingParams(n=args.n_samples, temperature=args.temperature, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    summary, records = evaluate(sampler, tokenizer, subset, args.prompt, params, args.chat_template,
                                args.rollout_mode, mode_args=args, score=score, prompt_file=args.prompt_file)
    _refuse_a_broken_reward(args, score, records)
    with open(out / "results.jsonl", "w") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    user_reward = getattr(score, "user_reward", None)
    if user_reward is not None:  # which file scored, and what failed
        summary["reward_fn_sha256"] = user_reward.sha256
        if user_reward.errors:
            print(f"[evaluate] --reward_fn failed on {len(user_reward.errors)} of {len(records)} answers (each scored "
                  f"0), first: {user_reward.errors[0]}")
        user_reward.close()
    (out / "summary.json").write_text(json.dumps({**summary, "config": to_dict(args)}, indent=2))
    for key, value in summary.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {'absent' if value is None else value}")
    print(f"[evaluate] wrote {out}/results.jsonl and summary.json")
    if summary["avg_format_rewards"] == 0 and args.prompt == "r1_zero":
        print("[evaluate] no answer used the r1_zero format (</think> <answer> ... </answer>), so none could be "
              "graded: a model not trained on it (such as the packaged SmolLM2) needs SFT first: "
              "`uv run -m alignment.sft`, then `uv run -m alignment.evaluate --model checkpoints/math_sft`.")
    return summary


if __name__ == "__main__":
    cli(main, ARGS)
