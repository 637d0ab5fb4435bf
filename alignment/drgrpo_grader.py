"""Rewards for math RL: strict r1_zero format plus a high-recall, bounded-time answer check.

Pure string functions (no torch). `grade` first normalises both answers (LaTeX spacing, `\\dfrac`,
`$`, thousands separators, units, degree and percent signs) and compares them as strings, numbers,
multiple-choice letters, words, or tuples/intervals element by element; only what that cannot decide
goes to sympy, and with fast=False to math-verify, in a watchdog process (`alignment/grading_worker.py`)
so that every call returns within about TIMEOUT_S seconds, from any thread or process, and never raises.

Follows the r1_zero reward of the Dr. GRPO / CS336 reference grader; departs from it in taking the
answer only up to `</answer>`, in rejecting hedged answers (`18 or 20`), and in never hanging.
"""

import re
import time
from fractions import Fraction

from alignment.grading_worker import symbolic_equal, warm_up

TIMEOUT_S = 1.0  # budget for one grade() call; reward computation must never stall a training step
MAX_ANSWER_CHARS = 1000  # longer "answers" are rambling or attacks; only exact string match can pass
MAX_SYMBOLIC_CHARS = 300  # longest answer handed to sympy (MATH500 golds are all under 100 characters)
MAX_DIGITS = 200  # longer digit runs are never real answers and make Fraction/sympy arithmetic slow
MAX_NESTING = 20  # bracket depth beyond which we do not even try sympy

NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"


# ----------------------------------------------------------------------------- extraction


