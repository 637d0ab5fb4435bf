"""Your own questions, prompt and reward (issue 75): files of rows with their own columns, a prompt template of
your own, a reward of your own run in a bounded-time worker (hangs, raises and nonsense score 0, counted)."""

import hashlib
import json
import math
import re
import textwrap

import pytest
import torch

from alignment import data, evaluate
from alignment.args import EvalArgs, RLArgs, parse
from alignment.errors import UserError
from alignment.user_reward import UserReward

ROWS = [{"problem": f"What is {a} + {b}?", "gold": a + b, "topic": "sums", "tolerance": 0.5}
        for a in range(30) for b in range(4)]

REWARDS = textwrap.dedent('''
    import time

    def exact(response, ground_truth, **columns):
        print("a user's print goes to stderr, not into the protocol")
        right = float(response.strip() == ground_truth)
        return {"reward": right, "answer_reward": right}

    def within(response, ground_truth, tolerance, **columns):
        return float(abs(float(response) - float(ground_truth)) <= float(tolerance))

    def sees_columns(response, ground_truth, **columns):
        return float(columns["topic"] == "sums" and columns["problem"].startswith("What is"))

    def hangs(response, ground_truth, **columns):
        time.sleep(60)

    def raises_on_odd(response, ground_truth, **columns):
        if int(ground_truth) % 2:
            raise ValueError("an odd sample")
        return 1.0

    def nonsense(response, ground_truth, **columns):
        return {"score": "yes"}

    def parts_or_raises(response, ground_truth, **columns):
        if int(ground_truth) % 2:
            raise ValueError("cannot parse the answer")
        return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 1.0}
''')


@pytest.fixture
def own(tmp_path):
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (tmp_path / "rewards.py").write_text(REWARDS)
    return tmp_path


def test_a_file_of_rows_keeps_its_columns_and_holds_out_a_tenth_by_question(own):
    import pyarrow
    import pyarrow.parquet
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(ROWS), own / "rows.parquet")
    (own / "rows.json").write_text(json.dumps(ROWS))
    for name in ("rows.jsonl", "rows.json", "rows.parquet"):
        train, test = (data.load_dataset(str(own / name), split, question_key="problem", answer_key="gold")
                       for split in ("train", "test"))
        assert len(train) + len(test) == len(ROWS) and 0 < len(test) < len(ROWS) // 5
        assert not {r["question"] for r in train} & {r["question"] for r in test}
        assert train[0] == {"question": "What is 0 + 0?", "answer": "0",
                            "columns": {"problem": "What is 0 + 0?", "topic": "sums", "tolerance": 0.5}}
    fewer = own / "fewer.jsonl"  # a row's half depends on its question alone, not on the other rows
    fewer.write_text("".join(json.dumps(row) + "\n" for row in ROWS[::3]))
    kept = {r["question"] for r in data.load_dataset(str(fewer), "test", question_key="problem", answer_key="gold")}
    assert kept == {r["question"] for r in test} & {row["problem"] for row in ROWS[::3]}


@pytest.mark.parametrize("content, keys, message", [
    ('{"problem": "1 + 1", "gold": 2}\n', {}, r"has no column question, answer \(its columns: problem, gold\); name the "
                                             r"right ones with --question_key and --answer_key"),
    ('{"problem": "1 + 1", "gold": 2}\n{"problem": "", "gold": 3}\n', {"question_key": "problem", "answer_key": "gold"},
     "row 2 needs a non-empty text problem"),
    ('{"problem": "1 + 1", "gold": 2}\n{"oops"\n', {"question_key": "problem", "answer_key": "gold"}, ":2 is not valid JSON"),
    (b'{"problem": "caf\xe9", "gold": 2}\n', {}, ":1 is not UTF-8 text"),
])
def test_a_bad_file_or_key_is_one_line(tmp_path, content, keys, message):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=message):
        data.load_dataset(str(path), "train", **keys)


def test_a_bad_parquet_json_or_path_is_one_line(tmp_path):
    (tmp_path / "rows.parquet").write_bytes(b"not parquet")
    (tmp_path / "rows.json").write_text('{"a": 1}')
    for name, message in (("rows.parquet", "cannot be read"), ("rows.json", "must hold a JSON list of objects"),
                          ("missing.jsonl", "does not exist")):
        with pytest.raises(UserError, match=message):
            data.load_dataset(str(tmp_path / name), "train")


def test_own_data_flags_are_checked_when_parsed(own, capsys):
    cases = [(EvalArgs, ["--question_key", "q"], "--question_key q has no effect without a --dataset file"),
             (EvalArgs, ["--reward_timeout", "3"], "--reward_timeout 3.0 has no effect without --reward_fn"),
             (RLArgs, ["--reward_fn", "rewards"], "write path/to/file.py:function_name"),
             (RLArgs, ["--reward_fn", str(own / "nope.py") + ":f"], "nope.py does not exist"),
             (EvalArgs, ["--prompt_file", str(own / "none.prompt")], "none.prompt does not exist"),
             (EvalArgs, ["--prompt_file", str(own)], f"{own} is a folder, not a file; name the template file"),
             (EvalArgs, ["--dataset", str(own / "none.jsonl")], "none.jsonl does not exist")]
    (own / "bare.prompt").write_text("Answer this.")
    cases.append((EvalArgs, ["--prompt_file", str(own / "bare.prompt")], "has no {question}"))
    (own / "fancy.prompt").write_text("Q: {question!r} A:")  # str.format's extras, which the template does not run
    cases.append((EvalArgs, ["--prompt_file", str(own / "fancy.prompt")], "{question!r} asks for a conversion"))
    (own / "rw.txt").write_text("def f(response, ground_truth, **columns):\n    return 1.0\n")
    for where in (own / "rw.txt", own / "rw", "examples/tolerance/reward"):  # not a .py file, not a module name
        cases.append((RLArgs, ["--reward_fn", f"{where}:f"], "is neither a .py file nor a module name"))
    cases.append((EvalArgs, ["--reward_fn", f"{own / 'rewards.py'}:exact", "--reward_timeout", "1e12"],
                  "--reward_timeout 1e+12 is above the largest, 86400 s"))
    for cls, argv, message in cases:
        with pytest.raises(SystemExit):
            parse(cls, argv)
        assert message in capsys.readouterr().err


