"""Worked solutions for procedural arithmetic: SFT data whose responses show the steps.

A question of reasoning-gym's `basic_arithmetic`, `chain_sum` or `products` (`Calculate 12 + 34 - 5.`, `State the
final answer to the following arithmetic problem: 12 + 34 - 5 =`, `Solve the following multiplication: 361 * 220.
Give only the result as your final answer.`) holds one flat expression of integers and
`+ - * /`. Its worked solution does one operation per sentence, in the order arithmetic does them:
multiplications and divisions first (left to right, then the expression that is left is restated), then
additions and subtractions left to right, each on the previous result:

    Calculate 7 + 6 * 5 - 9.  ->  " 6 * 5 = 30. So 7 + 30 - 9. 7 + 30 = 37. 37 - 9 = 28. </think> <answer> 28 </answer>"

`rewrite` (`sft --worked_style rewrite`) writes the whole expression again after each operation instead:
` 7 + 6 * 5 - 9 = 7 + 30 - 9 = 37 - 9 = 28.`, so each step reads only the one before it.

`places` (`sft --worked_style places`, for products: issue 64's text arm) writes a multiplication by a number of
several digits out by its place values: ` 15 * 43 = 15 * 40 + 15 * 3. 15 * 40 = 600. 15 * 3 = 45. 600 + 45 = 645.`

`counted` (`sft --worked_style counted`, for issue 63's Delethink demo) opens each step of the chain style with
the position of the term it adds: ` #2 8 + 2 = 10. #3 10 + 7 = 17.`

`tool_solution` (`sft --worked_style tool`) writes the tool-integrated form for the tir prompt
and `--rollout_mode tir`: the expression as a Python block, the output the sandbox prints for it, and the answer
quoting it in `\\boxed{}`.

The text is this project's own; every step is exact integer arithmetic (`Fraction`, so a division that does not
come out whole is refused rather than rounded), and the final value must equal the task's gold answer, checked
with the project's grader, before a solution is used. Parentheses are not written out: a question that has them
is refused in one line.
"""

import re
from fractions import Fraction

from alignment.drgrpo_grader import grade
from alignment.errors import UserError

REPEATED = re.compile(r"Start at (\d+) and add (\d+) to it (\d+) times")  # alignment/tasks.py's repeated_addition
UNTIL = re.compile(r"Start at (\d+) and add (\d+) until the result is more than (\d+)")  # tasks.py's add_until
TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/×÷]))")
EXPRESSION = re.compile(r"(?:Calculate|problem:|multiplication:)\s*(.+?)\s*[.=]?\s*"
                        r"(?:Give only the result as your final answer\.)?\s*$", re.S)  # the last: rg's products
SYMBOL = {"×": "*", "÷": "/"}


def parse_expression(question: str) -> list:
    """`[12, "+", 34, "-", 5]` from a basic_arithmetic or chain_sum question; a negative number (`- -5`,
    a leading `-5`) becomes one term. Anything else is refused with a sentence that names the question."""
    match = EXPRESSION.search(question.strip())
    text = match.group(1) if match else ""
    terms, position = [], 0
    while position < len(text):
        token = TOKEN.match(text, position)
        if not token:
            raise UserError(f"no worked solution for {question!r}: write steps only for flat expressions of integers "
                            f"and + - * / (reasoning-gym's chain_sum, or basic_arithmetic with operators=+- and "
                            f"allow_parentheses=false).")
        number, operator = token.groups()
        position = token.end()
        if number is not None:
            terms.append(Fraction(int(number)))
        elif operator == "-" and (not terms or isinstance(terms[-1], str)):
            terms.append("neg")  # a unary minus: negates the next number
        else:
            terms.append(SYMBOL.get(operator, operator))
    terms = _fold_negations(terms, question)
    if len(terms) < 3 or len(terms) % 2 == 0 or any(isinstance(t, str) for t in terms[::2]) or \
            any(not isinstance(t, str) for t in terms[1::2]):
        raise UserError(f"no worked solution for {question!r}: it is not a flat expression of two or more numbers "
                        f"(SFT needs rg:chain_sum or rg:basic_arithmetic questions with min_terms=2 or more).")
    return terms


