"""Your own questions, prompt and reward (issue 75): files of rows with their own columns, a prompt template of
your own, a reward of your own run in a bounded-time worker (hangs, raises and nonsense score 0, counted)."""

import json
import textwrap

import pytest

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
             (EvalArgs, ["--dataset", str(own / "none.jsonl")], "none.jsonl does not exist")]
    (own / "bare.prompt").write_text("Answer this.")
    cases.append((EvalArgs, ["--prompt_file", str(own / "bare.prompt")], "has no {question}"))
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
    assert "reward failures" in capsys.readouterr().out
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
    with pytest.raises(UserError, match="failed on every sample of the first step, e.g. TypeError: the return value "
                                        "is null"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "broken", reward_fn=f"{own / 'rl_rewards.py'}:always_fails",
                                **flags))
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