def test_a_reward_of_ones_own_scores_in_a_worker_and_never_stops_the_run(own):
    """A hang, a raise and nonsense each score that sample 0 and are counted; the worker goes on answering."""
    rows = {"problem": "What is 1 + 2?", "topic": "sums", "tolerance": 0.5}
    checks = {"exact": ([("3", 1.0), ("4", 0.0)], 0), "within": ([("3.4", 1.0), ("3.6", 0.0)], 0),
              "sees_columns": ([("x", 1.0)], 0), "nonsense": ([("3", 0.0)], 1), "hangs": ([("3", 0.0)], 1)}
    for name, (cases, failures) in checks.items():
        reward = UserReward(f"{own / 'rewards.py'}:{name}", timeout=1.0)
        try:
            for response, expected in cases:
                assert reward(response, "3", rows)["reward"] == expected
            assert len(reward.errors) == failures
            if name == "exact":
                assert reward("3", "3", rows)["format_reward"] != reward("3", "3", rows)["format_reward"]  # NaN: absent
            if name == "hangs":
                assert "took more than 1 s (--reward_timeout)" in reward.errors[0]
        finally:
            reward.close()
    raising = UserReward(f"{own / 'rewards.py'}:raises_on_odd", timeout=1.0)
    assert [raising("x", truth, rows)["reward"] for truth in ("2", "3", "4")] == [1.0, 0.0, 1.0]
    assert raising.errors == ["ValueError: an odd sample"]
    raising.close()
    with pytest.raises(UserError, match="cannot load it .*has no function missing"):
        UserReward(f"{own / 'rewards.py'}:missing", timeout=1.0)


def test_a_reward_that_cannot_be_found_or_loaded_is_one_line(own):
    """A module that is not there, and a file whose import exits, each end in one line saying so."""
    from alignment.user_reward import source_hash
    for spec in ("nosuchpkg.mod:f", "nosuchmodule:f"):
        with pytest.raises(UserError, match="no module nosuch.* is importable here"):
            source_hash(spec)
        with pytest.raises(UserError, match="no module nosuch.* is importable here"):
            UserReward(spec, timeout=1.0)
    (own / "exits.py").write_text("import sys\nsys.exit('no GPU here')\n")
    with pytest.raises(UserError, match=r"cannot load it \(its import raised SystemExit: no GPU here\)"):
        UserReward(f"{own / 'exits.py'}:f", timeout=1.0)
    (own / "dies.py").write_text("import os\nos._exit(4)\n")
    with pytest.raises(UserError, match=r"the worker ended \(exit status 4\) while importing it"):
        UserReward(f"{own / 'dies.py'}:f", timeout=1.0)


NUMBERS = textwrap.dedent('''
    import numpy

    def numpy_half(response, ground_truth, **columns):
        return {"reward": numpy.float32(0.5), "answer_reward": numpy.bool_(True), "format_reward": numpy.int64(1)}
''')


@pytest.mark.parametrize("value, expected", [
    (0.5, {"reward": 0.5}), (1, {"reward": 1.0}), (True, {"reward": 1.0}), ("np.float32(0.5)", {"reward": 0.5}),
    ("np.float64(0.25)", {"reward": 0.25}), ("np.int8(-1)", {"reward": -1.0}), ("np.bool_(False)", {"reward": 0.0}),
    ("np.array(0.5)", {"reward": 0.5}), ({"reward": 1, "answer_reward": False}, {"reward": 1.0, "answer_reward": 0.0}),
    (None, "the return value is null, not a real number"), ("0.5", "the return value is \"0.5\", not a real number"),
    (float("nan"), "not a finite number"), (complex(1, 0), "not a real number"), ("np.array([1.0])", "not a real number"),
    ("np.float32('inf')", "not a finite number"), ("torch.tensor(0.5)", {"reward": 0.5}),
    ("torch.tensor(True)", {"reward": 1.0}), ("torch.tensor(3)", {"reward": 3.0}),
    ("torch.tensor(1j)", "not a real number"), ("torch.tensor([0.5])", "not a real number"),
])
def test_a_reward_may_return_any_real_number(value, expected):
    """numpy scalars and 0-d torch tensors, ints and bools (a 0/1 reward) are numbers; text, None, complex, NaN and
    arrays are not."""
    import numpy as np
    import torch
    from alignment.user_reward import _checked
    value = eval(value, {"np": np, "torch": torch}) if isinstance(value, str) and value.startswith(("np.", "torch.")) \
        else value
    if isinstance(expected, dict):
        assert _checked(value) == expected and all(type(v) is float for v in _checked(value).values())
    else:
        with pytest.raises(TypeError, match=expected):
            _checked(value)


def test_numpy_numbers_come_back_through_the_worker(own):
    (own / "numbers.py").write_text(NUMBERS)
    reward = UserReward(f"{own / 'numbers.py'}:numpy_half", timeout=5.0)
    try:
        assert reward("x", "1", {}) == {"reward": 0.5, "format_reward": 1.0, "answer_reward": 1.0, "reward_failed": 0.0}
        assert reward.errors == []
    finally:
        reward.close()


def test_a_column_named_as_a_reward_argument_is_refused_before_the_model_loads(own, tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """`response` or `ground_truth` as a column would collide with the reward's own arguments."""
    (own / "clash.jsonl").write_text("".join(json.dumps({**row, "response": "x"}) + "\n" for row in ROWS))
    monkeypatch.setattr(evaluate.models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match="has a column named response, which would collide with the reward's own "
                                        "argument response .*: rename the column"):
        evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "clash.jsonl"), question_key="problem",
                               answer_key="gold", reward_fn=f"{own / 'rewards.py'}:exact",
                               output_dir=str(tmp_path / "e")))
    assert not (tmp_path / "e").exists()


def test_evaluate_on_ones_own_file_prompt_and_reward(own, tiny_model_dir, tmp_path):
    """The reward sees the row's other columns, the prompt fills them in, a part the reward does not return is
    absent (None), not 0, and a failing call is counted."""
    (own / "mine.prompt").write_text("Topic {topic}. {question} Answer:")
    summary = evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "rows.jsonl"), question_key="problem",
                                     answer_key="gold", prompt_file=str(own / "mine.prompt"), max_tokens=2,
                                     reward_fn=f"{own / 'rewards.py'}:sees_columns", output_dir=str(tmp_path / "e")))
    assert summary["avg_all_rewards"] == 1.0 and summary["avg_format_rewards"] is None
    assert summary["reward_failures"] == 0 and len(summary["reward_fn_sha256"]) == 64
    records = [json.loads(line) for line in open(tmp_path / "e" / "results.jsonl")]
    assert records[0]["prompt"].startswith("Topic sums. What is") and records[0]["answer_reward"] is None
    summary = evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "rows.jsonl"), question_key="problem",
                                     answer_key="gold", max_tokens=2, reward_fn=f"{own / 'rewards.py'}:raises_on_odd",
                                     output_dir=str(tmp_path / "odd")))
    odd = sum(int(r["answer"]) % 2 for r in data.load_dataset(str(own / "rows.jsonl"), "test", question_key="problem",
                                                                answer_key="gold"))
    assert summary["reward_failures"] == odd > 0
    summary = evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "rows.jsonl"), question_key="problem",
                                     answer_key="gold", max_tokens=2, reward_fn=f"{own / 'rewards.py'}:parts_or_raises",
                                     output_dir=str(tmp_path / "parts")))
    n = summary["count"]  # a failed call scores its sample 0, format and answer too: they were left out (1.0, a probe)
    assert summary["reward_failures"] == odd and summary["avg_answer_rewards"] == summary["avg_format_rewards"] == \
        pytest.approx((n - odd) / n)
    assert 0 < odd < n
    (own / "fails.py").write_text("def always_fails(response, ground_truth, **columns):\n    return None\n")
    with pytest.raises(UserError, match="failed on every answer .*, first: TypeError: the return value is null"):
        evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "rows.jsonl"), question_key="problem",
                               answer_key="gold", max_tokens=2, reward_fn=f"{own / 'fails.py'}:always_fails",
                               output_dir=str(tmp_path / "fails")))
    assert not (tmp_path / "fails").exists()  # no summary that reads like a score of 0


