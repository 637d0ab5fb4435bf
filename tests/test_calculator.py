"""GSM8K's calculator annotations as Python calls (alignment/calculator.py): real solutions converted, run in the
sandbox to their annotated values and graded right; the loss mask 0 exactly on the tool's output, equal to what
a TIR rollout of the same text holds; annotations that are not Python dropped with their reason; SFT in the tool
style trains and evaluates in tir mode; no GSM8K test question in the SFT data of either style."""

import json
import math

import pytest

from alignment import calculator, data, sft, tir
from alignment.args import SFTArgs, parse
from alignment.tokens import tokenize_prompt_and_output, tokenize_prompt_and_segments
from tests.test_sft import tiny_args
from tests.test_tir import run as tir_run


def sample(data_dir, every: int = 150) -> list[dict]:
    """Every `every`-th train row, and the first without an annotation."""
    rows = data.load_gsm8k("train", str(data_dir))
    plain = next(row for row in rows if "<<" not in row["solution"])
    return rows[::every] + [plain]


def test_the_first_solution_becomes_calls_before_its_lines():
    row = {"question": "q", "answer": "72", "solution": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold "
           "48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72"}
    assert calculator.tool_segments(row) == [
        (" ```python\nprint(48/2)\n```\n```output", True), ("\n24.0\n```\n", False),
        ("Natalia sold 48/2 = 24 clips in May.\n```python\nprint(48+24)\n```\n```output", True), ("\n72\n```\n", False),
        ("Natalia sold 48+24 = 72 clips altogether in April and May.\nThe answer is \\boxed{72}.", True)]
    plain = {"question": "q", "answer": "5", "solution": "She has 5 apples.\n#### 5"}
    assert calculator.tool_segments(plain) == [(" She has 5 apples.\nThe answer is \\boxed{5}.", True)]


def test_real_solutions_run_in_the_sandbox_to_their_annotated_values_and_grade_right(data_dir):
    rows = sample(data_dir)
    result = calculator.check(rows, workers=2)
    assert result["kept"] == len(rows) and not any(result["dropped"].values())
    assert result["blocks"] == sum(row["solution"].count("<<") for row in rows) > 2 * len(rows)
    assert result["mismatches"] == []
    for row in rows:
        response = "".join(text for text, _ in calculator.tool_segments(row))
        assert tir.tir_reward_fn(response, row["answer"])["reward"] == 1.0
        assert response.endswith(f"The answer is \\boxed{{{row['answer']}}}.")


def test_the_check_catches_a_converter_that_disagrees_with_the_sandbox(monkeypatch):
    """A test that cannot fail is a defect: an offline rule that printed ints for whole floats would be caught."""
    row = {"question": "q", "answer": "24", "solution": "Half is 48/2 = <<48/2=24>>24.\n#### 24"}
    monkeypatch.setattr(calculator, "printed", lambda expression: "24")
    result = calculator.check([row], workers=1)
    assert [(code, got, ours) for _, code, got, ours, _ in result["mismatches"]] == [("print(48/2)", "24.0", "24")]


def test_the_loss_mask_is_0_exactly_on_the_tools_output_as_in_a_tir_rollout(tokenizer, data_dir):
    row = data.load_gsm8k("train", str(data_dir))[2]  # Betty's wallet: 3 calls
    segments = calculator.tool_segments(row)
    model = [text for text, trained in segments if trained]
    ours = tokenize_prompt_and_segments(["Question:"], [segments[:-1] + [(segments[-1][0] + tokenizer.eos_token, True)]],
                                        tokenizer)
    prompt = tokenizer("Question:", add_special_tokens=False).input_ids
    ids = ours["labels"][0, len(prompt) - 1:].tolist()  # the response's ids (labels are the ids shifted by one)
    mask = ours["response_mask"][0, len(prompt) - 1:].tolist()
    # A scripted policy writes the model's segments, one per round; the rollout runs the real sandbox.
    rows, _ = tir_run(tokenizer, [[model]], prompts=[prompt], max_tokens=400, max_tool_calls=calculator.MAX_TOOL_CALLS)
    assert rows[0].stats["tool_calls"] == 3 and rows[0].stats["exec_errors"] == 0
    assert rows[0].response_ids == ids and rows[0].loss_mask == mask
    assert tokenizer.decode([i for i, m in zip(ids, mask) if not m]) == "".join(t for t, trained in segments
                                                                                 if not trained)
    assert 0 < mask.count(0) < mask.count(1)


