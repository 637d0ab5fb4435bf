"""Table-driven tests for alignment/drgrpo_grader.py: labelled answers, format failures, adversarial
inputs (bounded time, no exceptions, from threads and processes) and gold-vs-gold on the test sets."""

import json
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

import pytest

from alignment.drgrpo_grader import (extract_boxed, extract_gsm8k_answer, extract_last_number, grade,
                                     question_only_reward_fn, r1_zero_reward_fn)
from alignment.grading_worker import symbolic_equal

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = Path(os.environ.get("ALIGNMENT_DATA_DIR", REPO / ".." / "shared" / "data"))
if not DATA_DIR.is_absolute():
    DATA_DIR = REPO / DATA_DIR

# (given answer, ground truth, expected)
GSM8K_CASES = [
    ("18", "18", True), ("$18", "18", True), ("\\$18", "18", True), ("18.00", "18", True), ("18.0", "18", True),
    ("18 dollars", "18", True), ("The answer is 18.", "18", True), ("18.", "18", True), ("$18.00", "18", True),
    ("1,000", "1000", True), ("1000", "1,000", True), ("27,\\!000", "27000", True), ("1,234,567", "1234567", True),
    ("50\\%", "50", True), ("50%", "50", True), ("90^\\circ", "90", True), ("90^{\\circ}", "90", True), ("90°", "90", True),
    ("-3", "-3", True), ("0.5", ".5", True), (".5", "0.5", True), ("5 eggs", "5", True), ("x = 5", "5", True),
    ("x=5", "5", True), ("Final answer: 42", "42", True), ("42 \\text{ cents}", "42", True), ("\\text{42}", "42", True),
    ("18 or 20", "18", False), ("20 or 18", "18", False), ("18, 20", "18", False), ("between 18 and 20", "18", False),
    ("180", "18", False), ("1.8", "18", False), ("0.18", "18", False), ("-5", "5", False), ("5", "-5", False),
    ("17", "18", False), ("18.5", "18", False), ("1,001", "1000", False), ("10000", "1000", False), ("", "18", False),
    ("eighteen", "18", False), ("18 dollars and 20 cents", "18", False), ("1800", "18", False), ("-18", "18", False),
]
LATEX_CASES = [
    ("\\frac12", "\\frac{1}{2}", True), ("\\dfrac{3}{4}", "\\frac34", True), ("3/4", "\\frac{3}{4}", True),
    ("0.75", "\\frac{3}{4}", True), ("\\tfrac{3}{4}", "0.75", True), ("\\frac{14}{3}", "\\frac{14}{3}", True),
    ("-\\frac{3}{8}", "-0.375", True), ("\\frac9{19}", "\\frac{9}{19}", True), ("\\frac 59", "5/9", True),
    ("2\\sqrt{3}", "\\sqrt{12}", True), ("\\sqrt{12}", "2\\sqrt3", True), ("\\frac{1}{\\sqrt{3}}", "\\frac{\\sqrt{3}}{3}", True),
    ("10^{3}", "1000", True), ("10^3", "1000", True), ("2^{-3}", "\\frac{1}{8}", True), ("\\sqrt[3]{8}", "2", True),
    ("(1,2)", "(1, 2)", True), ("(2,1)", "(1,2)", False), ("[1,2)", "(1,2)", False), ("(1,2]", "(1,2]", True),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})", True), ("(3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("(-\\infty, 0]", "(-\\infty,0]", True), ("(-\\infty, 0)", "(-\\infty,0]", False),
    ("(-\\infty, 2) \\cup (3, \\infty)", "(-\\infty,2)\\cup(3,\\infty)", True), ("(3, \\infty) \\cup (-\\infty, 2)", "(-\\infty,2)\\cup(3,\\infty)", False),
    ("(1,2,3)", "(1,2)", False), ("1, 2", "(1,2)", False), ("-2, 1", "1,-2", True), ("3, 5, 7", "7,5,3", True),
    ("\\{-2, 1\\pm\\sqrt{5}\\}", "\\{1\\pm\\sqrt{5},-2\\}", True), ("x=5", "x = 5", True), ("5", "x=5", True),
    ("y = 2x+3", "y = 2x + 3", True), ("2x+3=y", "y=2x+3", True), ("y = 3x+2", "y = 2x + 3", False),
    ("2+3i", "3i+2", True), ("6 - 5i", "6-5i", True), ("-2+7i", "-2 + 7i", True), ("2-3i", "2+3i", False),
    ("(x+1)^2", "x^2+2x+1", True), ("2k+2", "2(k+1)", True), ("p-q", "p - q", True), ("q-p", "p-q", False),
    ("x^3+3x-6", "x^3 + 3x - 6", True), ("x^3+3x+6", "x^3+3x-6", False), ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("12\\pi", "12 \\pi", True), ("\\pi", "3.14", False), ("11\\sqrt{2}", "11\\sqrt2", True), ("11\\sqrt{3}", "11\\sqrt2", False),
    ("\\frac{\\sqrt{21}}{5}", "\\frac{\\sqrt{21}}{5}", True), ("\\sqrt{21}/5", "\\frac{\\sqrt{21}}{5}", True),
    ("\\frac{\\sqrt{21}}{50}", "\\frac{\\sqrt{21}}{5}", False), ("137.5", "137 \\frac{1}{2}", True),
    ("1\\frac{4}{5}", "1.8", True), ("\\frac{9}{5}", "1\\frac45", True), ("204_{5}", "204_5", True), ("204_6", "204_5", False),
    ("\\$32,348", "\\$32,\\!348", True), ("32348", "\\$32,\\!348", True), ("11,111,111,100", "11,\\! 111,\\! 111,\\! 100", True),
    ("5.4", "5.4 \\text{ cents}", True), ("15", "15\\mbox{ cm}^2", True), ("864", "864 \\mbox{ inches}^2", True),
    ("\\frac{270}{7}", "\\frac{270}7\\text{ degrees}", True), ("106", "106^\\circ", True), ("107", "106^\\circ", False),
    ("\\begin{pmatrix} -1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}-1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 2 \\\\ -1 \\end{pmatrix}", "\\begin{pmatrix}-1\\\\2\\end{pmatrix}", False),
    ("\\begin{pmatrix} 1/5 \\\\ -18/5 \\end{pmatrix}", "\\begin{pmatrix} \\frac15 \\\\ -\\frac{18}{5} \\end{pmatrix}", True),
    ("\\cot x", "\\cot x", True), ("3R^2", "3R^2", True), ("3r^2", "3R^2", False), ("5r^5", "5r^{5}", True),
    ("\\frac{20000}{\\pi}", "\\frac{20000}{\\pi}", True), ("\\frac{2000}{\\pi}", "\\frac{20000}{\\pi}", False),
    ("-\\sqrt{3}", "\\sqrt{3}", False), ("10^{4}", "1000", False), ("0.0000672", ".0000672", True), ("0.000672", ".0000672", False),
    ("\\frac{11+9a}{20}", "\\frac{11+9a}{20}", True), ("(a+5)(b+2)", "(b+2)(a+5)", True), ("(a+5)(b+3)", "(a+5)(b+2)", False),
]
TEXT_CASES = [
    ("(C)", "\\text{(C)}", True), ("C", "\\text{(C)}", True), ("\\text{(C)}", "(C)", True), ("\\textbf{(C)}", "C", True),
    ("(A)", "(C)", False), ("A", "\\text{(C)}", False), ("(B)", "\\text{(E)}", False), ("\\text{(E)}", "\\text{(E)}", True),
    ("\\text{Evelyn}", "\\text{Evelyn}", True), ("Evelyn", "\\text{Evelyn}", True), ("evelyn", "\\text{Evelyn}", True),
    ("Navin", "\\text{Evelyn}", False), ("\\text{east}", "\\text{east}", True), ("East", "\\text{east}", True),
    ("west", "\\text{east}", False), ("\\text{even}", "\\text{even}", True), ("odd", "\\text{even}", False),
    ("\\text{ellipse}", "\\text{ellipse}", True), ("parabola", "\\text{ellipse}", False),
]