PARITY = textwrap.dedent('''
    def parity(response, ground_truth, topic, **columns):
        assert topic == "sums"  # the row's own column, by name
        return {"reward": float(len(response) % 2), "answer_reward": float(len(response) % 2)}

    def sometimes(response, ground_truth, **columns):
        if len(response) % 3 == 0:
            raise ValueError("a third of the answers")
        return float(len(response) % 2)

    def always_fails(response, ground_truth, **columns):
        return None
''')


def test_rl_on_ones_own_file_and_reward_counts_failures_and_guards_the_resume(own, tiny_model_dir, tmp_path, capsys):
    from alignment import train_rl
    from tests.test_train_rl import read_jsonl, tiny_args
    (own / "rl_rewards.py").write_text(PARITY)
    flags = dict(dataset=str(own / "rows.jsonl"), question_key="problem", answer_key="gold", eval_every=2)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", reward_fn=f"{own / 'rl_rewards.py'}:sometimes", **flags))
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [m for m in metrics if "reward_failures" in m]
    assert len(steps) == 2 and sum(m["reward_failures"] for m in steps) > 0 and all(m["format_reward"] is None for m in steps)
    out = capsys.readouterr().out
    assert "reward failures" in out
    told = [line for line in out.splitlines() if "a --reward_fn call failed (scored 0):" in line]  # (a probe round:
    assert told and len(told) == len(set(line.split(": ", 1)[1] for line in told)) <= 5, told  # no why was given)
    evals = [m for m in metrics if "eval_avg_all_rewards" in m]
    held_out = data.load_dataset(str(own / "rows.jsonl"), "test", question_key="problem", answer_key="gold")
    assert evals and all(m["eval_count"] == len(held_out) for m in evals)  # the file's own held-out tenth
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert len(config["reward_fn_sha256"]) == 64
    (own / "rl_rewards.py").write_text(PARITY + "\n# changed\n")
    resume = dict(resume=str(tmp_path / "run"), n_steps=3, reward_fn=f"{own / 'rl_rewards.py'}:sometimes", **flags)
    with pytest.raises(UserError, match="its file changed since the run's checkpoint .*--accept_changed_reward"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", **resume))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", accept_changed_reward=True, **resume))
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]["step"] == 3
    with pytest.raises(UserError, match="failed on every sample of the run's first step, e.g. TypeError: the return value "
                                        "is null"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "broken", reward_fn=f"{own / 'rl_rewards.py'}:always_fails",
                                **{**flags, "eval_every": 0}))  # (with evaluations: the one before step 1 stops it)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "columns", n_steps=1,
                            reward_fn=f"{own / 'rl_rewards.py'}:parity", **flags))  # asserts inside the reward
    assert [m["reward_failures"] for m in read_jsonl(tmp_path / "columns" / "metrics.jsonl") if "loss" in m] == [0]


def test_the_example_evaluates_trains_and_plots_on_a_tiny_model(tiny_model_dir, tmp_path):
    """examples/tolerance/README.md's three commands, on a tiny model and with fewer steps."""
    from alignment import plot, train_rl
    from alignment.args import parse as parse_flags
    from pathlib import Path
    example = Path(__file__).resolve().parents[1] / "examples" / "tolerance"
    own = ["--dataset", str(example / "questions.jsonl"), "--prompt_file", str(example / "tolerance.prompt"),
           "--reward_fn", f"{example / 'reward.py'}:within_tolerance"]
    summary = evaluate.main(parse_flags(EvalArgs, ["--model", tiny_model_dir, "--max_tokens", "3", "--output_dir",
                                                   str(tmp_path / "eval"), *own]))
    assert summary["count"] == 30 and summary["reward_failures"] == 0 and summary["avg_format_rewards"] == 0.0
    train_rl.main(parse_flags(RLArgs, ["--model", tiny_model_dir, "--n_steps", "1", "--group_size", "4",
                                       "--rollout_batch_size", "8", "--train_batch_size", "8", "--sampling_max_tokens",
                                       "4", "--eval_every", "1", "--eval_limit", "4", "--precision", "fp32",
                                       "--output_dir", str(tmp_path / "rl"), *own]))
    assert plot.plot([tmp_path / "rl"]).exists()


def test_sft_reads_the_same_formats_with_its_own_column_names(tmp_path, capsys):
    import pyarrow
    import pyarrow.parquet
    from alignment.args import SFTArgs
    pairs = [{"q": f"Q{i}", "a": f" A{i} </answer>", "extra": i} for i in range(8)]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(pairs), tmp_path / "pairs.parquet")
    (tmp_path / "pairs.csv").write_text("q,a\n" + "".join(f"{p['q']},{p['a']}\n" for p in pairs))
    for name in ("pairs.parquet", "pairs.csv"):
        assert data.load_pairs(str(tmp_path / name), "q", "a")[3] == {"prompt": "Q3", "response": " A3 </answer>"}
    with pytest.raises(UserError, match="row 1 lacks a text prompt or response .*--prompt_key and --response_key"):
        data.load_pairs(str(tmp_path / "pairs.parquet"))
    with pytest.raises(SystemExit):
        parse(SFTArgs, ["--prompt_key", "q"])
    assert "--prompt_key q has no effect without --train_file" in capsys.readouterr().err


@pytest.mark.parametrize("name, content, row", [
    ("e.csv", "question,answer\nWhat is 1+1?,2\nWhat is 2+2?,\n", 2),  # an empty gold would reward an empty answer
    ("e.jsonl", '{"question": "a?", "answer": "  "}\n', 1),
    ("e.jsonl", '{"question": "a?", "answer": 2}\n{"question": "b?", "answer": true}\n', 2),
    ("e.json", '[{"question": "a?", "answer": NaN}]', 1),
    ("nan.parquet", None, 2),
])
def test_an_empty_boolean_or_nan_answer_is_refused_naming_the_file_and_row(tmp_path, name, content, row):
    path = tmp_path / name
    if content is None:
        import pyarrow
        import pyarrow.parquet
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist([{"question": "a?", "answer": 1.5},
                                                               {"question": "b?", "answer": float("nan")}]), path)
    else:
        path.write_text(content)
    with pytest.raises(UserError, match=rf"{name}: row {row} needs a non-empty text question and a non-empty text or "
                                        rf"finite number answer"):
        data.load_dataset(str(path), "all")
    (tmp_path / "ok.json").write_text('[{"question": "a?", "answer": 2.5}, {"question": "b?", "answer": " x "}]')
    assert [r["answer"] for r in data.load_dataset(str(tmp_path / "ok.json"), "all")] == ["2.5", " x "]