def _fold_negations(terms: list, question: str) -> list:
    folded = []
    for term in terms:
        if folded and folded[-1] == "neg":
            if isinstance(term, str):
                raise UserError(f"no worked solution for {question!r}: a minus sign stands before an operator.")
            folded[-1] = -term
        else:
            folded.append(term)
    return folded


def _show(value: Fraction) -> str:
    return str(value.numerator)


def _apply(a: Fraction, operator: str, b: Fraction, question: str) -> Fraction:
    if operator == "/":
        if b == 0 or (a / b).denominator != 1:
            raise UserError(f"no worked solution for {question!r}: {_show(a)} / {_show(b)} is not a whole number.")
        return a / b
    return {"+": a + b, "-": a - b, "*": a * b}[operator]


def _restate(terms: list) -> str:
    return " ".join(term if isinstance(term, str) else _show(term) for term in terms)


def _by_places(a: Fraction, b: Fraction) -> list[str]:
    """`a * b` by the place values of `b` (the `places` style): `15 * 43 = 15 * 40 + 15 * 3. 15 * 40 = 600.
    15 * 3 = 45. 600 + 45 = 645.` One sentence where `b` has one non-zero digit or a factor is negative."""
    digits = str(b.numerator)
    parts = [Fraction(int(d) * 10 ** (len(digits) - 1 - i)) for i, d in enumerate(digits) if d != "0"]
    if a < 0 or b < 0 or len(parts) < 2:
        return [f"{_show(a)} * {_show(b)} = {_show(a * b)}."]
    steps = [f"{_show(a)} * {_show(b)} = {' + '.join(f'{_show(a)} * {_show(p)}' for p in parts)}."]
    steps += [f"{_show(a)} * {_show(p)} = {_show(a * p)}." for p in parts]
    total = a * parts[0]
    for p in parts[1:]:
        steps.append(f"{_show(total)} + {_show(a * p)} = {_show(total + a * p)}.")
        total += a * p
    return steps


def worked_steps(question: str, places: bool = False) -> tuple[list[str], Fraction]:
    """The sentences of the solution and the final value; with `places`, a multiplication by a number of
    several non-zero digits is written out by its place values (`_by_places`)."""
    terms, steps = parse_expression(question), []
    i = 1
    while i < len(terms):  # multiplications and divisions first, left to right
        if terms[i] in "*/":
            value = _apply(terms[i - 1], terms[i], terms[i + 1], question)
            steps += _by_places(terms[i - 1], terms[i + 1]) if places and terms[i] == "*" else \
                [f"{_show(terms[i - 1])} {terms[i]} {_show(terms[i + 1])} = {_show(value)}."]
            terms[i - 1:i + 2] = [value]
        else:
            i += 2
    if steps and len(terms) > 1:
        steps.append(f"So {_restate(terms)}.")
    value = terms[0]
    for operator, term in zip(terms[1::2], terms[2::2]):  # then additions and subtractions, left to right
        result = _apply(value, operator, term, question)
        steps.append(f"{_show(value)} {operator} {_show(term)} = {_show(result)}.")
        value = result
    return steps, value


def rewritten_steps(question: str) -> tuple[list[str], Fraction]:
    """The `rewrite` style: the whole expression again after each operation, the first `*` or `/` done first,
    else the first `+` or `-` (`8 - 2 + 7 = 6 + 7 = 13.`): each step reads only the line before it, and the
    solution ends where one number is left, however long the chain."""
    terms = parse_expression(question)
    lines = [_restate(terms)]
    while len(terms) > 1:
        i = next((i for i in range(1, len(terms), 2) if terms[i] in "*/"), 1)
        terms[i - 1:i + 2] = [_apply(terms[i - 1], terms[i], terms[i + 1], question)]
        lines.append(_restate(terms))
    return [" = ".join(lines) + "."], terms[0]