def test_one_trained_segment_tokenizes_as_tokenize_prompt_and_output(tokenizer):
    prompts, outputs = ["Compute 1+1.", "Hi"], [" 2", " there, friend"]
    whole = tokenize_prompt_and_output(prompts, outputs, tokenizer)
    split = tokenize_prompt_and_segments(prompts, [[(" 2", True)], [(" there,", True), (" friend", False)]], tokenizer)
    assert whole["input_ids"].tolist() == split["input_ids"].tolist()
    # "Hi" | " there," (2 tokens, trained) | " friend" (1 token, not), then padding
    assert split["response_mask"][1].tolist() == [1, 1, 0, 0, 0, 0, 0]
    assert whole["response_mask"][1].tolist() == [1, 1, 1, 0, 0, 0, 0]


@pytest.mark.parametrize("solution, answer, reason", [
    ("It is 3 x 4 = <<3 x 4=12>>12.\n#### 12", "12", "not_python_arithmetic"),  # x for times
    ("It is 2^3 = <<2^3=8>>8.\n#### 8", "8", "not_python_arithmetic"),  # ^ is XOR in Python
    ("It is <<half of 8=4>>4.\n#### 4", "4", "not_python_arithmetic"),
    ("It is 48/2 = <<48/2>>24.\n#### 24", "24", "not_python_arithmetic"),  # no result
    ("It is <<2**1000=1>>1.\n#### 1", "1", "not_python_arithmetic"),  # a power too large to work out here
    ("It is <<5/0=0>>0.\n#### 0", "0", "fails_to_run"),
    ("It is 2*3 = <<2*3=7>>7.\n#### 7", "7", "other_value"),
    ("It is 10/3 = <<10/3=3.33>>3.33.\n#### 3.33", "3.33", "other_value"),  # rounded: 3.3333333333333335 is not 3.33
    ("It is 6 = <<2*3=6>>6.\n#### 6", "6}", "answer_not_graded"),
    # issue 91: a nested annotation trained on the outer one's remains (`<<3+=7>>`), a large off-by-one passed 1e-6
    ("It is <<3+<<4=4>>=7>>7.\n#### 7", "7", "unbalanced"),
    ("It is <<3+4=7 and 7.\n#### 7", "7", "unbalanced"),
    ("It is <<1000001*1=1000000>>1000000.\n#### 1000000", "1000000", "other_value"),
])
def test_a_solution_that_cannot_be_run_to_its_annotation_is_dropped_with_its_reason(solution, answer, reason):
    good = {"question": "fine", "answer": "6", "solution": "It is 2*3 = <<2*3=6>>6.\n#### 6"}
    bad = {"question": "bad", "answer": answer, "solution": solution}
    kept, dropped = calculator.convert([good, bad])
    assert [row for row, _ in kept] == [good]
    assert {r: [row["question"] for row, _ in items] for r, items in dropped.items() if items} == {reason: ["bad"]}
    said = []
    assert [e["prompt"] for e in sft.gsm8k_tool_examples([good, bad], "{question}", said.append)] == ["fine"]
    assert said == [f"[sft] GSM8K in the tool style: 1 of 2 solutions (dropped: 1 {reason}; see `uv run -m "
                    f"alignment.calculator --check`)"]