@pytest.fixture(scope="module", autouse=True)
def started_worker():
    # The first symbolic comparison waits for the worker to import sympy (seconds, once per process).
    assert symbolic_equal("2\\sqrt{3}", "\\sqrt{12}", time.monotonic() + 1)


@pytest.mark.parametrize("given,truth,expected", GSM8K_CASES + LATEX_CASES + TEXT_CASES)
def test_grade(given, truth, expected):
    assert grade(given, truth) is expected


@pytest.mark.parametrize("given,truth,expected", [
    ("1234567891", "1234567890", False), ("99999999999", "99999999990", False),  # integers exactly (a probe round,
    ("1000000000000000000000000000001", "1000000000000000000000000000000", False),  # 2026-12-02: all three were
    ("2^{40}+1", "1099511627776", False), ("2^{40}", "1099511627776", True),  # right under an absolute 1e-9)
    ("0", "0.0000000001", False), ("0", "1e-20", False), ("1e-20", "1e-20", True),  # relative, not absolute
    ("0.3333333333333", "\\frac{1}{3}", True), ("\\sqrt{2}", "1.41421356237", True), ("1.5", "\\frac{3}{2}", True),
    ("1234567890.5", "1234567890", False), ("1234567890.0", "1234567890", True),  # an integer gold only by itself
    ("12345678905", "1.2345678901e10", False), ("12345678901", "1.2345678901e10", True),  # (a probe round, 2026-12-02:
    ("100000000000000000001", "1e+20", False), ("100000000000000000000", "1e+20", True),  # the first, third, fifth right)
    ("4.56 \\times 10^{7}", "45600000", True), ("0.07 \\times 100", "7", True),  # decimals as written, not binary
    ("1.2345678901 \\times 10^{10}", "12345678901", True), ("4.5600001 \\times 10^{7}", "45600000", False),
    # an integer gold written as an expression is an integer too (a probe round, 2026-12-02: within 1e-9 before)
    ("1234567890.5", "2 \\cdot 617283945", False), ("1234567890", "2 \\cdot 617283945", True),
    ("1000.0000001", "10^3", False), ("1024.0000001", "2^{10}", False), ("999999999.9999", "10^9", False),
    # e-notation and LaTeX's thousands separator, as the numbers they write (the same round: all wrong before)
    ("1e3", "1000", True), ("4.56e7", "45600000", True), ("1.2345678901e10", "12345678901", True),
    ("1e-3", "0.001", True), ("2.5E2", "250", True), ("1e3", "1001", False), ("1.2345678905e10", "12345678901", False),
    ("1{,}000", "1000", True), ("1{,}234.5", "1234.5", True), ("1{,}001", "1000", False),
])
@pytest.mark.parametrize("fast", [True, False])
def test_integers_compare_exactly_and_other_numbers_within_a_relative_1e_9(given, truth, expected, fast):
    assert grade(given, truth, fast) is expected