def counted_steps(question: str) -> tuple[list[str], Fraction]:
    """The `counted` style (issue 63, for Delethink): the chain style with each step opened by the position of
    the term it adds, `#2 8 + 2 = 10. #3 10 + 7 = 17.`. What the next step needs is the last step alone (the
    running total and the position to read the next term from in the question, which every Delethink chunk
    sees), a dozen tokens however long the chain, so a short carryover holds it where the rewrite style's
    remaining terms grow with the chain. Additions and subtractions only. For rg:repeated_addition (`Start at 37
    and add 7 to it 14 times.`) the counter is the additions made, `#1 37 + 7 = 44.` to `#14`: the count to stop at
    is the question's. For rg:add_until (`Start at 137 and add 7 until the result is more than 180.`) a step holds
    no counter but its total's comparison with the bound, ` 137 + 7 = 144 < 180.` to ` 179 + 7 = 186 > 180.`: the
    total alone is the state."""
    repeated = REPEATED.search(question)
    if repeated:
        start, step, times = (Fraction(int(n)) for n in repeated.groups())
        steps = [f"#{k} {_show(start + (k - 1) * step)} + {_show(step)} = {_show(start + k * step)}."
                 for k in range(1, int(times) + 1)]
        return steps, start + times * step
    until = UNTIL.search(question)
    if until:  # no counter: the step's comparison with the bound says whether to go on
        start, step, bound = (int(n) for n in until.groups())
        totals = [start]
        while totals[-1] <= bound:
            totals.append(totals[-1] + step)
        return [f"{a} + {step} = {b} {'>' if b > bound else '<'} {bound}." for a, b in zip(totals, totals[1:])], \
            Fraction(totals[-1])
    terms = parse_expression(question)
    if any(op in "*/" for op in terms[1::2]):
        raise UserError(f"no counted solution for {question!r}: the counted style adds and subtracts in order; use "
                        f"--worked_style chain for * and /.")
    value, steps = terms[0], []
    for position, (operator, term) in enumerate(zip(terms[1::2], terms[2::2]), start=2):
        result = _apply(value, operator, term, question)
        steps.append(f"#{position} {_show(value)} {operator} {_show(term)} = {_show(result)}.")
        value = result
    return steps, value


STYLES = {"counted": counted_steps, "chain": worked_steps, "rewrite": rewritten_steps, "places": lambda q: worked_steps(q, places=True)}


def python_expression(question: str) -> str:
    """The question's expression as Python source that prints its exact value: `//` for `/` (worked.py only
    takes divisions that come out whole, where the two agree), a negative number in parentheses."""
    terms = parse_expression(question)
    shown = [("//" if t == "/" else t) if isinstance(t, str) else (f"({_show(t)})" if t < 0 else _show(t))
             for t in terms]
    return " ".join(shown)


def tool_solution(row: dict) -> str:
    """The `tool` style, for the tir prompt and `--rollout_mode tir` (alignment/tir.py): the expression as a
    Python block, the block's printed output as the sandbox would answer it, and the answer quoting that output,
    `... ```python\nprint(7 + 6 * 5 - 9)\n```\n```output\n28\n```\nThe answer is \\boxed{28}.` The output is
    the exact value (what the sandbox prints for it; tests/test_worked.py runs each block there), and it must
    grade as the gold answer."""
    value = rewritten_steps(row["question"])[1]
    if not grade(_show(value), row["answer"]):
        raise UserError(f"the value of {row['question']!r} is {_show(value)}, not the task's answer {row['answer']}; "
                        f"this task's questions are not read the way worked.py reads them.")
    return (f" I compute it with Python.\n```python\nprint({python_expression(row['question'])})\n```\n```output\n"
            f"{_show(value)}\n```\nThe answer is \\boxed{{{_show(value)}}}.")


def worked_solution(row: dict, style: str = "chain") -> str:
    """The r1_zero response for `row` ({question, answer}) in `style` (`chain`: one `a op b = c.` per operation;
    `rewrite`: the expression rewritten after each), then ` </think> <answer> gold </answer>`. Refused in one
    line where the steps' value does not grade as the gold answer. `tool` gives `tool_solution(row)` (the tir prompt's
    form, no think tags)."""
    if style == "tool":
        return tool_solution(row)
    steps, value = STYLES[style](row["question"])
    if not grade(_show(value), row["answer"]):
        raise UserError(f"the worked solution of {row['question']!r} comes to {_show(value)}, not the task's answer "
                        f"{row['answer']}; this task's questions are not read the way worked.py reads them.")
    return f" {' '.join(steps)} </think> <answer> {row['answer']} </answer>"