def test_a_question_that_differs_only_in_whitespace_is_held_out_with_its_twin(tmp_path):
    questions = [f"What is {a} + {b}?" for a in range(20) for b in range(20)]
    variants = [text for q in questions for text in (q, q + " ", "  " + q, q.replace(" + ", "  +\t"))]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"question": q, "answer": "1"}) + "\n" for q in variants))
    train, test = (data.load_dataset(str(tmp_path / "rows.jsonl"), split) for split in ("train", "test"))
    assert len(train) + len(test) == len(variants) and test
    assert not {" ".join(r["question"].split()) for r in train} & {" ".join(r["question"].split()) for r in test}
    # the split of normalised text is the raw text's: the tolerance example's published 30 held-out questions stay
    example = data.load_dataset(str(data.REPO_ROOT / "examples" / "tolerance" / "questions.jsonl"), "test")
    held = "\n".join(r["question"] for r in example)
    assert len(example) == 30 and hashlib.sha256(held.encode()).hexdigest()[:16] == "738175baac221b77"  # before the change too


def test_rl_leaves_out_an_evaluation_question_that_differs_only_in_whitespace(tmp_path):
    """Between --dataset and --eval_dataset (here folders with named splits: the hash cannot part them)."""
    import datasets
    from alignment.train_rl import load_questions
    train = [{"question": q, "answer": "1"} for q in ("What is 13 + 19? ", "What  is 1 + 1?", "What is 2 + 2?")]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(str(tmp_path / "train"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"question": "What is 13 + 19?", "answer": "32"}])}
                         ).save_to_disk(str(tmp_path / "eval"))
    lines = []
    kept, evaluated, _ = load_questions(RLArgs(dataset=str(tmp_path / "train"), eval_dataset=str(tmp_path / "eval"),
                                               rollout_batch_size=2, group_size=2), lines.append)
    assert [r["question"] for r in kept] == ["What  is 1 + 1?", "What is 2 + 2?"] and len(evaluated) == 1
    assert "1 of 3 training questions are among the 1 evaluation questions" in lines[-1]


def test_a_question_that_differs_only_in_case_is_left_out_of_training_too(tmp_path):
    """"What is 13 + 19?" evaluated and "what is 13 + 19?" trained on is the same question learned (a probe round,
    2026-12-02); the held-out hash keeps case (folding it would move every file's split), the leak check folds it."""
    import datasets
    from alignment.train_rl import load_questions
    train = [{"question": q, "answer": "1"} for q in ("WHAT IS 13 + 19?", "what is 13 + 19?", "What is 2 + 2?")]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(str(tmp_path / "train"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list([{"question": "What is 13 + 19?", "answer": "32"}])}
                         ).save_to_disk(str(tmp_path / "eval"))
    kept, _, _ = load_questions(RLArgs(dataset=str(tmp_path / "train"), eval_dataset=str(tmp_path / "eval"),
                                       rollout_batch_size=2, group_size=2), lambda line: None)
    assert [r["question"] for r in kept] == ["What is 2 + 2?"]
    assert data.held_out("What is 13 + 19?") == data.held_out(" What  is 13 + 19?")  # spacing: one split