def test_the_values_agree_as_numbers():
    assert calculator.printed("48/2") == "24.0" and calculator.agrees("24.0", "24")
    assert calculator.printed("0.1*3") == "0.30000000000000004" and calculator.agrees("0.30000000000000004", "0.3")
    assert calculator.printed("-(3-5)**2 // 3 % 7") == str(-(3 - 5) ** 2 // 3 % 7)
    assert not calculator.agrees("24.0", "24.1") and not calculator.agrees("24", "$24")
    # whole numbers exactly (issue 91), also past a float's 2**53; a float's rounding near a whole number still agrees
    assert not calculator.agrees("1000001", "1000000") and not calculator.agrees("1000001.0", "1000000")
    assert calculator.agrees("12345678901234567", "12345678901234567")
    assert not calculator.agrees("12345678901234567", "12345678901234568")
    assert calculator.printed("0.1*3*10") == "3.0000000000000004" and calculator.agrees("3.0000000000000004", "3")


def test_gsm8k_takes_the_text_and_the_tool_style_and_refuses_the_others(capsys):
    assert parse(SFTArgs, ["--worked_style", "tool"]).worked_style == "tool"
    assert sft.prompt_name(parse(SFTArgs, ["--worked_style", "tool"])) == "tir"
    assert sft.prompt_name(parse(SFTArgs, [])) == "r1_zero"
    with pytest.raises(SystemExit):
        parse(SFTArgs, ["--worked_style", "places"])
    assert "(its styles: chain, the text, or tool)" in capsys.readouterr().err


@pytest.mark.parametrize("style", ["chain", "tool"])
def test_no_gsm8k_test_question_is_in_the_sft_data(style, tokenizer, data_dir):
    args = SFTArgs(data_dir=str(data_dir), max_examples=0, max_response_tokens=0, worked_style=style)
    examples = sft.load_sft_examples(args, tokenizer, log=lambda line: None)
    template = data.load_prompt(sft.prompt_name(args))

    def normal(text):
        return " ".join(text.split())
    tested = {normal(data.format_prompt(template, row["question"])) for row in data.load_gsm8k("test", str(data_dir))}
    trained = {normal(e["prompt"]) for e in examples}
    assert len(examples) == 7473 and len(trained) > 7400 and len(tested) > 1300
    assert not trained & tested
    spaced = data.load_gsm8k("test", str(data_dir))[0]["question"].replace(" ", " \n ")  # the same, spaced otherwise
    assert normal(data.format_prompt(template, spaced)) in tested


def test_sft_in_the_tool_style_trains_without_the_tools_output_and_evaluates_in_tir_mode(tiny_model_dir, tokenizer,
                                                                                        data_dir, tmp_path, monkeypatch):
    args = tiny_args(tiny_model_dir, tmp_path / "sft", worked_style="tool", data_dir=str(data_dir), eval_max_tokens=8)
    examples = sft.load_sft_examples(args, tokenizer, log=lambda line: None)
    assert len(examples) == 8 and all(e["prompt"].startswith("A conversation") and "```output" in e["response"]
                                      for e in examples)
    assert all(n <= 100 for n in sft.response_lengths(examples, tokenizer))  # --max_response_tokens' default
    trained = [len(tokenizer(text, add_special_tokens=False).input_ids) for e in examples
               for text, train in e["segments"] if train]
    every = sum(sft.response_lengths(examples, tokenizer))
    calls = []
    real = sft.evaluate
    monkeypatch.setattr(sft, "evaluate", lambda *a, **k: calls.append((a[3], k)) or real(*a, **k))
    result = sft.main(args)
    assert result["steps"] == 2 and math.isfinite(result["last_loss"]) and "mean_used_code" in result["last_eval"]
    assert [(prompt, k["rollout_mode"], k["mode_args"].max_tool_calls) for prompt, k in calls] == \
        [("tir", "tir", calculator.MAX_TOOL_CALLS)] * 2
    lines = [json.loads(line) for line in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    counted = sum(r["response_tokens"] for r in lines if "loss" in r)
    assert counted == sum(trained) + len(examples) < every  # the model's tokens and EOS; no output token


@pytest.mark.slow
def test_every_gsm8k_train_solution_is_kept_and_each_block_runs_in_the_sandbox_to_its_annotation(data_dir):
    """The numbers docs/algorithms.md quotes: every solution converted, and a fixed thousand of the 23,716 blocks
    (every 24th) run in the sandbox. All of them, `uv run -m alignment.calculator --check`, took 357 s of the suite
    (7 min on 2 cores); docs/algorithms.md has that run, bench-style, outside CI (issue 92)."""
    result = calculator.check(data.load_gsm8k("train", str(data_dir)), sample=1000)
    assert (result["rows"], result["kept"], result["blocks"], result["ran"]) == (7473, 7473, 23716, 989)
    assert {reason: len(items) for reason, items in result["dropped"].items()} == dict.fromkeys(calculator.REASONS, 0)
    assert result["mismatches"] == [] and result["max_calls"] == calculator.MAX_TOOL_CALLS


def test_no_gsm8k_test_question_is_in_the_rl_data(data_dir):
    """train_rl --dataset gsm8k (the card's RL, bench/gsm8k_card.py) trains on the train split only: none of the
    1,319 test questions, compared after normalising whitespace, is among its training questions."""
    from alignment.args import RLArgs
    from alignment.train_rl import load_questions

    def normal(text):
        return " ".join(text.split())
    train_rows, _, _ = load_questions(RLArgs(dataset="gsm8k", data_dir=str(data_dir), eval_limit=0), log=lambda l: None)
    tested = {normal(row["question"]) for row in data.load_gsm8k("test", str(data_dir))}
    assert len(train_rows) == 7473 and len(tested) > 1300 and not {normal(r["question"]) for r in train_rows} & tested
