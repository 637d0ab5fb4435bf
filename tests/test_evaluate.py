"""End-to-end evaluation: real generations from a tiny model, metrics recomputed from what was written."""

import json

import pytest

from alignment import evaluate as ev
from alignment.args import EvalArgs, parse
from alignment.drgrpo_grader import question_only_reward_fn, r1_zero_reward_fn
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


def graded(texts, prompt="r1_zero", gold="18"):
    """Samples as evaluate records them, each graded by its prompt's own reward."""
    from alignment import tir
    reward_fn = {"r1_zero": r1_zero_reward_fn, "tir": tir.tir_reward_fn, "question_only": question_only_reward_fn}[prompt]
    return [{"response": text, "answer_reward": reward_fn(text, gold)["answer_reward"]} for text in texts]


R1_RIGHT, R1_WRONG = " x </think> <answer> 18 </answer>", " x </think> <answer> 20 </answer>"


@pytest.mark.parametrize("prompt, right, wrong", [("r1_zero", R1_RIGHT, R1_WRONG),
                                                  ("tir", "so \\boxed{18}", "so \\boxed{20}")])
def test_a_tie_for_the_most_votes_counts_wrong_whatever_the_order_of_the_samples(prompt, right, wrong):
    """The old vote gave a tie to the answer seen first: reversing the samples of a 2-2 tie flipped maj@k."""
    tie = graded([right, right, wrong, wrong], prompt)
    assert not ev._majority_is_correct(tie, prompt) and not ev._majority_is_correct(tie[::-1], prompt)
    decided = graded([right, wrong, right, wrong, right], prompt)  # one vote more decides it, in either order
    assert ev._majority_is_correct(decided, prompt) and ev._majority_is_correct(decided[::-1], prompt)


def test_only_answers_the_prompts_grader_reads_vote():
    """An unboxed or cut-off tir trace, and an r1_zero answer without the format, are graded wrong whatever their
    last number: they no longer vote for it (two such 20s outvoted a right 18)."""
    tir_samples = graded(["```output\n18\n```\nSo \\boxed{18}", "12 + 8 = 20, so the answer is 20.",
                          "```python\nprint(12 + 8)\n```\n```output\n20\n```"], "tir")  # no box; cut off
    assert ev._majority_is_correct(tir_samples, "tir")
    r1_samples = graded([R1_RIGHT, " x </think><answer> 20 </answer>", " x <answer> 20 </answer>",
                         " x </think> <answer> 20"])  # no space after </think>, no </think>, no </answer>
    assert ev._majority_is_correct(r1_samples, "r1_zero")
    assert not ev._majority_is_correct(graded(["no answer", "nor here"]), "r1_zero")  # no vote: wrong
    # question_only's grader does read the last number, so there it votes
    assert not ev._majority_is_correct(graded(["\\boxed{18}", "20", "so 20"], "question_only"), "question_only")


def test_an_unboxed_sample_does_not_make_a_right_box_the_majority():
    """The old vote pooled an unboxed 18 with a boxed 18 and took the box's reward: 3 votes for 18 (one graded)
    beat 2 boxed 20s."""
    samples = graded(["\\boxed{18}", "\\boxed{20}", "\\boxed{20}", "it is 18", "18 in all"], "tir")
    assert not ev._majority_is_correct(samples, "tir")


@pytest.mark.parametrize("prompt", ["r1_zero", "tir", "question_only"])
def test_the_vote_reads_each_answer_as_its_grader_does(prompt):
    """extract_answer answers where the grader reads an answer, and that answer grades as the grader graded it."""
    from alignment.drgrpo_grader import grade
    responses = [R1_RIGHT, R1_WRONG, " x </think> <answer> \\boxed{18} </answer>", " x </think> <answer> \\boxed{18 ",
                 " x <answer> 18 </answer>", " </think> <answer> 18", " </think> <answer> 20 </answer> <answer> 18 "
                 "</answer>", "\\boxed{18}", "\\boxed{18} then \\boxed{20}", "18", "so 18.", "\\boxed{}", "nothing"]
    for sample in graded(responses, prompt):
        answer = ev.extract_answer(sample["response"], prompt)
        assert (answer is not None and grade(answer, "18")) == (sample["answer_reward"] == 1), sample["response"]


def held_in_question(n: int = 0) -> str:
    """A question a file's test split leaves out (its hash keeps it in train)."""
    from alignment.data import held_out
    return next(q for q in (f"What is {i} + {n}?" for i in range(100)) if not held_out(q))


def no_model(*args, **kwargs):
    raise AssertionError("the model loaded: the refusal must come first")


def test_an_empty_test_split_is_refused_in_one_line(tiny_model_dir, tmp_path, monkeypatch):
    """A one-row file's test split is empty: it printed "0 of 0 problems" and averages of 0.0, exit 0."""
    monkeypatch.setattr(ev.models, "load_model", no_model)
    path = tmp_path / "one.jsonl"
    path.write_text(json.dumps({"question": held_in_question(), "answer": "1"}) + "\n")
    args = EvalArgs(model=tiny_model_dir, dataset=str(path), limit=0, output_dir=str(tmp_path / "out"))
    with pytest.raises(UserError, match=r"--split test holds no problems \(a file's test split .*evaluate it with "
                                        r"--split all, or add questions\.$"):
        ev.main(args)
    assert not (tmp_path / "out").exists()


def test_one_question_with_two_answers_is_refused_and_with_one_is_scored_twice(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(ev.models, "load_model", no_model)
    question = held_in_question()
    path = tmp_path / "twice.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in [{"question": "Other?", "answer": "3"},
                                                               {"question": question, "answer": "18"},
                                                               {"question": f"  {question}", "answer": "20"}]))
    args = EvalArgs(model=tiny_model_dir, dataset=str(path), split="all", limit=0, output_dir=str(tmp_path / "out"))
    with pytest.raises(UserError, match=r"--split all: rows 2 and 3 ask the same question .* with different answers "
                                        r"\('18' and '20'\).*drop a copy\.$"):
        ev.main(args)
    assert not (tmp_path / "out").exists()
    same = [{"question": question, "answer": "18"}, {"question": question, "answer": "18.0"}]  # graded alike
    ev._refuse_unscorable(args, same)


def test_answers_the_grader_counts_equal_vote_together():
    """18, 18.0 and 17 (gold 18) split into a 1-1-1 tie that counted wrong, where the grader gives 18.0 full marks
    (a probe round, 2026-12-07); so did 1/2, 0.5 and 3 (gold 0.5)."""
    assert ev._majority_is_correct(graded(["\\boxed{18}", "\\boxed{18.0}", "\\boxed{17}"], "tir"), "tir")
    assert ev._majority_is_correct(graded(["\\boxed{1/2}", "\\boxed{0.5}", "\\boxed{3}"], "tir", gold="0.5"), "tir")
    assert not ev._majority_is_correct(graded(["\\boxed{17}", "\\boxed{17.0}", "\\boxed{18}"], "tir"), "tir")
