"""End-to-end evaluation: real generations from a tiny model, metrics recomputed from what was written."""

import json

import pytest

from alignment import evaluate as ev
from alignment.args import EvalArgs, parse
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import UserError
from alignment.sampling import Completion, HFSampler, SamplingParams


def test_main_writes_records_and_a_summary_computed_from_them(tiny_model_dir, data_dir, tmp_path):
    args = EvalArgs(model=tiny_model_dir, data_dir=str(data_dir), limit=3, n_samples=2, temperature=1.0,
                    max_tokens=8, output_dir=str(tmp_path / "out"), precision="fp32")
    summary = ev.main(args)
    records = [json.loads(line) for line in open(tmp_path / "out" / "results.jsonl")]
    assert len(records) == 6 and summary["count"] == 3
    saved = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert saved["config"]["model"] == tiny_model_dir
    for record in records:  # every record holds a real generation, graded by the real grader
        assert 1 <= record["n_tokens"] <= 8
        assert {k: record[k] for k in ("format_reward", "answer_reward", "reward")} == \
            r1_zero_reward_fn(record["response"], record["ground_truth"])
    assert summary["avg_all_rewards"] == sum(r["reward"] for r in records) / 6
    assert summary["mean_response_tokens"] == sum(r["n_tokens"] for r in records) / 6
    assert "pass@2" in summary and "maj@2" in summary
    with pytest.raises(UserError, match="already holds evaluation results"):  # never replaced silently
        ev.main(args)
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == saved


class CannedSampler:
    """Returns fixed completion texts, to check the metrics arithmetic."""

    def __init__(self, texts_per_prompt):
        self.texts_per_prompt = texts_per_prompt

    def generate(self, prompt_ids, params):
        return [[Completion(token_ids=[1] * 3, text=t, finish_reason="stop") for t in texts]
                for texts in self.texts_per_prompt[:len(prompt_ids)]]


def test_pass_at_k_and_majority_vote(tokenizer):
    ok, wrong, unformatted = " x </think> <answer> 18 </answer>", " x </think> <answer> 20 </answer>", "no tags"
    sampler = CannedSampler([[ok, wrong, wrong],  # right once, majority wrong
                             [ok, " y </think> <answer> \\boxed{18} </answer>", wrong],  # majority right
                             [unformatted] * 3])  # nothing to vote on
    rows = [{"question": "q", "answer": "18"}] * 3
    summary, records = ev.evaluate(sampler, tokenizer, rows, "r1_zero", SamplingParams(n=3, temperature=1.0))
    assert summary["pass@3"] == pytest.approx(2 / 3) and summary["maj@3"] == pytest.approx(1 / 3)
    assert summary["avg_format_rewards"] == pytest.approx(6 / 9)
    assert summary["avg_all_rewards"] == pytest.approx(3 / 9)
    assert [r["sample"] for r in records[:3]] == [0, 1, 2] and records[4]["problem"] == 1


def test_question_only_prompt_and_chat_template(tiny_model, tokenizer):
    rows = [{"question": "What is 1+1?", "answer": "2"}]
    texts, ids = ev.build_prompts(tokenizer, rows, "question_only", chat_template=True)
    assert texts[0].startswith("<|im_start|>system") and texts[0].endswith("<|im_start|>assistant\n")
    summary, _ = ev.evaluate(HFSampler(tiny_model, tokenizer), tokenizer, rows, "question_only",
                             SamplingParams(temperature=0, max_tokens=4), chat_template=True)
    assert summary["count"] == 1 and summary["mean_response_tokens"] <= 4


def test_bad_flags_fail_with_a_sentence(capsys):
    with pytest.raises(SystemExit):
        parse(EvalArgs, ["--n_samples", "4"])
    assert "--temperature" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(EvalArgs, ["--limit", "-1"])
    with pytest.raises(ValueError, match="does not exist here; available: cpu"):
        ev.main(EvalArgs(device="cuda:3", limit=1))


def test_pass_at_k_reads_answer_reward_and_a_reward_of_ones_own_has_no_majority(tokenizer, tmp_path):
    """pass@k: some sample has answer_reward 1 (correctness), absent when the reward reports none; maj@k with a
    --reward_fn is absent: the toolkit cannot know how the user's reward reads an answer (its extractor and exact
    match once gave maj 0.0 beside a reward of 1.0 on every answer)."""
    from alignment.args import EvalArgs
    (tmp_path / "r.py").write_text(
        "def one(response, ground_truth, **columns):\n    return 1.0\n"
        "def half(response, ground_truth, **columns):\n    return {'reward': 0.5, 'answer_reward': 1.0}\n")
    sampler = CannedSampler([["a", "b"], ["c", "d"]])
    rows = [{"question": "q", "answer": "18"}] * 2
    for name, expected_pass in (("one", None), ("half", 1.0)):
        score = ev.make_scorer(EvalArgs(reward_fn=f"{tmp_path / 'r.py'}:{name}", reward_timeout=5.0))
        try:
            summary, _ = ev.evaluate(sampler, tokenizer, rows, "r1_zero", SamplingParams(n=2, temperature=1.0),
                                     score=score)
        finally:
            score.user_reward.close()
        assert summary["pass@2"] == expected_pass and summary["maj@2"] is None
    from alignment import tir  # the TIR reward: answer_reward is correctness, whatever the penalty does to reward
    right = " \\boxed{18}"
    score = lambda trace_row, row: tir.tir_reward_fn(trace_row.text, row["answer"], exec_penalty=0.5,  # noqa: E731
                                                     exec_failed=True)
    summary, _ = ev.evaluate(CannedSampler([[right, "x"], [right, right]]), tokenizer, rows, "question_only",
                             SamplingParams(n=2, temperature=1.0), score=score)
    assert summary["pass@2"] == 1.0 and summary["maj@2"] == 1.0