def test_copies_of_any_test_question_of_a_file_are_left_out_whatever_the_eval_limit(tmp_path):
    """Only the first --eval_limit test questions were compared: with --eval_limit 4 (or 0) the upper-case copies of
    the rest were trained on, and `evaluate --dataset FILE` then scored them (a probe round, 2026-12-02)."""
    from alignment.train_rl import load_questions
    questions = [f"What is {a} + {b}?" for a in range(10) for b in range(10)]
    rows = [{"question": text, "answer": "1"} for q in questions for text in (q, q.upper(), "  " + q)]
    (tmp_path / "twins.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    test = {data.twin(r["question"]) for r in data.load_dataset(str(tmp_path / "twins.jsonl"), "test")}
    for limit in (100, 4, 0):
        lines = []
        kept, _, _ = load_questions(RLArgs(dataset=str(tmp_path / "twins.jsonl"), eval_limit=limit,
                                           rollout_batch_size=2, group_size=2), lines.append)
        assert kept and not {data.twin(r["question"]) for r in kept} & test, limit
        assert limit == 100 or any("copies (the same, or in other spacing or case) of questions in the test split" in line
                                   for line in lines), lines


def test_rl_says_which_split_of_an_eval_file_it_evaluates_and_names_the_eval_flag(own, tmp_path):
    from alignment.train_rl import load_questions
    lines = []
    flags = dict(question_key="problem", answer_key="gold", rollout_batch_size=2, group_size=2)
    _, evaluated, _ = load_questions(RLArgs(dataset=str(own / "rows.jsonl"), eval_dataset=str(own / "rows.jsonl"),
                                            **flags), lines.append)
    assert any(f"held out of training: the test split of {own / 'rows.jsonl'} (one question in 10, by a hash of the "
               f"question" in line and f"evaluated: its first {len(evaluated)} questions" in line for line in lines), lines
    for limit in (0, 2):  # nothing evaluated (--eval_limit 0, or --eval_every 0): the line does not say it is
        lines.clear()  # (probe rounds 7 and 8, 2026-12-02)
        load_questions(RLArgs(dataset=str(own / "rows.jsonl"), eval_limit=limit, eval_every=0, **flags), lines.append)
        assert any("held out of training: the test split of" in line and "evaluated" not in line for line in lines)
    (tmp_path / "q.jsonl").write_text('{"question": "a?", "answer": "1"}\n')
    with pytest.raises(UserError, match=rf"^--eval_dataset {tmp_path / 'q.jsonl'} has no column problem, gold"):
        load_questions(RLArgs(dataset=str(own / "rows.jsonl"), eval_dataset=str(tmp_path / "q.jsonl"), **flags))


def test_an_unknown_split_is_refused_naming_the_choices(own, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"--split tset is not a split of .*rows.jsonl; choose test \(its held-out "
                                        r"tenth\), train or all"):
        data.load_dataset(str(own / "rows.jsonl"), "tset", question_key="problem", answer_key="gold")
    monkeypatch.setenv("ALIGNMENT_GSM8K_URL", (tmp_path / "nowhere").as_uri())  # no network in a test
    with pytest.raises(UserError, match=r"^gsm8k has the splits train and test, not 'tset'"):
        data.load_dataset("gsm8k", "tset", str(tmp_path / "no-data"))
    assert not (tmp_path / "no-data").exists()


@pytest.mark.parametrize("content, keys, message", [
    ("question,answer\nWhat is 1+1?,2\nWhat is 2+2?,4,extra\n", {},
     r"rows.csv:3 has 3 fields but the header names 2 \(question, answer\)"),
    ("question,answer\nWhat is 1+1?,2\n", {"answer_key": "question"},
     r"--question_key and --answer_key both name the column question"),
])
def test_a_bad_csv_row_or_one_column_for_both_is_one_line(tmp_path, content, keys, message):
    (tmp_path / "rows.csv").write_text(content)
    with pytest.raises(UserError, match=message):
        data.load_dataset(str(tmp_path / "rows.csv"), "all", **keys)


def test_a_byte_order_mark_is_not_part_of_the_first_column(tmp_path):
    """Excel saves CSV with a UTF-8 BOM; its first column's name once began with it."""
    rows = [{"question": "What is 1+1?", "answer": "2"}]
    (tmp_path / "rows.csv").write_text("question,answer\nWhat is 1+1?,2\n", encoding="utf-8-sig")
    (tmp_path / "rows.json").write_text(json.dumps(rows), encoding="utf-8-sig")
    (tmp_path / "rows.jsonl").write_text(json.dumps(rows[0]) + "\n", encoding="utf-8-sig")
    for name in ("rows.csv", "rows.json", "rows.jsonl"):
        assert [{k: r[k] for k in ("question", "answer")} for r in data.load_dataset(str(tmp_path / name), "all")] == rows


def test_an_empty_jsonl_says_what_a_line_must_hold(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(UserError, match=r"empty.jsonl holds no rows; fix the file: each line must be one JSON "
                                        r"object, one row per question\.$"):
        data.load_dataset(str(tmp_path / "empty.jsonl"), "all")


@pytest.mark.parametrize("name", ["pairs.csv", "pairs.json", "pairs.parquet", "pairs.jsonl"])
def test_sft_refuses_a_row_with_nothing_to_train_on_in_every_format(tmp_path, name):
    """The empty row crashed the model's forward from CSV, JSON and parquet; JSONL refused it: one rule for all."""
    import pyarrow
    import pyarrow.parquet
    pairs = [{"prompt": "p", "response": ""}, {"prompt": "", "response": ""}]
    path = tmp_path / name
    if name.endswith(".parquet"):
        pyarrow.parquet.write_table(pyarrow.Table.from_pylist(pairs), path)
    else:
        path.write_text({"pairs.csv": "prompt,response\np,\n,\n", "pairs.json": json.dumps(pairs),
                         "pairs.jsonl": "".join(json.dumps(p) + "\n" for p in pairs)}[name])
    where = ":2: prompt and response" if name.endswith(".jsonl") else ": row 2: prompt and response"
    with pytest.raises(UserError, match=rf"{name}{where} are empty, nothing to train on"):
        data.load_pairs(str(path))


def test_the_step_line_says_absent_for_a_reward_part_the_user_reward_does_not_return():
    """train_rl printed `fmt nan | ans nan`; evaluate says absent."""
    from alignment.train_rl import _log_line
    line = _log_line({"step": 1, "reward": 0.5, "format_reward": float("nan"), "answer_reward": None,
                      "response_tokens": 3.0, "loss": 0.1, "seconds_step": 1.0}, 2)
    assert "fmt absent | ans absent |" in line and "fmt nan" not in line
    line = _log_line({"step": 1, "reward": 0.5, "format_reward": 1.0, "answer_reward": 0.0, "response_tokens": 3.0,
                      "loss": 0.1, "seconds_step": 1.0}, 2)
    assert "fmt 1.00 | ans 0.00 |" in line


def test_a_resume_after_the_prompt_or_data_file_changed_is_refused_and_the_prompt_is_read_once(own, tiny_model_dir,
                                                                                                 tmp_path):
    """A resume trained on a rewritten prompt (`IGNORE ALL. {question}`) and on golds all set to 0, silently; and
    the prompt file was read again at every step, so editing it mid-run changed training."""
    from alignment import train_rl
    from tests.test_train_rl import read_jsonl, tiny_args
    prompt, rows, run = own / "mine.prompt", own / "rows.jsonl", tmp_path / "run"
    prompt.write_text("Topic {topic}. {question} Answer:")
    (own / "edits.py").write_text(f"from pathlib import Path\n\ndef edits(response, ground_truth, **columns):\n"
                                  f"    Path({str(prompt)!r}).write_text('IGNORE ALL. {{question}}')\n    return 1.0\n")
    flags = dict(dataset=str(rows), question_key="problem", answer_key="gold", prompt_file=str(prompt),
                 reward_fn=f"{own / 'edits.py'}:edits")
    train_rl.main(tiny_args(tiny_model_dir, run, **flags))  # the reward rewrites the prompt file in step 1
    assert prompt.read_text().startswith("IGNORE ALL")
    logged = read_jsonl(run / "rollouts.jsonl")
    assert {r["step"] for r in logged} == {1, 2} and all(r["prompt"].startswith("Topic sums. ") for r in logged)
    config = json.loads((run / "config.json").read_text())
    assert config["prompt_file_sha256"] == hashlib.sha256(b"Topic {topic}. {question} Answer:").hexdigest()
    assert config["dataset_sha256"] == hashlib.sha256(rows.read_bytes()).hexdigest()
    resume = dict(resume=str(run), n_steps=3, **flags)
    with pytest.raises(UserError, match=r"--prompt_file .*mine.prompt \(sha256 \w{12} then, \w{12} now\): the file "
                                        r"changed since the run's checkpoint: restore it, or pass --accept_changed_data"):
        train_rl.main(tiny_args(tiny_model_dir, run, **resume))
    prompt.write_text("Topic {topic}. {question} Answer:")  # restored; now every gold becomes 0
    rows.write_text("".join(json.dumps({**row, "gold": 0}) + "\n" for row in ROWS))
    with pytest.raises(UserError, match=r"^--dataset .*rows.jsonl \(sha256 \w+ then, \w+ now\): the file changed"):
        train_rl.main(tiny_args(tiny_model_dir, run, **resume))
    assert read_jsonl(run / "metrics.jsonl")[-1]["step"] == 2
    train_rl.main(tiny_args(tiny_model_dir, run, accept_changed_data=True, **resume))
    assert read_jsonl(run / "metrics.jsonl")[-1]["step"] == 3


def test_a_prompt_file_that_is_not_utf8_is_one_line_before_the_model_loads(own, tiny_model_dir, tmp_path, capsys,
                                                                             monkeypatch):
    """It ended in a UnicodeDecodeError after the model loaded: the {question} check read it with errors="replace"."""
    from alignment import models, train_rl
    from tests.test_train_rl import tiny_args
    bad = own / "latin1.prompt"
    bad.write_bytes(b"Topic {topic}.\nQ: {question} caf\xe9\n")
    message = rf"--prompt_file {bad} is not UTF-8 text: byte 0xe9 at line 2 \(byte 32\); save the file as UTF-8"
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--prompt_file", str(bad)])
    assert re.search(message, capsys.readouterr().err)
    for name in ("load_model", "load_policy", "load_policy_model"):
        monkeypatch.setattr(models, name, lambda *a, **k: pytest.fail("the model loaded"))
    flags = dict(dataset=str(own / "rows.jsonl"), question_key="problem", answer_key="gold", prompt_file=str(bad))
    with pytest.raises(UserError, match=message):
        evaluate.main(EvalArgs(model=tiny_model_dir, max_tokens=2, output_dir=str(tmp_path / "e"), **flags))
    with pytest.raises(UserError, match=message):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", **flags))
    assert not (tmp_path / "e").exists() and not (tmp_path / "run").exists()


def test_a_placeholder_the_data_lacks_is_refused_before_the_model_loads(own, tiny_model_dir, tmp_path, monkeypatch):
    """`{subject}` stayed in every prompt, literally; `{{` and `}}` write a brace, as in str.format."""
    from alignment import models
    (own / "typo.prompt").write_text("Subject {subject}. {question} Answer:")
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    with pytest.raises(UserError, match=r"--prompt_file has \{subject\}, and the data has no such column \(its columns: "
                                        r"problem, question, tolerance, topic\): rename it .* or write "
                                        r"\{\{subject\}\} for the text itself"):
        evaluate.main(EvalArgs(model=tiny_model_dir, dataset=str(own / "rows.jsonl"), question_key="problem",
                               answer_key="gold", prompt_file=str(own / "typo.prompt"), max_tokens=2,
                               output_dir=str(tmp_path / "e")))
    assert data.format_prompt("{{subject}} {topic}: {question} \\boxed{} }}", "1 + {topic}?", {"topic": "sums"}) == \
        "{subject} sums: 1 + {topic}? \\boxed{} }"
    # train_rl in the tir mode too (it checks no context up front, so the prompt was first written at step 1)
    from alignment import train_rl
    from tests.test_train_rl import tiny_args
    for name in ("load_policy", "load_policy_model"):
        monkeypatch.setattr(models, name, lambda *a, **k: pytest.fail("the model loaded"), raising=False)
    with pytest.raises(UserError, match=r"--prompt_file has \{subject\}, and the data has no such column"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", dataset=str(own / "rows.jsonl"), question_key="problem",
                                answer_key="gold", prompt_file=str(own / "typo.prompt"), prompt="tir",
                                rollout_mode="tir"))


def test_a_datasets_folder_is_hashed_by_its_files(tmp_path):
    """A folder saved by `datasets` has no single file to hash: its files' names and bytes are."""
    from types import SimpleNamespace
    from alignment.run import _data_hash
    folder = tmp_path / "saved"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    (folder / "dataset_dict.json").write_text('{"splits": ["train"]}')
    args = SimpleNamespace(accept_changed_data=False, prompt_file=None, dataset=str(folder), eval_dataset="gsm8k")
    before = _data_hash(args)
    assert sorted(before) == ["dataset_sha256", "eval_dataset_sha256"] and _data_hash(args) == before  # (gsm8k: its
    # files in the data folder, since a probe round of 2026-12-02)
    (folder / "train" / "data-00000-of-00001.arrow").write_bytes(b"other rows")
    assert _data_hash(args) != before


def test_accepting_a_changed_file_is_moot_without_a_resume(tmp_path, capsys):
    """evaluate never resumes, and a run that starts afresh compares no file: --accept_changed_data/_reward there
    are refused in one line, not silently accepted (a probe round, 2026-12-02)."""
    from alignment.args import EvalArgs, RLArgs, parse
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "1 + 1?", "answer": "2"}\n')
    for cls, flag in ((EvalArgs, "--accept_changed_data"), (RLArgs, "--accept_changed_data"),
                      (RLArgs, "--accept_changed_reward")):
        with pytest.raises(SystemExit):
            parse(cls, ["--dataset", str(rows), flag, *(["--reward_fn", "m.py:f"] if "reward" in flag else [])])
        assert "without --resume" in capsys.readouterr().err