def test_case_count():
    assert len(GSM8K_CASES + LATEX_CASES + TEXT_CASES + FORMAT_CASES + QUESTION_ONLY_CASES) >= 150


FORMAT_CASES = [  # (response, ground truth, (format_reward, answer_reward, reward))
    ("reasoning </think> <answer>18</answer>", "18", (1, 1, 1)),
    ("reasoning </think> <answer>\\boxed{18}</answer>", "18", (1, 1, 1)),
    ("reasoning </think> <answer>So it is \\boxed{\\frac{1}{2}}.</answer>", "0.5", (1, 1, 1)),
    ("reasoning </think> <answer>The answer is $18$.</answer>", "18", (1, 1, 1)),
    ("reasoning </think> <answer>17</answer>", "18", (1, 0, 0)),
    ("reasoning </think> <answer>\\boxed{17}</answer>", "18", (1, 0, 0)),
    ("reasoning </think> <answer>\\boxed{18</answer>", "18", (1, 0, 0)),
    ("reasoning </think> <answer>18 or 20</answer>", "18", (1, 0, 0)),
    ("reasoning </think> <answer></answer>", "18", (1, 0, 0)),
    ("reasoning </think> <answer>18</answer> then 20", "18", (1, 1, 1)),
    ("reasoning </think><answer>18</answer>", "18", (0, 0, 0)),
    ("reasoning </think>  <answer>18</answer>", "18", (0, 0, 0)),
    ("reasoning <answer>18</answer>", "18", (0, 0, 0)),
    ("reasoning </think> <answer>18", "18", (0, 0, 0)),
    ("reasoning </answer></think> <answer>18", "18", (0, 0, 0)),
    ("18", "18", (0, 0, 0)),
    ("\\boxed{18}", "18", (0, 0, 0)),
    ("", "18", (0, 0, 0)),
    ("</think> <answer>(C)</answer>", "\\text{(C)}", (1, 1, 1)),
    ("</think> <answer>(A)</answer>", "\\text{(C)}", (1, 0, 0)),
    ("</think> <answer>\\boxed{(1,2)}</answer>", "(1,2)", (1, 1, 1)),
    ("</think> <answer>18</answer>", ["17", "18"], (1, 1, 1)),
    ("</think> <answer>18</answer>", 18, (1, 1, 1)),
    ("</think> <answer></answer>", "", (1, 0, 0)),  # an empty gold matches nothing, not an empty answer
    ("</think> <answer> </answer>", " ", (1, 0, 0)), ("</think> <answer>$</answer>", "$.", (1, 0, 0)),
]


