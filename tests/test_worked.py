"""Worked solutions (alignment/worked.py): every step's arithmetic is right, the answer grades 1, the questions
of an evaluation set never reach training, and the odd inputs are refused in one line."""

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

from alignment import data, sft, train_rl, worked
from alignment.args import EvalArgs, RLArgs, SFTArgs, parse
from alignment.drgrpo_grader import r1_zero_reward_fn
from alignment.errors import UserError
from alignment.folders import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
demo = importlib.util.module_from_spec(importlib.util.spec_from_file_location("steps_demo", ROOT / "bench" / "steps_demo.py"))
demo.__spec__.loader.exec_module(demo)  # the demo's tasks, so the tests check the recipe that runs
STEP = re.compile(r"^(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)\.$")
TASKS = ("chain_sum:min_terms=2,max_terms=5,max_digits=2",
         "chain_sum:min_terms=2,max_terms=4,min_digits=3,max_digits=3,allow_negation=true",
         "basic_arithmetic:min_terms=2,max_terms=5,max_digits=2,operators=+-,allow_negation=true,allow_parentheses=false")


def check_steps(question: str, response: str, answer: str):
    """Re-do every sentence of `response` by hand: each `a op b = c.` is right, each chained step starts from
    the previous result, and the last result is the answer."""
    reasoning = response.split("</think>")[0].strip()
    sentences = re.findall(r"[^.]+\.", reasoning)
    assert "".join(sentences).replace(" ", "") == reasoning.replace(" ", "")
    previous = None
    for sentence in sentences:
        sentence = sentence.strip()
        if sentence.startswith("So "):
            previous = None
            continue
        a, op, b, c = STEP.match(sentence).groups()
        a, b, c = int(a), int(b), int(c)
        assert c == {"+": a + b, "-": a - b, "*": a * b, "/": a // b if b and a % b == 0 else None}[op], sentence
        if previous is not None and op in "+-":
            assert a == previous, f"{sentence} does not start from {previous}"
        previous = c
    assert str(previous) == answer, (question, response)


def check_rewrites(question: str, response: str, answer: str):
    """Each `=`-separated expression of a rewrite-style solution has the question's value and one operation
    fewer than the one before, and the last is the answer."""
    expressions = response.split("</think>")[0].strip().rstrip(".").split(" = ")
    assert expressions[0].replace(" ", "") in question.replace(" ", "")
    values = [eval(e.replace("--", "+ ")) for e in expressions]
    assert len(set(values)) == 1 and str(values[-1]) == answer == expressions[-1], (question, response)
    operations = [len(worked.parse_expression(f"Calculate {e}.")) // 2 if " " in e.strip() else 0 for e in expressions]
    assert operations == list(range(operations[0], -1, -1)), response


@pytest.mark.parametrize("task", TASKS)
def test_rewrite_style_steps_are_right(task):
    for row in data.load_reasoning_gym(task, 200, seed=1):
        check_rewrites(row["question"], worked.worked_solution(row, "rewrite"), row["answer"])
    assert worked.worked_solution({"question": "Calculate 7 + 6 * 5 - 9.", "answer": "28"}, "rewrite") == \
        " 7 + 6 * 5 - 9 = 7 + 30 - 9 = 37 - 9 = 28. </think> <answer> 28 </answer>"
    with pytest.raises(AssertionError):  # the checker catches a skipped or wrong rewrite
        check_rewrites("Calculate 8 - 2 + 7.", " 8 - 2 + 7 = 13. </think>", "13")


@pytest.mark.parametrize("task", TASKS)
def test_every_step_is_right_and_the_answer_grades_1(task):
    rows = data.load_reasoning_gym(task, 300, seed=0)
    for row in rows:
        response = worked.worked_solution(row)
        check_steps(row["question"], response, row["answer"])
        assert r1_zero_reward_fn(response, row["answer"])["reward"] == 1.0
    assert any(row["answer"].startswith("-") for row in rows)  # the signs are exercised


@pytest.mark.parametrize("name", sorted(demo.TASKS))
def test_the_demos_solutions_are_right_at_every_difficulty(name):
    """bench/steps_demo.py's tasks as it runs them: SFT's, RL's and the transfer difficulty."""
    for spec in demo.tasks(name):
        for row in data.load_reasoning_gym(spec.removeprefix("rg:"), 200, seed=0):
            response = worked.worked_solution(row)
            check_steps(row["question"], response, row["answer"])
            assert r1_zero_reward_fn(response, row["answer"])["reward"] == 1.0


def test_the_text_of_a_solution():
    row = {"question": "State the final answer to the following arithmetic problem: 57 + 87 - 70 =", "answer": "74"}
    assert worked.worked_solution(row) == " 57 + 87 = 144. 144 - 70 = 74. </think> <answer> 74 </answer>"
    row = {"question": "Calculate 7 + 6 * 5 - 9.", "answer": "28"}  # precedence, then the rest restated
    assert worked.worked_solution(row) == " 6 * 5 = 30. So 7 + 30 - 9. 7 + 30 = 37. 37 - 9 = 28. </think> <answer> 28 </answer>"
    row = {"question": "Calculate -5 - -3.", "answer": "-2"}
    assert worked.worked_solution(row) == " -5 - -3 = -2. </think> <answer> -2 </answer>"
    check_steps("", " 6 * 5 = 30. So 7 + 30 - 9. 7 + 30 = 37. 37 - 9 = 28. </think>", "28")
    with pytest.raises(AssertionError):  # the checker itself catches a wrong step
        check_steps("", " 57 + 87 = 145. 145 - 70 = 75. </think>", "75")


@pytest.mark.parametrize("question, answer, reason", [
    ("Calculate (3 + 4) * 2.", "14", "flat expressions"),
    ("Calculate 7 / 2.", "3.5", "not a whole number"),
    ("Calculate 12.", "12", "two or more numbers"),
    ("What is the capital of France?", "Paris", "not a flat expression"),
    ("Calculate 5 - 33 - 65 - 62 * 51.", "-7905", "not the task's answer"),  # reasoning-gym's own answer for it
])
def test_what_has_no_worked_solution_is_refused_in_one_line(question, answer, reason):
    with pytest.raises(UserError, match=reason):
        worked.worked_solution({"question": question, "answer": answer})


def test_sft_on_a_task_trains_on_worked_solutions_and_never_on_an_evaluation_question(tokenizer):
    # two numbers of up to two digits: ~10,000 problems, of which evaluate's 2,000 test rows hold ~1,800, so the
    # splits overlap (of one digit, the test rows hold all 100 and nothing is left to train on)
    task = "rg:chain_sum:min_terms=2,max_terms=2,max_digits=2"
    args = SFTArgs(dataset=task, rg_size=300, max_examples=0, eval_limit=50)
    eval_rows = sft.load_eval_rows(args)
    examples = sft.load_sft_examples(args, tokenizer, eval_rows)
    template = data.load_prompt("r1_zero")
    asked = {data.format_prompt(template, row["question"]) for row in eval_rows} | {  # (rg questions: no case or spacing)
        data.format_prompt(template, row["question"]) for row in data.load_dataset(task, "test")}
    drawn = [data.format_prompt(template, row["question"]) for row in data.load_dataset(task, "train", size=300)]
    assert len(eval_rows) == 50 and 0 < len(examples) < 300
    assert not asked & {e["prompt"] for e in examples}
    assert all(e["response"].endswith(" </answer>") and " = " in e["response"] for e in examples)
    unheld = sft.load_sft_examples(SFTArgs(dataset=task, rg_size=300, max_examples=0, eval_limit=0), tokenizer)
    assert sorted(e["prompt"] for e in unheld) == sorted(prompt for prompt in drawn if prompt not in asked) == \
        sorted(e["prompt"] for e in examples)  # the first 50 test rows are among the 2,000
    rewrites = sft.load_sft_examples(SFTArgs(dataset=task, rg_size=300, max_examples=5, worked_style="rewrite"), tokenizer)
    assert all(e["response"].count(" = ") == 1 and e["response"].startswith(" ") for e in rewrites)  # 2 numbers: 1 step


@pytest.mark.parametrize("task", sorted(demo.TASKS))
def test_the_recipe_never_trains_on_a_question_it_evaluates_on(task):
    """SFT on the easier settings, RL on a harder one, transfer one step harder: no evaluation question of either
    RL difficulty is an SFT or an RL training question, under any of the three seeds."""
    easy, hard, harder = demo.tasks(task)
    for seed in range(3):
        sft_args = SFTArgs(dataset=easy, eval_dataset=hard, rg_size=2000, seed=seed)
        rl_args = RLArgs(dataset=hard, rg_size=2000, seed=seed, eval_limit=100)
        sft_questions = {row["question"] for row in data.load_dataset(easy, "train", size=2000, seed=seed)}
        rl_train, rl_eval, _ = train_rl.load_questions(rl_args, log=lambda line: None)
        by_evaluate = data.load_dataset(hard, "test", size=100) + data.load_dataset(harder, "test", size=100)  # seed 0
        evaluated = {row["question"] for row in rl_eval + by_evaluate + sft.load_eval_rows(sft_args)}
        assert not evaluated & sft_questions and not evaluated & {row["question"] for row in rl_train}


def test_sft_flags_that_do_not_apply_are_refused():
    with pytest.raises(UserError, match="has no training solutions"):
        sft.load_sft_examples(SFTArgs(dataset="math500"))


def test_sft_then_rl_on_the_task_with_a_tiny_model(tiny_model_dir, tmp_path):
    """The recipe's two training stages, 2 steps each: SFT on worked solutions of the easy setting, then RL from
    that run folder on the harder one."""
    from tests.test_sft import tiny_args as sft_args
    from tests.test_train_rl import tiny_args as rl_args
    easy, hard, _ = demo.tasks("sums")
    result = sft.main(sft_args(tiny_model_dir, tmp_path / "sft", dataset=easy, rg_size=40, eval_dataset=hard))
    assert result["steps"] == 2 and result["last_eval"]["count"] == 2
    rl = train_rl.main(rl_args(str(tmp_path / "sft"), tmp_path / "rl", dataset=hard, eval_every=2, eval_limit=2))
    records = [json.loads(line) for line in open(tmp_path / "rl" / "metrics.jsonl")]
    assert [r["step"] for r in records if "loss" in r] == [1, 2] and rl is not None
    assert json.loads((tmp_path / "rl" / "config.json").read_text())["start_model"] == str(tmp_path / "sft")


@pytest.mark.slow
def test_the_demo_driver_runs_every_stage_and_resumes(tiny_model_dir, tmp_path):
    import subprocess
    import sys
    command = [sys.executable, "bench/steps_demo.py", "--model", tiny_model_dir, "--seeds", "0", "--sft_examples", "16",
               "--rl_steps", "1", "--limit", "2", "--rl_backend", "hf", "--out", str(tmp_path / "demo")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = (tmp_path / "demo" / "steps_demo.md").read_text()
    samples = (tmp_path / "demo" / "samples.md").read_text()
    assert "| 0 |" in table and "after RL" in samples
    assert "- Calculate " in samples and "A conversation" not in samples  # each sample names its question
    again = subprocess.run(command, capture_output=True, text=True, timeout=900)  # every stage kept
    assert again.returncode == 0 and again.stdout.count("done, kept") == 8, again.stdout
    # the same folder named from another working directory (its stages run in ROOT): every stage kept
    elsewhere = subprocess.run([sys.executable, str(ROOT / "bench" / "steps_demo.py"), *command[2:-1], "demo"],
                               capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert elsewhere.returncode == 0 and elsewhere.stdout.count("done, kept") == 8, elsewhere.stdout
    # another recipe in the same folder: refused before any stage runs (it once reused this SFT for its RL)
    other = subprocess.run(command + ["--worked_style", "rewrite"], capture_output=True, text=True, timeout=900)
    assert other.returncode != 0 and "sft-seed0 result made with other flags" in other.stderr, other.stderr
    assert "uv run python" not in other.stdout
    # with --overwrite a stage folder holding a file no run wrote is refused before any stage runs: never deleted
    (tmp_path / "demo" / "rl-seed0" / "notes.txt").write_text("mine")
    redo = subprocess.run(command + ["--worked_style", "rewrite", "--overwrite"], capture_output=True, text=True,
                          timeout=900)
    assert redo.returncode != 0 and "rl-seed0 holds files no run of the stage writes (notes.txt)" in redo.stderr
    assert "uv run python" not in redo.stdout and "Traceback" not in redo.stderr, redo.stderr
    assert (tmp_path / "demo" / "rl-seed0" / "notes.txt").read_text() == "mine"
    (tmp_path / "demo" / "rl-seed0" / "notes.txt").unlink()  # then each stage is redone through its script's rules
    again = subprocess.run(command + ["--worked_style", "rewrite", "--overwrite"], capture_output=True, text=True,
                           timeout=900)
    assert again.returncode == 0 and again.stdout.count("done, kept") == 2, again.stdout[-2000:] + again.stderr[-2000:]
    assert "rl-seed0: uv run python" in again.stdout and "--overwrite" in again.stdout  # the start model's two kept
    assert "rewrite" in json.loads((tmp_path / "demo" / "stages.json").read_text())["sft-seed0"]["command"]


def test_a_demo_folder_named_relatively_or_absolutely_is_the_same_folder(tmp_path):
    """A run with `--out outputs/x` and one with `--out /path/to/outputs/x` once refused each other's results ("made
    with other flags"): records compare with the folder's paths written relative to it."""
    import os
    out = tmp_path / "demo"

    def entry(folder, reads=None):
        return {"command": ["-m", "alignment.evaluate", "--model", str(folder / "sft-seed0"), "--limit", "2"],
                "reads": {"sft-seed0": reads}}
    relative = Path(os.path.relpath(out, demo.ROOT))  # as a user in ROOT types it
    assert demo.portable(entry(out, entry(out)), out) == demo.portable(entry(relative, entry(relative)), out)
    assert demo.portable(entry(out), out)["command"][3] == "<out>/sft-seed0"
    assert demo.portable(entry(tmp_path / "other"), out) != demo.portable(entry(out), out)  # another folder differs
    assert demo.portable(None, out) is None


@pytest.mark.parametrize("task", TASKS + ("products:min_terms=2,max_terms=2,min_digits=3,max_digits=4",))
def test_tool_solutions_run_in_the_sandbox_to_the_gold_answer_and_grade_1(task):
    """The `tool` style (issue 64): its block, cut out as the TIR rollout cuts it, prints in the project's sandbox
    exactly the output the solution quotes, and the solution scores +1 under the TIR reward."""
    from alignment import tir
    from alignment.sandbox import Sandbox
    rows = data.load_reasoning_gym(task, 40, seed=3)
    box = Sandbox(workers=2)
    try:
        for row in rows:
            response = worked.tool_solution(row)
            asked, _, rest = response.partition(tir.CALL)  # what the model writes, up to its call
            quoted = rest.split("```")[0].strip()
            assert tir.observation(box.run(tir.extract_code(asked))) == quoted == row["answer"], (row, response)
            assert tir.tir_reward_fn(response, row["answer"])["reward"] == 1.0
    finally:
        box.close()
    with pytest.raises(UserError, match="not the task's answer"):
        worked.tool_solution({"question": "Calculate 2 + 2.", "answer": "5"})


sys.path.insert(0, str(ROOT / "bench"))  # tir_demo imports its sibling steps_demo (the stage runner)
tir_demo = importlib.import_module("tir_demo")
sys.path.remove(str(ROOT / "bench"))


def check_places(response: str, answer: str):
    """A `places` solution of `a * b`: the split names b's non-zero place values, each partial product is right,
    the running sums add them in order, and the last is the answer."""
    reasoning = response.split("</think>")[0].strip()
    sentences = [s.strip() for s in re.findall(r"[^.]+\.", reasoning)]
    first = re.fullmatch(r"(\d+) \* (\d+) = (.+)\.", sentences[0])
    a, b = int(first.group(1)), int(first.group(2))
    if " * " not in first.group(3):  # one non-zero digit: one sentence
        assert len(sentences) == 1 and int(first.group(3)) == a * b and sum(d != "0" for d in str(b)) <= 1, response
        assert str(a * b) == answer
        return
    parts = [int(p.split(" * ")[1]) for p in first.group(3).split(" + ")]
    assert parts == [int(d) * 10 ** i for i, d in reversed(list(enumerate(reversed(str(b))))) if d != "0"], response
    products = [STEP.match(s).groups() for s in sentences[1:1 + len(parts)]]
    assert [(int(x), int(p), int(c)) for x, _, p, c in products] == [(a, p, a * p) for p in parts], response
    total = a * parts[0]
    for sentence, p in zip(sentences[1 + len(parts):], parts[1:], strict=True):  # the partials added in order
        assert sentence == f"{total} + {a * p} = {total + a * p}.", response
        total += a * p
    assert str(total) == answer == str(a * b)


@pytest.mark.parametrize("spec", [tir_demo.SFT_TASK, tir_demo.RL_TASK, tir_demo.HARDER_TASK])
def test_the_tir_demos_solutions_are_right_in_both_styles(spec):
    """bench/tir_demo.py's settings: every places step right and the answer graded 1 under r1_zero; every tool
    solution graded +1 under the TIR reward (its block run in the sandbox: the test above)."""
    from alignment import tir
    for row in data.load_reasoning_gym(spec.removeprefix("rg:"), 200, seed=0):
        response = worked.worked_solution(row, "places")
        check_places(response, row["answer"])
        assert r1_zero_reward_fn(response, row["answer"])["reward"] == 1.0
        assert tir.tir_reward_fn(worked.tool_solution(row), row["answer"])["reward"] == 1.0
    assert worked.worked_solution({"question": "Solve the following multiplication: 141 * 305. Give only the result "
                                   "as your final answer.", "answer": "43005"}, "places") == \
        " 141 * 305 = 141 * 300 + 141 * 5. 141 * 300 = 42300. 141 * 5 = 705. 42300 + 705 = 43005. </think> <answer> 43005 </answer>"
    with pytest.raises(AssertionError):  # the checker catches a wrong partial product
        check_places(" 15 * 43 = 15 * 40 + 15 * 3. 15 * 40 = 600. 15 * 3 = 35. 600 + 35 = 635. </think>", "635")


def test_the_tir_demo_never_evaluates_on_a_question_it_trains_on():
    """SFT's products have 1-2 digits, RL's and the evaluations' 3 and 4: no question is shared, by construction
    and in fact, under any of the three seeds; RL's own held-out split is never trained on."""
    for seed in range(3):
        sft_questions = {row["question"] for row in data.load_dataset(tir_demo.SFT_TASK, "train", size=2000, seed=seed)}
        rl_train, rl_eval, _ = train_rl.load_questions(RLArgs(dataset=tir_demo.RL_TASK, rg_size=2000, seed=seed,
                                                              eval_limit=100), log=lambda line: None)
        by_evaluate = data.load_dataset(tir_demo.RL_TASK, "test", size=100) + \
            data.load_dataset(tir_demo.HARDER_TASK, "test", size=100)
        evaluated = {row["question"] for row in rl_eval + by_evaluate}
        assert not evaluated & sft_questions and not evaluated & {row["question"] for row in rl_train}


def test_sft_in_the_tool_style_trains_under_the_tir_prompt_and_evaluates_with_the_sandbox(tiny_model_dir, tmp_path):
    from tests.test_sft import tiny_args as sft_args
    args = sft_args(tiny_model_dir, tmp_path / "sft", dataset=tir_demo.SFT_TASK, rg_size=40, worked_style="tool",
                    eval_dataset=tir_demo.RL_TASK)
    examples = sft.load_sft_examples(args)
    assert all(e["prompt"].startswith("A conversation") and "put your final answer within \\boxed{}" in e["prompt"]
               and "```python\nprint(" in e["response"] for e in examples)
    result = sft.main(args)
    assert result["steps"] == 2 and result["last_eval"]["count"] == 2 and "mean_used_code" in result["last_eval"]
    places = sft.load_sft_examples(SFTArgs(dataset=tir_demo.SFT_TASK, rg_size=40, worked_style="places"))
    assert all("<think>" in e["prompt"] and e["response"].endswith(" </answer>") for e in places)


@pytest.mark.slow
def test_the_tir_demo_driver_runs_both_arms(tiny_model_dir, tmp_path):
    """A 1-step smoke run of bench/tir_demo.py with the tiny model: every stage of both arms, the table and the
    samples written; run again, every stage kept."""
    import subprocess
    command = [sys.executable, "bench/tir_demo.py", "--model", tiny_model_dir, "--seeds", "0", "--sft_examples", "16",
               "--rl_steps", "1", "--limit", "2", "--rl_backend", "hf", "--max_tokens", "24", "--out", str(tmp_path / "demo")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = (tmp_path / "demo" / "tir_demo.md").read_text()
    assert "| 0 | text |" in table and "| 0 | tool |" in table and "Tool after RL minus text" in table
    assert "### seed 0, tool, after RL" in (tmp_path / "demo" / "samples.md").read_text()
    rl = json.loads((tmp_path / "demo" / "stages.json").read_text())["rl-tool-seed0"]["command"]
    assert rl[rl.index("--rollout_mode") + 1] == "tir" and "sandbox_wait_s" in (tmp_path / "demo" / "rl-tool-seed0" / "metrics.jsonl").read_text()
    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stdout.count("done, kept") == 16 and "[tir_demo]" in again.stdout, again.stdout


COUNTED_STEP = re.compile(r"#(\d+) (-?\d+) [-+] (-?\d+) = (-?\d+)\.")


def state_in(text: str):
    """(position of the next term, running total) as `text` shows it: its last complete counted step, or a later
    step begun far enough to show its position and left operand; None when neither is there."""
    state = None
    for match in COUNTED_STEP.finditer(text):
        state = (int(match.group(1)) + 1, int(match.group(4)))
    begun = list(re.finditer(r"#(\d+) (-?\d+) [-+]", text))
    if begun and (not state or begun[-1].start() > text.rfind(".")):
        state = (int(begun[-1].group(1)), int(begun[-1].group(2)))
    return state


@pytest.mark.parametrize("task", ["basic_arithmetic:min_terms=6,max_terms=24,max_digits=1,operators=+,allow_negation=false,"
                                  "allow_parentheses=false", "chain_sum:min_terms=6,max_terms=24,max_digits=1",
                                  "repeated_addition:min_times=5,max_times=23"])
def test_a_counted_steps_state_is_inside_a_short_carryover_at_every_cut(task, tokenizer):
    """Issue 63: wherever a Delethink chunk ends, the last 24 tokens (the carryover, besides the question that every
    chunk sees) show the position of the next term and the running total, for every row as generated; every step
    is right and the answer grades 1. With 8 tokens some cut loses it (the check can fail)."""
    short_loses = False
    for row in data.load_reasoning_gym(task, 100, seed=0):
        response = worked.worked_solution(row, "counted")
        assert r1_zero_reward_fn(response, row["answer"])["reward"] == 1.0
        steps = response.split("</think>")[0]
        check_steps(row["question"], re.sub(r"#\d+ ", "", steps) + " </think>", row["answer"])
        repeated = worked.REPEATED.search(row["question"])
        if repeated:  # a start and one step added `times` times, counted from #1: the question's numbers, in order
            start, step, times = map(int, repeated.groups())
            assert re.findall(r"#(\d+) (\d+) \+ (\d+) =", steps) == [(str(k), str(start + (k - 1) * step), str(step))
                                                                  for k in range(1, times + 1)]
        else:  # the position of the term each step adds, from #2
            assert [int(k) for k in re.findall(r"#(\d+)", steps)] == list(range(2, len(worked.parse_expression(row["question"])) // 2 + 2))
        ids = tokenizer(steps, add_special_tokens=False).input_ids
        for cut in range(1, len(ids) + 1):
            truth = state_in(tokenizer.decode(ids[:cut]))
            if truth is None:  # before the first step is written: the question holds the state
                continue
            assert state_in(tokenizer.decode(ids[max(0, cut - 24):cut])) == truth, (row, cut)
            short_loses |= state_in(tokenizer.decode(ids[max(0, cut - 8):cut])) != truth
    assert short_loses


def test_add_untils_state_is_its_last_total_inside_a_short_carryover_at_every_cut(tokenizer):
    """Issue 63's next recipe (rg:add_until): each step compares its total with the question's bound, the last
    step passes it and the answer grades 1; wherever a chunk ends, the last 28 tokens (the carryover at B = 140)
    show the total the next step starts from. With 8 tokens some cut loses it (the check can fail)."""
    short_loses = False
    for row in data.load_reasoning_gym("add_until:min_times=1,max_times=29", 100, seed=0):
        response = worked.worked_solution(row, "counted")
        assert r1_zero_reward_fn(response, row["answer"])["reward"] == 1.0
        start, step, bound = map(int, worked.UNTIL.search(row["question"]).groups())
        steps = response.split("</think>")[0]
        written = [tuple(map(int, s)) for s in re.findall(r"(\d+) \+ (\d+) = (\d+) [<>] (\d+)\.", steps)]
        totals = [start + k * step for k in range(len(written) + 1)]
        assert written == [(a, step, b, bound) for a, b in zip(totals, totals[1:])]
        assert steps.count(">") == 1 and steps.rstrip().endswith(f"> {bound}.") and totals[-2] < bound < totals[-1]

        def total_in(text):  # the left operand of a step begun after the last full stop, else the last step's total
            begun, done = re.findall(r"(\d+) \+", text[text.rfind(".") + 1:]), re.findall(r"= (\d+) [<>] \d+\.", text)
            return int(begun[-1]) if begun else int(done[-1]) if done else None
        ids = tokenizer(steps, add_special_tokens=False).input_ids
        for cut in range(1, len(ids) + 1):
            truth = total_in(tokenizer.decode(ids[:cut]))
            if truth is None:
                continue
            assert total_in(tokenizer.decode(ids[max(0, cut - 28):cut])) == truth, (row, cut)
            short_loses |= total_in(tokenizer.decode(ids[max(0, cut - 8):cut])) != truth
    assert short_loses


sys.path.insert(0, str(ROOT / "bench"))  # delethink_demo imports its siblings (the stage runner, the readers)
delethink_demo = importlib.import_module("delethink_demo")
sys.path.remove(str(ROOT / "bench"))


@pytest.mark.parametrize("task", ["sums", "repeated", "until"])
@pytest.mark.parametrize("budget", [120, 20])
def test_the_delethink_demos_arms_get_the_same_thinking_budget(budget, task):
    """Issue 63: Delethink's 4 chunks hold exactly B thinking tokens, as LongCoT's limit; 9 and 19 chunks 2B and
    4B, the budgets LongCoT gets at 15 and 30 terms."""
    tests = delethink_demo.evaluations(budget, task)
    for name, flags in tests["delethink"].items():
        scale = int(name.split("x")[1])
        assert parse(EvalArgs, flags).delethink_budget().startswith(f"up to {scale * budget} thinking tokens")
        assert parse(EvalArgs, tests["longcot"][name]).max_tokens == scale * budget
    rl = delethink_demo.rl_command("delethink", 0, Path("r"), Path("s"), 20, 100, "hf", budget, task)
    assert parse(RLArgs, rl[2:]).delethink_budget() == parse(EvalArgs, tests["delethink"]["8x1"]).delethink_budget()


@pytest.mark.parametrize("task", ["sums", "repeated", "until"])
def test_the_delethink_demos_default_budget_holds_every_solution_it_asks_for(task, tokenizer):
    """The trained budget B holds each RL question's worked solution, 2B and 4B each 15- and 30-term one (SmolLM2's
    tokenizer: the real model's), so a wrong answer at a length is the model's, not the budget's."""
    budget, (_, rl_task, tests) = delethink_demo.BUDGET[task], delethink_demo.TASKS[task]
    for spec, scale in [(rl_task, 1)] + [(tests[n], k) for n, k in delethink_demo.SCALE.items()]:
        rows = data.load_dataset(spec, "test", size=30)
        longest = max(len(tokenizer(worked.worked_solution(r, "counted").split("</think>")[0]).input_ids) for r in rows)
        assert longest <= scale * budget, (spec, longest)


@pytest.mark.parametrize("task", ["sums", "repeated", "until"])
def test_the_delethink_demo_never_evaluates_on_a_question_it_trains_on(task):
    """SFT's chains have 2-6 terms, RL's 8 and the longer evaluations 15 and 30: no shared question; the 8-term
    evaluation is the test split (sums) or the held-out half of the (start, step) pairs (repeated, until), which RL
    under seeds 0-2 never draws (and evaluates on)."""
    sft_task, rl_task, tests = delethink_demo.TASKS[task]
    eval_flags = delethink_demo.rl_eval_flags(task)
    assert eval_flags == ([] if task == "sums" else ["--eval_dataset", tests[delethink_demo.RL_TERMS]])
    for seed in range(3):
        sft_questions = {row["question"] for row in data.load_dataset(sft_task, "train", size=2000, seed=seed)}
        rl_train, rl_eval, _ = train_rl.load_questions(RLArgs(dataset=rl_task, rg_size=2000, seed=seed, eval_limit=100,
                                                              eval_dataset=(eval_flags or [None, None])[1]),
                                                       log=lambda line: None)
        by_evaluate = [row for spec in tests.values() for row in data.load_dataset(spec, "test", size=100)]
        evaluated = {row["question"] for row in rl_eval + by_evaluate}
        assert len(evaluated) >= 300 and not evaluated & sft_questions
        assert not evaluated & {row["question"] for row in rl_train}


def test_the_delethink_demo_finds_the_first_step_that_goes_wrong_and_what_differs():
    """Issue 63's reading of the 4x evaluations: each answer's counted steps against its question's worked
    solution; the first that differs, and whether its counter, carried total, term or sum is what differs."""
    question = "Calculate 8 + 2 + 7 + 9 + 2 + 0."
    right = " #2 8 + 2 = 10. #3 10 + 7 = 17. #4 17 + 9 = 26. #5 26 + 2 = 28. #6 28 + 0 = 28."
    assert worked.worked_solution({"question": question, "answer": "28"}, "counted").startswith(right)
    check = delethink_demo.first_wrong_step
    assert check(question, right + " </think> <answer> 28 </answer>") == (None, "all steps right")
    assert check(question, right.replace("#5 26 + 2 = 28. #6 28", "#5 26 + 9 = 35. #6 35")) == (5, "wrong term")
    assert check(question, right.replace("#4 17 + 9 = 26.", "#4 17 + 9 = 25.")) == (4, "wrong sum")
    assert check(question, right.replace("#3 10", "#3 11")) == (3, "carried total")
    assert check(question, right.replace("#6", "#7")) == (6, "counter")
    assert check(question, right[:40]) == (None, "stopped early")
    assert check(question, right + " #7 28 + 2 = 30.") == (7, "past the last term")
    repeated = "Start at 37 and add 7 to it 3 times. What is the result?"  # counted from #1
    assert check(repeated, " #1 37 + 7 = 44. #2 44 + 7 = 51. #3 51 + 7 = 58.") == (None, "all steps right")
    assert check(repeated, " #1 37 + 7 = 44. #2 44 + 5 = 49.") == (2, "wrong term")
    until = "Start at 137 and add 7 until the result is more than 150. What is the result?"  # compared, counted from 1
    assert check(until, " 137 + 7 = 144 < 150. 144 + 7 = 151 > 150.") == (None, "all steps right")
    assert check(until, " 137 + 7 = 144 > 150.") == (1, "wrong comparison")
    assert check(until, " 137 + 7 = 144 < 150.") == (None, "stopped early")
    assert check(until, " 137 + 7 = 144 < 150. 144 + 7 = 151 < 150. 151 + 7 = 158 > 150.") == (2, "wrong comparison")
    records = [{"prompt": f"User: {question}\nAssistant: <think>", "response": r} for r in
               (right, right.replace("#5 26 + 2", "#5 26 + 9"))]
    kinds, bands = delethink_demo.step_errors(records)
    assert kinds == {"all steps right": 1, "wrong term": 1}
    assert bands[(1, 4)] == [0, 6] and bands[(5, 6)] == [1, 3] and bands[(7, 8)] == [0, 0]


@pytest.mark.slow
def test_the_delethink_demo_driver_runs_both_arms(tiny_model_dir, tmp_path):
    """A 2-step smoke run of bench/delethink_demo.py with the tiny model (B = 20: chunks of 8 after 4 carried):
    every stage of both arms, the table, samples and plot written; run again, every stage kept."""
    import subprocess
    command = [sys.executable, "bench/delethink_demo.py", "--model", tiny_model_dir, "--seeds", "0", "--sft_examples",
               "16", "--rl_steps", "2", "--limit", "2", "--rl_backend", "hf", "--budget", "20", "--out",
               str(tmp_path / "demo")]
    first = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    table = (tmp_path / "demo" / "delethink_demo.md").read_text()
    assert "| 0 | delethink | RL |" in table and "| 0 | longcot | SFT |" in table and "attention pairs" in table
    assert "Where the chains go wrong" in table and "| 0 | delethink | 30 terms, 80 tok |" in table
    assert "‖" in (tmp_path / "demo" / "samples.md").read_text()  # chunk boundaries marked
    rl = json.loads((tmp_path / "demo" / "stages.json").read_text())["rl-delethink-seed0"]["command"]
    assert rl[rl.index("--delethink_max_turns") + 1] == "4" and rl[rl.index("--delethink_chunk_size") + 1] == "8"
    steps = [m for m in read_jsonl(tmp_path / "demo" / "rl-delethink-seed0" / "metrics.jsonl") if "loss" in m]
    assert len(steps) == 2 and all(m["context_tokens"] > 0 for m in steps)
    again = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0 and again.stdout.count("done, kept") == 19 and "[delethink_demo]" in again.stdout, \
        again.stdout