def test_a_failed_call_counts_zero_in_the_parts_other_calls_return_and_an_absent_part_stays_absent():
    from alignment.grpo import reward_metrics
    from alignment.user_reward import zero_failed_parts
    nan = float("nan")
    ok = {"reward": 1.0, "format_reward": 1.0, "answer_reward": nan, "reward_failed": 0.0}
    failed = {"reward": 0.0, "format_reward": nan, "answer_reward": nan, "reward_failed": 1.0}
    scores = zero_failed_parts([ok, failed])
    assert scores[1]["format_reward"] == 0.0 and scores[1]["answer_reward"] != scores[1]["answer_reward"]  # NaN
    metrics = reward_metrics(torch.tensor([1.0, 0.0]), [ok, failed], 2)
    assert metrics["format_reward_mean"] == 0.5 and math.isnan(metrics["answer_reward_mean"])
    from alignment.user_reward import recall_returned
    reward = UserReward.__new__(UserReward)  # a resume: the parts earlier records read count as returned
    reward.returned, score = set(), lambda *a: None
    score.user_reward = reward
    recall_returned(score, [{"step": 1, "format_reward": None, "answer_reward": nan}, {"step": 2, "format_reward": None},
                            {"step": 2, "eval_avg_format_rewards": 0.5, "eval_avg_answer_rewards": None}])
    assert reward.returned == {"format_reward"}


def test_a_step_whose_calls_all_fail_reads_zero_not_absent_and_a_resume_counts_them_as_a_run_never_stopped(
        own, tiny_model_dir, tmp_path, monkeypatch):
    """Both found by a probe round (2026-12-02): such a step's format/answer were null (plots and means skipped the
    worst steps), and the first step after a resume stopped the run where the same run unstopped counted them."""
    from alignment import train_rl
    from tests.test_train_rl import read_jsonl, tiny_args
    (own / "switch.py").write_text(textwrap.dedent('''
        import os

        def switch(response, ground_truth, **columns):
            with open(os.environ["CALLS_FILE"], "a+") as calls:  # each call in its own process: count on disk
                calls.write("x")
                calls.seek(0)
                if len(calls.read()) > int(os.environ["CALLS_BEFORE_FAILING"]):
                    raise ValueError("the grader's service is down")
            return {"reward": 1.0, "format_reward": 1.0, "answer_reward": 0.0}
    '''))
    monkeypatch.setenv("CALLS_FILE", str(tmp_path / "calls"))
    monkeypatch.setenv("CALLS_BEFORE_FAILING", "8")  # step 1's 8 samples, then every call fails
    flags = dict(dataset=str(own / "rows.jsonl"), question_key="problem", answer_key="gold",
                 reward_fn=f"{own / 'switch.py'}:switch")
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, **flags))
    steps = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert [m["format_reward"] for m in steps] == [1.0, 0.0] and steps[1]["reward_failures"] == 8
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", resume=str(tmp_path / "run"), n_steps=3, **flags))
    steps = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 3 and steps[2]["reward_failures"] == 8  # counted, as without the stop, and its parts read
    assert steps[2]["format_reward"] == steps[2]["answer_reward"] == 0.0  # 0 as there (a probe round: null)