@pytest.mark.parametrize("response,truth,expected", FORMAT_CASES)
def test_r1_zero_reward_fn(response, truth, expected):
    reward = r1_zero_reward_fn(response, truth)
    assert (reward["format_reward"], reward["answer_reward"], reward["reward"]) == expected


QUESTION_ONLY_CASES = [
    ("So the total is \\boxed{18}.", "18", 1.0), ("She earns 9 * 2 = 18 dollars", "18", 1.0),
    ("First 20, then 18", "18", 1.0), ("First 18, then 20", "18", 0.0), ("\\boxed{\\frac{3}{4}} or 7", "0.75", 1.0),
    ("no numbers here", "18", 0.0), ("the result is 1,000", "1000", 1.0),
]


@pytest.mark.parametrize("response,truth,expected", QUESTION_ONLY_CASES)
def test_question_only_reward_fn(response, truth, expected):
    assert question_only_reward_fn(response, truth)["reward"] == expected


def test_extractors():
    assert extract_gsm8k_answer("She makes 9 * 2 = $<<9*2=18>>18.\n#### 18") == "18"
    assert extract_gsm8k_answer("...\n#### 1,000") == "1000"
    assert extract_boxed("a \\boxed{1} b \\boxed{\\frac{1}{2}} c") == "\\frac{1}{2}"
    assert extract_boxed("\\fbox{x^{2}}") == "x^{2}"
    assert extract_boxed("\\boxed{unclosed") is None and extract_boxed("nothing") is None
    assert extract_last_number("9 * 2 = 18, not 1,000.5 eggs") == "1000.5"
    assert extract_last_number("-3 and -4") == "-4" and extract_last_number("none") is None


ADVERSARIAL = [
    "9^9^9^9", "9**9**9**9", "10^{10^{10^{10}}}", "2**1000000", "2^{1000000}", "factorial(100000)", "100000!",
    "(" * 10000, ")" * 10000, "{" * 10000 + "1", "\\frac{" * 5000, "\\sqrt{" * 3000 + "2", "1" * 100000,
    "9" * 5000 + "/7", "(x+1)^{100000}", "x^{10^{10}}", "e^{e^{e^{e^{e^{10}}}}}", "\\boxed{" * 2000,
    "__import__('os').system('echo hacked')", "().__class__.__bases__[0]", "1" + "+1" * 20000, "\\" * 50000,
    "(1,2" * 3000, "\\left(" * 4000, "x" * 100000, "2^{2^{2^{2^{2^{2^{2}}}}}}", "\\sqrt[1000000]{2}^{1000000}",
    "1e100000", "0." + "0" * 50000 + "1", "\\begin{pmatrix}" + "1&" * 10000 + "\\end{pmatrix}",
]