def extract_boxed(text):
    """Content of the last `\\boxed{...}` / `\\fbox{...}` (balanced braces), or None."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start + len("\\boxed"):]  # `\boxed 5` form
        return rest.strip().split("$")[0].strip() if rest.startswith(" ") else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_last_number(text):
    """The last number in `text` as written (commas dropped), or None."""
    numbers = re.findall(NUMBER, text)
    return numbers[-1].replace(",", "") if numbers else None


def extract_gsm8k_answer(answer_text):
    """GSM8K gold answer: the text after the final `#### ` marker, commas dropped (`#### 1,000` -> `1000`)."""
    return answer_text.split("####")[-1].strip().replace(",", "")


# ----------------------------------------------------------------------------- normalisation

_REMOVE = [r"\left", r"\right", r"\displaystyle", r"\!", r"\,", r"\;", r"\:", r"\$", "$", "^{\\circ}",
           "^\\circ", r"\circ", "°", r"\degree", r"\%", "%", "\n"]
_UNIT_TAIL = re.compile(r"^(.*?[\d}])(?:\s+[a-zA-Z]{2,}(?:\^\{?\d\}?)?)+\s*$")  # `864 inches^2`


def _expand_short_args(s):
    r"""`\frac12` -> `\frac{1}{2}`, `\frac 34` -> `\frac{3}{4}`, `\sqrt2` -> `\sqrt{2}`."""
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    s = re.sub(r"\\frac\s*(\{[^{}]*\})\s*(\d)", r"\\frac\1{\2}", s)
    return re.sub(r"\\sqrt\s*(\d)", r"\\sqrt{\1}", s)


def normalize(answer):
    """Canonical string form of an answer; equal forms are graded equal without further work."""
    s = answer.strip().replace("\u2212", "-")  # Unicode's minus sign, as typeset text writes it
    boxed = re.fullmatch(r"\\boxed\{(.*)\}", s)
    s = boxed[1] if boxed and extract_boxed(s) == boxed[1] else s  # a lone `\boxed{5}`: its content
    for token in _REMOVE:
        s = s.replace(token, "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac").replace(r"\{", "{").replace(r"\}", "}")
    s = re.sub(r"\\(?:text|textbf|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"(?i)^(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", "", s).strip()
    s = _UNIT_TAIL.sub(r"\1", s) if re.search(r"\d", s) else s
    s = s.rstrip(".").strip()
    sides = [side.strip() for side in s.split("=")]
    if len(sides) == 2 and re.fullmatch(r"[a-zA-Z]", sides[0]):  # `x = 5` -> `5`
        s = sides[1]
    elif len(sides) == 2 and re.fullmatch(r"[a-zA-Z]", sides[1]):  # `2x+3 = y` -> `2x+3`
        s = sides[0]
    s = _expand_short_args(s)
    s = re.sub(r"_\{(\w+)\}", r"_\1", s)  # base subscripts: `4210_{5}` -> `4210_5`
    s = re.sub(r"\^\{(\w)\}", r"^\1", s)
    s = re.sub(r"\s+", "", s).replace("{,}", ",")  # LaTeX's thousands separator: `1{,}000`
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):  # `1,000` -> `1000` (only for a lone number)
        s = s.replace(",", "")
    return s


def _to_number(s):
    """Exact value of a normalised plain number (`1.5e3` too, exactly), fraction or mixed number, or None."""
    if len(s) > MAX_DIGITS:
        return None
    sign, body = (-1, s[1:]) if s.startswith("-") else (1, s)
    if re.fullmatch(r"(\d+(\.\d*)?|\.\d+)([eE][+-]?\d{1,3})?", body):
        return sign * Fraction(body)
    m = re.fullmatch(r"(\d+)?\\frac\{(\d+(?:\.\d+)?)\}\{(\d+(?:\.\d+)?)\}", body) or re.fullmatch(
        r"()(\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)", body)
    if m and Fraction(m[3]) != 0:
        return sign * (Fraction(m[1] or 0) + Fraction(m[2]) / Fraction(m[3]))
    return None


def _lone_number(s):
    """The single value in a worded answer (`18dollars`, `Sheearns18.`); None when hedged or absent."""
    if "\\" in s or "^" in s or not re.search(r"[a-zA-Z]", s):
        return None
    values = {_to_number(n.replace(",", "")) for n in re.findall(NUMBER, s)}
    return values.pop() if len(values) == 1 else None


def _choice(s):
    """Multiple-choice letter from `(C)`, `C`, `C)`; None otherwise."""
    m = re.fullmatch(r"\(?([A-E])\)?", s)
    return m[1] if m else None


def _split_top_level(s, separator=","):
    parts, depth, start = [], 0, 0
    for i, c in enumerate(s):
        depth += (c in "([{") - (c in ")]}")
        if depth == 0 and s.startswith(separator, i):
            parts.append(s[start:i])
            start = i + len(separator)
    return parts + [s[start:]]


def _structure(s):
    """(open, close, items) for tuples, intervals, sets, matrices and bare lists; None for a scalar."""
    m = re.fullmatch(r"\\begin\{[pb]matrix\}(.*)\\end\{[pb]matrix\}", s)
    if m:
        rows = m[1].split("\\\\")
        return "matrix", str(len(rows)), [item for row in rows for item in row.split("&")]
    if len(s) >= 2 and s[0] in "([{" and s[-1] in ")]}":
        depth = 0
        for i, c in enumerate(s[:-1]):
            depth += (c in "([{") - (c in ")]}")
            if depth == 0:
                break  # the first bracket closes early: `(1)(2)` is not one group
        else:
            items = _split_top_level(s[1:-1])
            if len(items) > 1:
                return s[0], s[-1], items
    items = _split_top_level(s)
    return ("", "", items) if len(items) > 1 else None


# ----------------------------------------------------------------------------- comparison


def _too_wild_for_sympy(s):
    depth = max_depth = 0
    for c in s:
        depth += (c in "([{") - (c in ")]}")
        max_depth = max(max_depth, depth)
    return len(s) > MAX_SYMBOLIC_CHARS or max_depth > MAX_NESTING or re.search(r"\d{%d}" % MAX_DIGITS, s)


def _equal_scalar(given, truth, fast, deadline):
    if given == truth:
        return True
    if not given or not truth or _structure(given) is not None:
        return False
    if _choice(truth):
        return _choice(given) == _choice(truth)
    truth_value = _to_number(truth)
    if truth_value is not None:
        value = _to_number(given)
        if value is None:
            value = _lone_number(given)
        if value is not None:  # an integer gold exactly (a 10-digit product one off, or half off, is wrong); else
            if truth_value.denominator == 1:  # within a relative 1e-9, for `0.333333333333` against `1/3`
                return value == truth_value
            return abs(value - truth_value) <= Fraction(1, 10**9) * abs(truth_value)
        if re.search(r"\d", given) and not re.search(r"[\\^]", given):
            return False  # worded or hedged numbers that _lone_number refused: `18or20`
    if re.fullmatch(r"[a-zA-Z]+", truth) and re.fullmatch(r"[a-zA-Z]+", given) and len(truth) > 1:
        return given.lower() == truth.lower()  # text answers such as `east`, `Evelyn`
    if _too_wild_for_sympy(given) or _too_wild_for_sympy(truth) or time.monotonic() >= deadline:
        return False
    return symbolic_equal(given, truth, deadline, use_math_verify=not fast)


def _equal(given, truth, fast, deadline):
    """Normalised answers equal as scalars, or as structures whose brackets and items match."""
    if given == truth:
        return True
    given_parts, truth_parts = _split_top_level(given, "\\cup"), _split_top_level(truth, "\\cup")
    if len(truth_parts) > 1:  # unions of intervals: piece by piece, in order
        return len(given_parts) == len(truth_parts) and all(
            _equal(g, t, fast, deadline) for g, t in zip(given_parts, truth_parts))
    truth_shape, given_shape = _structure(truth), _structure(given)
    if truth_shape is None:
        return _equal_scalar(given, truth, fast, deadline)
    if given_shape is None or given_shape[:2] != truth_shape[:2] or len(given_shape[2]) != len(truth_shape[2]):
        return False
    given_items, truth_items = given_shape[2], truth_shape[2]
    if truth_shape[0] in ("", "{"):  # bare lists of solutions and sets: any order
        unmatched = list(given_items)
        for t in truth_items:
            match = next((g for g in unmatched if _equal_scalar(g, t, fast, deadline)), None)
            if match is None:
                return False
            unmatched.remove(match)
        return True
    return all(_equal_scalar(g, t, fast, deadline) for g, t in zip(given_items, truth_items))


def grade(given_answer, ground_truth, fast=True):
    """True if `given_answer` is mathematically the same answer as `ground_truth`.

    fast=False also asks math-verify when our own checks fail. Returns within about TIMEOUT_S s
    whatever the input (an undecided comparison counts as wrong) and never raises.
    """
    deadline = time.monotonic() + TIMEOUT_S
    warm_up()  # non-blocking: the sympy worker imports in the background while cheap checks run
    try:
        if not isinstance(given_answer, str) or len(given_answer) > MAX_ANSWER_CHARS:
            return False
        truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
        given = normalize(given_answer)
        # an empty gold (after normalising) matches nothing: else an empty answer would score 1
        return any(truth and _equal(given, truth, fast, deadline) for truth in (normalize(str(t)) for t in truths))
    except Exception:  # a reward function must not crash the training step: unparsable means wrong
        return False


# ----------------------------------------------------------------------------- reward functions


def _reward(format_ok, correct):
    return {"format_reward": float(format_ok), "answer_reward": float(correct),
            "reward": float(format_ok and correct)}


def r1_zero_reward_fn(response, ground_truth, fast=True):
    """Reward for the r1_zero prompt (which ends in `Assistant: <think>`).

    The response must contain `</think> <answer>` and then `</answer>`, else every reward is 0. The
    answer is the text between `<answer>` and `</answer>`, or its last `\\boxed{}` content if it has one.
    """
    if "</think> <answer>" not in response or "</answer>" not in response.split("</think> <answer>", 1)[1]:
        return _reward(False, False)
    answer = response.split("</think> <answer>", 1)[1].split("</answer>", 1)[0]
    if "\\boxed" in answer or "\\fbox" in answer:
        answer = extract_boxed(answer)
        if answer is None:
            return _reward(True, False)
    return _reward(True, grade(answer, ground_truth, fast))


def question_only_reward_fn(response, ground_truth, fast=True):
    """Reward for the question-only prompt: the last `\\boxed{}` answer, else the last number."""
    answer = extract_boxed(response)
    if answer is None:
        answer = extract_last_number(response)
    if answer is None:
        return _reward(False, False)
    return _reward(True, grade(answer, ground_truth, fast))