def test_the_reward_worker_and_its_call_end_when_the_run_is_gone(own):
    """A second Ctrl-C or SIGTERM ended the run at once, but the worker and its call lived on (parent 1) until the
    call's --reward_timeout, up to a day (a probe round, 2026-12-02): its stdin closing ends both."""
    import os
    import subprocess
    import sys
    import time
    from alignment import user_reward
    worker = subprocess.Popen([sys.executable, user_reward.__file__, f"{own / 'rewards.py'}:hangs"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert json.loads(worker.stdout.readline()) == {"ready": True, "batched": False}
    worker.stdin.write(json.dumps({"responses": ["1"], "ground_truths": ["1"], "columns": [{}]}).encode() + b"\n")
    worker.stdin.flush()
    time.sleep(1.0)  # the call is running (it sleeps 60 s)
    start = time.monotonic()
    worker.stdin.close()
    assert worker.wait(timeout=20) == 0 and time.monotonic() - start < 10
    left = subprocess.run(["pgrep", "-f", f"{own / 'rewards.py'}:hangs"], capture_output=True, text=True).stdout
    assert not left.strip()


def test_a_datasets_folder_s_whole_test_split_is_left_out_of_training(tmp_path):
    """Only the first --eval_limit of a folder's own test split were compared; `evaluate --dataset FOLDER` scores all
    of it (a probe round, 2026-12-02)."""
    import datasets
    from alignment.train_rl import load_questions
    rows = [{"question": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(40) for b in range(2)]
    test, train = rows[:6], rows[6:30] + [{**rows[4], "question": rows[4]["question"].upper()}, rows[5]]
    folder = tmp_path / "folder"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                          "test": datasets.Dataset.from_list(test)}).save_to_disk(str(folder))
    kept, evaluated, _ = load_questions(RLArgs(dataset=str(folder), eval_limit=2, rollout_batch_size=2, group_size=2),
                                        lambda line: None)
    assert len(evaluated) == 2 and len(kept) == 24
    assert not {data.twin(r["question"]) for r in kept} & {data.twin(r["question"]) for r in test}


RG = "rg:basic_arithmetic:min_terms=2,max_terms=2,max_digits=2,operators=+,allow_negation=false,allow_parentheses=false"


def test_an_rg_task_s_whole_test_split_is_left_out_of_rl_and_sft_whatever_the_eval_limit():
    """Only the first --eval_limit rg test questions were left out (none in SFT with --eval_limit 0), while `evaluate`
    makes 2,000 and scores as many as --limit asks (a probe round, 2026-12-02: 145 of --limit 500 trained on)."""
    from alignment import sft
    from alignment.args import SFTArgs
    from alignment.train_rl import load_questions
    test = data.test_twins(RG)
    assert len(data.load_dataset(RG, "test")) == data.EVALUATE_RG_SIZE
    for limit in (4, 0):
        kept, _, _ = load_questions(RLArgs(dataset=RG, eval_limit=limit, eval_every=0, rg_size=400,
                                           rollout_batch_size=2, group_size=2), lambda line: None)
        assert kept and not {data.twin(r["question"]) for r in kept} & test, limit
        args = SFTArgs(dataset=RG, eval_limit=limit, rg_size=400)
        examples = sft.load_sft_examples(args, None, sft.load_eval_rows(args))
        questions = {data.twin(r["question"]) for r in data.load_dataset(RG, "train", size=400, seed=args.seed)}
        assert questions & test and 0 < len(examples) < 400
        assert not any(t in data.twin(e["prompt"]) for e in examples for t in test & questions), limit


def test_sft_on_a_task_whose_every_question_is_a_test_question_says_so():
    """It said "no training example fits the model's context" (a probe round, 2026-12-02)."""
    from alignment import sft
    from alignment.args import SFTArgs
    args = SFTArgs(dataset=RG.replace("max_digits=2", "max_digits=1"), eval_limit=0, rg_size=50)
    with pytest.raises(UserError, match="every one of the 50 training questions of .* is among the test questions of"):
        sft.load_sft_examples(args, None, [], log=lambda line: None)


def test_a_run_that_holds_out_another_set_keeps_its_own_test_questions_and_counts_them():
    """With --eval_dataset the held-out set is the one evaluated: a small task whose test split holds every problem
    (two one-digit numbers: 100) still trains (the Delethink demo's RL on repeated_addition, CI of 8f2210e), and one
    line counts the training questions `evaluate --dataset` of the training task would score."""
    from alignment import sft
    from alignment.args import SFTArgs
    from alignment.train_rl import load_questions
    small, other = RG.replace("max_digits=2", "max_digits=1"), RG.replace("min_terms=2,max_terms=2", "min_terms=3,max_terms=3")
    for script in ("train_rl", "sft"):
        lines = []
        if script == "train_rl":
            kept, _, _ = load_questions(RLArgs(dataset=small, eval_dataset=other, eval_limit=10, rg_size=50,
                                               rollout_batch_size=2, group_size=2), lines.append)
        else:
            args = SFTArgs(dataset=small, eval_dataset=other, eval_limit=10, rg_size=50)
            kept = sft.load_sft_examples(args, None, sft.load_eval_rows(args), log=lines.append)
        assert len(kept) == 50, script
        assert any(f"[{script}] 50 of the 50 training questions are in the test split of {small}: kept (this run "
                   f"holds out {other})" in line for line in lines), (script, lines)
    with pytest.raises(UserError, match="every one of the 50 training questions of .* is among the test questions"):
        sft.load_sft_examples(SFTArgs(dataset=small, eval_dataset=small, rg_size=50), None, [], log=lambda line: None)


def test_a_header_that_names_a_column_twice_and_an_upper_case_suffix(tmp_path):
    (tmp_path / "dup.csv").write_text("question,answer,answer\nWhat is 1?,1,2\n")
    with pytest.raises(UserError, match="the header names 'answer' more than once"):
        data.load_file(str(tmp_path / "dup.csv"), "all")
    (tmp_path / "trailing.csv").write_text("question,answer,,\nWhat is 1?,1,,\n")  # empty names are no names
    assert data.load_file(str(tmp_path / "trailing.csv"), "all")[0]["answer"] == "1"
    (tmp_path / "Q.JSONL").write_text(json.dumps({"question": "What is 1?", "answer": "1"}) + "\n")
    assert data.is_file(str(tmp_path / "Q.JSONL")) and data.load_file(str(tmp_path / "Q.JSONL"), "all")[0]["answer"] == "1"


def test_a_built_in_sets_files_are_hashed_so_a_resume_on_another_data_folder_is_refused(tmp_path):
    """A resume with another ALIGNMENT_DATA_DIR trained on other GSM8K rows without a word (7,473 became 200)."""
    from alignment.run import _data_hash
    other = tmp_path / "data"
    (other / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        lines = (data.resolve_data_dir() / "gsm8k" / f"{split}.jsonl").read_text().splitlines(keepends=True)
        (other / "gsm8k" / f"{split}.jsonl").write_text("".join(lines[:200]))
    here, there = _data_hash(RLArgs(dataset="gsm8k")), _data_hash(RLArgs(dataset="gsm8k", data_dir=str(other)))
    assert len(here["dataset_sha256"]) == 64 and here["dataset_sha256"] != there["dataset_sha256"]
    assert "accept_changed_data" not in RLArgs(dataset="gsm8k", resume="x").own_data_moot()


def test_a_reward_failing_on_evaluation_answers_is_told_as_the_evaluations(own, tiny_model_dir, tmp_path, capsys):
    """A --reward_fn that needs a column the --eval_dataset lacks scored held-out answers 0 with no word in the eval
    line ("reward 0.000"), its failure told as "step 1"'s, and the run went on when every one failed (a probe round,
    2026-12-02): the line counts them, the kind is the evaluation's, and failing on all stops, as evaluate does."""
    from alignment import expert_iteration, train_rl
    from tests import test_expert_iteration, test_train_rl
    (own / "rl_rewards.py").write_text(PARITY)
    (own / "some_topics.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "topic" or i % 2})
                                                   + "\n" for i, row in enumerate(ROWS)))
    some = dict(dataset=str(own / "rows.jsonl"), eval_dataset=str(own / "some_topics.jsonl"), question_key="problem",
                answer_key="gold", eval_every=1, reward_fn=f"{own / 'rl_rewards.py'}:parity")
    train_rl.main(test_train_rl.tiny_args(tiny_model_dir, tmp_path / "some", n_steps=1, **some))
    evals = [m for m in test_train_rl.read_jsonl(tmp_path / "some" / "metrics.jsonl") if "eval_count" in m]
    out = capsys.readouterr().out
    assert len(evals) == 2 and all(0 < m["eval_reward_failures"] < m["eval_count"] for m in evals), evals
    assert all(f"| reward failures {m['eval_reward_failures']}/{m['eval_count']}" in out for m in evals)
    assert "[train_rl] evaluation at step 0: a --reward_fn call failed (scored 0): TypeError" in out
    assert "step 1: a --reward_fn call failed" not in out  # step 1's own calls all succeeded
    (own / "no_topic.jsonl").write_text("".join(json.dumps({k: v for k, v in row.items() if k != "topic"}) + "\n"
                                                for row in ROWS))
    flags = dict(dataset=str(own / "rows.jsonl"), eval_dataset=str(own / "no_topic.jsonl"), question_key="problem",
                 answer_key="gold", eval_every=1, eval_limit=4, reward_fn=f"{own / 'rl_rewards.py'}:parity")
    stop = "failed on every answer of the evaluation at step 0 \\(4 held-out questions\\), e.g. TypeError.*topic.*start again"
    with pytest.raises(UserError, match=stop):
        train_rl.main(test_train_rl.tiny_args(tiny_model_dir, tmp_path / "rl", n_steps=1, **flags))
    with pytest.raises(UserError, match=stop):
        expert_iteration.main(test_expert_iteration.tiny_args(tiny_model_dir, tmp_path / "ei", n_ei_steps=1, **flags))


def test_sft_train_file_leaves_out_prompts_that_ask_an_evaluation_question(tmp_path):
    """--train_file trained on prompts holding the evaluation set's test questions, with no word (a probe round,
    2026-12-02): they are left out as the other paths leave theirs, counted in one line."""
    from alignment import sft
    from alignment.args import SFTArgs
    rows = [{"question": f"How many apples are in basket number {i}?", "answer": str(i)} for i in range(60)]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    test = [row["question"] for row in data.load_dataset(str(tmp_path / "eval.jsonl"), "test")]
    assert 0 < len(test) < 60
    pairs = [{"prompt": f"User:  {q.upper()}\nAssistant:", "response": " 1"} for q in test[:2]] + \
        [{"prompt": "User: What is 2 + 2?\nAssistant:", "response": " 4"}]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs))
    args = SFTArgs(train_file=str(tmp_path / "train.jsonl"), eval_dataset=str(tmp_path / "eval.jsonl"), eval_limit=1)
    lines = []
    examples = sft.load_sft_examples(args, None, sft.load_eval_rows(args), log=lines.append)
    assert [e["response"] for e in examples] == [" 4"]
    assert any(line.startswith("[sft] 2 of 3 --train_file examples left out") for line in lines), lines
    assert len(sft.load_sft_examples(SFTArgs(train_file=str(tmp_path / "train.jsonl"), eval_limit=0), None, [])) == 3
    short = [{"prompt": "Compute 10+13 please", "response": " 23"}, {"prompt": "What is 0+1?", "response": " 1"}]
    kept = sft.without_asked(short, SFTArgs(train_file="t.jsonl"), [{"question": "0+1"}], log=lines.append)
    assert kept == short[:1]  # a whole question only: "0+1" is not asked by "10+13" (round 8: it was)
    # a question whose edge is punctuation is asked whatever touches that edge (round 9: a letter kept it in)
    q = "What is 67 / 8, to 2 decimal places?"
    glued = [{"prompt": "问题：" + q + "答案：", "response": " 8.38"}, {"prompt": q + "Think step by step.", "response": " 8"},
             {"prompt": "So" + q.lower(), "response": " 8"}, {"prompt": "Whatever: " + q, "response": " 8"}]
    kept = sft.without_asked(glued, SFTArgs(train_file="t.jsonl"), [{"question": q}], log=lines.append)
    assert kept == glued[2:3]  # "Sowhat is ..." is another word; the rest ask the question
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in pairs[:2]))
    with pytest.raises(UserError, match="every example of --train_file .* asks a test question of"):
        sft.load_sft_examples(args, None, sft.load_eval_rows(args), log=lines.append)