@pytest.mark.parametrize("attack", ADVERSARIAL, ids=[f"attack{i}" for i in range(len(ADVERSARIAL))])
def test_adversarial_input_is_fast_and_wrong(attack):
    for fast in (True, False):
        start = time.monotonic()
        assert grade(attack, "1", fast=fast) is False
        assert r1_zero_reward_fn(f"</think> <answer>{attack}</answer>", "1", fast=fast)["reward"] == 0.0
        assert question_only_reward_fn(attack, "2", fast=fast)["reward"] in (0.0, 1.0)
        assert time.monotonic() - start < 2 * 3  # three calls, each bounded by about one second


def _timed_grade(attack):
    start = time.monotonic()
    result = grade(attack, "1")
    return result, time.monotonic() - start


@pytest.mark.parametrize("pool", ["thread", "process"])
def test_adversarial_input_in_workers(pool):
    attacks = ["9^9^9^9", "10^{10^{10^{10}}}", "(x+1)^{100000}", "2\\sqrt{3}"]
    if pool == "thread":
        executor = ThreadPoolExecutor(2)
    else:
        executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    with executor:
        if pool == "process":  # each worker process starts its own sympy worker once
            list(executor.map(_timed_grade, ["2\\sqrt{3}"]))
        results = list(executor.map(_timed_grade, attacks))
    assert [r for r, _ in results] == [False, False, False, False]
    assert max(t for _, t in results) < 2


def test_hung_symbolic_check_is_killed():
    # A comparison that passes the cheap guards but makes sympy grind: the watchdog must kill it on time.
    import alignment.grading_worker as worker
    start = time.monotonic()
    request = {"given": "(x+y+z+1)^{30}-(x+y+z)^{30}", "truth": "(x+y+z+2)^{29}", "math_verify": False}
    assert worker._ZYGOTE.call(request, time.monotonic() + 0.3) == {"equal": False, "timed_out": True}
    assert time.monotonic() - start < 2
    assert worker.symbolic_equal("10^{3}", "1000", time.monotonic() + 1)  # and it still works afterwards


def _read_jsonl(path):
    if not path.exists():
        pytest.skip(f"{path} not found: set ALIGNMENT_DATA_DIR to the folder holding gsm8k/ and math500/")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_gold_vs_gold_math500():
    rows = _read_jsonl(DATA_DIR / "math500" / "test.jsonl")
    assert len(rows) == 500
    failures = [r["answer"] for r in rows if r1_zero_reward_fn(f"</think> <answer>{r['answer']}</answer>", r["answer"])["reward"] != 1.0]
    failures += [r["answer"] for r in rows if r1_zero_reward_fn(f"</think> <answer>So \\boxed{{{r['answer']}}}.</answer>", r["answer"])["reward"] != 1.0]
    assert failures == []


def test_gold_vs_gold_gsm8k():
    rows = _read_jsonl(DATA_DIR / "gsm8k" / "test.jsonl")
    assert len(rows) == 1319
    golds = [extract_gsm8k_answer(r["answer"]) for r in rows]
    failures = [g for g in golds if r1_zero_reward_fn(f"</think> <answer>{g}</answer>", g)["reward"] != 1.0]
    failures += [g for g in golds if question_only_reward_fn(f"... so the answer is \\boxed{{{g}}}.", g)["reward"] != 1.0]
    assert failures == []


@pytest.mark.parametrize("given,truth,expected", [
    ("\u22125", "-5", True), ("\u22125", "5", False), ("\\boxed{5}", "5", True), ("\\boxed{\\frac{1}{2}}", "0.5", True),
    ("\\boxed{1}+\\boxed{2}", "3", False)])
@pytest.mark.parametrize("fast", [True, False])
def test_a_typeset_minus_and_a_lone_box_given_to_grade(given, truth, expected, fast):
    """Both modes agree (a probe round, 2026-12-02: U+2212 was wrong, and `\\boxed{5}` right only with fast off)."""
    assert grade(given, truth, fast) is expected