def test_expert_iteration_counts_reward_failures_and_stops_on_a_broken_reward(own, tiny_model_dir, tmp_path, capsys):
    """It finished with exit 0 and `fmt nan` when every call failed, and never counted failures (a probe round,
    2026-12-02): the same checks as train_rl's (train_rl.check_reward)."""
    from alignment import expert_iteration
    from tests.test_expert_iteration import read_jsonl, tiny_args
    (own / "ei_rewards.py").write_text(PARITY)
    flags = dict(dataset=str(own / "rows.jsonl"), question_key="problem", answer_key="gold", n_ei_steps=1)
    with pytest.raises(UserError, match="failed on every sample of the run's first step, e.g. TypeError"):
        expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "broken",
                                        reward_fn=f"{own / 'ei_rewards.py'}:always_fails", **flags))
    expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", reward_fn=f"{own / 'ei_rewards.py'}:sometimes",
                                    **flags))
    [step] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "correct_samples" in m]
    out = capsys.readouterr().out
    assert step["reward_failures"] > 0 and f"reward failures {step['reward_failures']:.0f}" in out
    assert "[expert_iteration] step 1: a --reward_fn call failed (scored 0): ValueError: a third of the answers" in out


def test_each_kind_of_reward_failure_is_told_once():
    """Texts that differ only in their values used up the five lines (a probe round, 2026-12-02): a kind is the
    text up to its first colon."""
    reward = UserReward.__new__(UserReward)
    reward.told, reward.errors = set(), ["ValueError: broken 12", "ValueError: broken 13", "TimeoutError: 5 s"]
    assert reward.news() == ["ValueError: broken 12", "TimeoutError: 5 s"]
    reward.errors += ["ValueError: broken 14", "KeyError: 'x'"]
    assert reward.news() == ["KeyError: 'x'"] and reward.news() == []
