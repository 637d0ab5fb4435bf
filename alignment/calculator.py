"""GSM8K's calculator annotations as Python calls: SFT data in the tool-integrated (TIR) format.

    uv run -m alignment.calculator --check     # every block of GSM8K train run in the sandbox (a few minutes)
    uv run -m alignment.calculator --show 0    # one converted solution, who writes what marked
    uv run -m alignment.sft --worked_style tool   # SFT on them (tir prompt, evaluated with --rollout_mode tir)

Every GSM8K train solution marks its arithmetic with the result of a calculator, `Natalia sold 48/2 =
<<48/2=24>>24 clips in May.` (3.2 a solution; 95 of 7,473 have none). `tool_segments` turns each annotation into
a call of the project's TIR trace (alignment/tir.py), the way nanochat turns them into tool calls:

    model:  ```python\\nprint(48/2)\\n```\\n```output
    forced: \\n24.0\\n```\\n                          (the sandbox's stripped stdout; loss 0 in SFT)
    model:  Natalia sold 48/2 = 24 clips in May.\\n```python\\nprint(48+24)\\n```\\n```output
    forced: \\n72\\n```\\n
    model:  Natalia sold 48+24 = 72 clips altogether in April and May.\\nThe answer is \\boxed{72}.

The block goes before the line that holds the annotation, and the line follows as the text form has it (the
annotation removed, its result quoted as the original quotes it): the model computes, reads the output, then
writes the sentence. Not inline at the annotation: half the lines state the result before the sum (`He needs 48
pounds because 12 x 4 = <<12*4=48>>48`), where a call at the annotation would come after its result is
written, and a code fence in mid-sentence is no text a model reads elsewhere. A line with several annotations
(none in GSM8K train) gets one block each, in order. The code is the annotation's expression verbatim in
`print(...)`, so `48/2` prints `24.0` where the annotation says 24: the text quotes the annotation, the
model learns that the two agree.

Segments: a converted solution is a list of (text, trained) pairs, model and forced text alternating. The
model's text of a call ends with the stop string "```output" (the TIR rollout keeps it in the sampled tokens);
the forced text is "\\n{observation}\\n```\\n", with the leading newline because the model's text ends at the
stop string (tir.py leaves it out only when sampled text after the stop string already ends in one). SFT
tokenizes each segment on its own and concatenates the ids, as the rollout appends the forced text's own
ids, and gives the forced tokens loss 0 (`tokens.tokenize_prompt_and_segments`).

The observation is computed here, not by the sandbox, so SFT starts without running 24k snippets: the
expression is evaluated with Python's own operators (only numbers, + - * / // % ** and signs; a power whose
exponent is above 64 is refused) and `str` of the value goes through `tir.observation`, the rule the rollout
applies to the sandbox's stdout. `--check` proves the two agree: it runs every block, cut out by
`tir.extract_code` as the rollout cuts it, in the sandbox and compares. A solution is dropped, with its reason
counted (never silently), when an annotation is not Python arithmetic (or has no `=result`), raises when run,
prints a value other than the annotated result (compared as numbers: whole numbers exactly, so Python's 24.0
agrees with 24 but 1000001 not with 1000000; others within a relative 1e-6, so 0.30000000000000004 agrees with 0.3),
when an annotation is nested in another or left open (`<<3+<<4=4>>=7>>7`), or when the boxed gold does not grade
right under `tir_reward_fn`. GSM8K train (2026-12-02, docs/algorithms.md): all 7,473 kept, 23,716 blocks agree.
"""

import argparse
import ast
import math
import operator
import re
from concurrent.futures import ThreadPoolExecutor

from alignment import data, tir
from alignment.data import MAX_TOOL_CALLS
from alignment.errors import UserError, cli, one_line_error
from alignment.sandbox import ExecResult, Sandbox

ANNOTATION = re.compile(r"<<([^<>]*)>>")  # GSM8K's `<<48/2=24>>`
MAX_EXPONENT = 64  # a larger power could take the converter's memory; none in GSM8K comes close
RELATIVE_TOLERANCE = 1e-6
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
             ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
             ast.USub: operator.neg, ast.UAdd: operator.pos}
REASONS = {"not_python_arithmetic": "an annotation is not Python arithmetic on numbers, or has no `=result`",
           "unbalanced": "an annotation is nested in another or left open (`<<` or `>>` outside a whole one)",
           "fails_to_run": "an annotation's expression raises when run",
           "other_value": "an annotation's expression prints another value than the annotated result",
           "answer_not_graded": "the boxed gold answer does not grade right under tir_reward_fn"}


class Unconvertible(Exception):
    """A solution that cannot become a tool-using one: `reason` is a key of REASONS, `detail` says where."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def annotations(solution: str) -> list[tuple[str, str]]:
    """(expression, annotated result) of each annotation of `solution`, in order; `<<48/2=24>>` -> ("48/2", "24")."""
    left = ANNOTATION.sub("", solution)
    if "<<" in left or ">>" in left:  # `<<3+<<4=4>>=7>>7` would train on the outer one's remains, `<<3+=7>>`
        where = left.find("<<") if "<<" in left else left.find(">>")
        raise Unconvertible("unbalanced", f"{left[max(where - 20, 0):where + 20]!r} holds `<<` or `>>` outside an "
                                          f"annotation (a nested or unclosed one)")
    pairs = []
    for body in ANNOTATION.findall(solution):
        expression, equals, result = body.rpartition("=")
        if not equals or not expression.strip():
            raise Unconvertible("not_python_arithmetic", f"<<{body}>> has no `expression=result`")
        pairs.append((expression.strip(), result.strip()))
    return pairs


def _value(node: ast.AST, source: str):
    """The value of an arithmetic expression tree, by Python's own operators (so it is what Python prints)."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_value(node.operand, source))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _value(node.left, source), _value(node.right, source)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise Unconvertible("not_python_arithmetic", f"{source!r} raises to a power above {MAX_EXPONENT}")
        return OPERATORS[type(node.op)](left, right)
    raise Unconvertible("not_python_arithmetic", f"{source!r} is not arithmetic on numbers ({ast.dump(node)[:60]})")


def printed(expression: str) -> str:
    """The observation of `print(expression)`: `str` of its value through `tir.observation`, the rule the TIR
    rollout applies to the sandbox's stdout (`--check` proves the sandbox prints the same)."""
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as e:
        raise Unconvertible("not_python_arithmetic", f"{expression!r} is not Python ({e.msg})") from e
    try:
        stdout = f"{_value(tree.body, expression)}\n"
    except (ArithmeticError, ValueError) as e:  # division by zero, overflow, an int too long to print
        raise Unconvertible("fails_to_run", f"{expression!r} raises {type(e).__name__}: {e}") from e
    return tir.observation(ExecResult(ok=True, stdout=stdout, error=None, timed_out=False))


def agrees(observation: str, result: str) -> bool:
    """Whether a printed value is the annotated result, as numbers: whole numbers exactly (24.0 is 24, but 1000001
    is not 1000000, which a relative tolerance would pass), others within RELATIVE_TOLERANCE (0.30000000000000004
    is 0.3: the float's rounding, not another value)."""
    try:
        printed_value, annotated = float(observation), float(result)
    except ValueError:  # not a number on one side
        return False
    if printed_value.is_integer() and annotated.is_integer():
        return _exact(observation) == _exact(result)
    return math.isclose(printed_value, annotated, rel_tol=RELATIVE_TOLERANCE, abs_tol=1e-12)


def _exact(number: str) -> int:
    """A whole number's exact value, also beyond a float's 2**53 (`12345678901234567` stays itself)."""
    try:
        return int(number)
    except ValueError:  # `24.0`, `1e6`: a whole number written as a float
        return int(float(number))


def forced(observation: str) -> str:
    """The text the TIR rollout forces after a call whose sampled text ends exactly at "```output" (tir.py)."""
    return f"\n{observation}\n```\n"


def call(text: str, expression: str) -> str:
    """The model's text of one call: what it writes before, the block, and the stop string."""
    return f"{text}```python\nprint({expression})\n```\n{tir.CALL}"


def tool_segments(row: dict) -> list[tuple[str, bool]]:
    """The tool-using form of a GSM8K train row ({question, answer, solution}) as (text, trained) segments, model
    and forced text alternating, ending with `The answer is \\boxed{gold}.`; the response starts with a space, as
    every SFT response here (the prompt ends with `Assistant:`). Raises Unconvertible with its reason."""
    reasoning = row["solution"].split("####")[0].strip()
    segments, text = [], " "
    for line in reasoning.split("\n"):
        for expression, result in annotations(line):
            observation = printed(expression)
            if not agrees(observation, result):
                raise Unconvertible("other_value", f"print({expression}) gives {observation}, the annotation says "
                                                   f"{result}")
            segments += [(call(text, expression), True), (forced(observation), False)]
            text = ""
        text += ANNOTATION.sub("", line) + "\n"
    segments.append((f"{text}The answer is \\boxed{{{row['answer']}}}.", True))
    if tir.tir_reward_fn("".join(t for t, _ in segments), row["answer"])["answer_reward"] != 1.0:
        raise Unconvertible("answer_not_graded", f"\\boxed{{{row['answer']}}} does not grade as {row['answer']!r}")
    return segments


def convert(rows: list[dict]) -> tuple[list[tuple[dict, list]], dict[str, list[tuple[dict, str]]]]:
    """(kept: (row, segments) pairs in order, dropped: reason -> [(row, detail)]) for GSM8K train rows."""
    kept, dropped = [], {reason: [] for reason in REASONS}
    for row in rows:
        try:
            kept.append((row, tool_segments(row)))
        except Unconvertible as e:
            dropped[e.reason].append((row, e.detail))
    return kept, dropped


def check(rows: list[dict], workers: int | None = None, sample: int | None = None) -> dict:
    """Convert `rows`, then run every block of every kept solution in the project's sandbox (many at once),
    cut out of the model's text by `tir.extract_code` as the rollout cuts it; with `sample`, about that many blocks
    spread evenly over them (every k-th, the same ones every time: the suite's check, a few seconds where the whole
    split takes minutes). Returns rows, kept, dropped (reason -> [(row, detail)]), blocks, ran (blocks run in the
    sandbox), max_calls and mismatches: [(row, code, sandbox observation, the converter's, annotated result)] where
    the sandbox's observation is not the converter's or not the result."""
    kept, dropped = convert(rows)
    blocks = []  # (row, model text of the call, converter's observation, annotated result)
    for row, segments in kept:
        results = [result for _, result in annotations(row["solution"].split("####")[0])]
        calls = [(text, forced_text) for (text, _), (forced_text, trained) in zip(segments, segments[1:])
                 if not trained]
        blocks += [(row, text, forced_text[1:-len("\n```\n")], result) for (text, forced_text), result in
                   zip(calls, results, strict=True)]
    step = max(1, -(-len(blocks) // sample)) if sample else 1
    run = blocks[::step]
    box = Sandbox(workers)
    try:
        with ThreadPoolExecutor(box.workers) as pool:
            seen = list(pool.map(lambda block: tir.observation(box.run(tir.extract_code(block[1]))), run))
    finally:
        box.close()
    mismatches = [(row, tir.extract_code(text), got, ours, result) for (row, text, ours, result), got in
                  zip(run, seen) if got != ours or not agrees(got, result)]
    max_calls = max((sum(not trained for _, trained in segments) for _, segments in kept), default=0)
    return {"rows": len(rows), "kept": len(kept), "dropped": dropped, "blocks": len(blocks), "ran": len(run),
            "max_calls": max_calls, "mismatches": mismatches}


def report(result: dict, examples: int = 3) -> list[str]:
    """The check's lines: kept of all, then each reason's count with up to `examples` examples."""
    lines = [f"[calculator] kept {result['kept']:,} of {result['rows']:,} GSM8K train solutions; ran "
             f"{result['ran']:,} of their {result['blocks']:,} blocks in the sandbox; at most {result['max_calls']} calls in one solution "
             f"(SFT evaluates with --max_tool_calls {MAX_TOOL_CALLS})"]
    for reason, items in result["dropped"].items():
        lines.append(f"  dropped {len(items):,}: {reason} ({REASONS[reason]})")
        lines += [f"    - {row['question'][:70]!r}: {detail}" for row, detail in items[:examples]]
    lines.append(f"  sandbox disagrees with the converter: {len(result['mismatches'])} blocks")
    lines += [f"    - {code!r}: sandbox {got!r}, converter {ours!r}, annotation {result_!r}"
              for _, code, got, ours, result_ in result["mismatches"][:examples]]
    return lines


def show(row: dict) -> str:
    """A converted solution with who writes what marked: `| model:` and `| forced:` before each segment."""
    return "".join(f"\n| {'model' if trained else 'forced'}: {text}" for text, trained in tool_segments(row))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m alignment.calculator", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = one_line_error  # argparse's complaints as one line, as the other scripts'
    parser.add_argument("--check", action="store_true", help="run every converted block of GSM8K train in the "
                        "sandbox and print how many solutions are kept and dropped, by reason (a few minutes)")
    parser.add_argument("--show", type=_index, default=None, help="print converted train solution N (0 to 7,472)")
    parser.add_argument("--data_dir", default=None, help="data folder (default $ALIGNMENT_DATA_DIR or dataset/)")
    parser.add_argument("--sample", type=_count, default=None, help="with --check: run about this many blocks, "
                        "spread evenly over the split, instead of all 23,716 (seconds instead of minutes)")
    parser.add_argument("--workers", type=_index, default=None, help="sandbox processes, from 1 (default: one per core)")
    args = parser.parse_args(argv)
    if not args.check and args.show is None:
        parser.error("say what to do: --check (every block run in the sandbox, a few minutes) or --show N")
    if args.sample is not None and not args.check:
        parser.error("--sample takes a number from 1, with --check (the sandbox runs only there)")
    if args.workers is not None and (not args.check or args.workers < 1):
        parser.error("--workers takes a number from 1, with --check (the sandbox runs only there)")
    cli(_main, args)


def _count(text: str) -> int:
    """An argparse type: a whole number from 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number from 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number from 1")
    return value


def _index(text: str) -> int:
    """An argparse type: a whole number from 0."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: give a whole number from 0")
    return value


def _main(args):
    rows = data.load_gsm8k("train", args.data_dir)
    if args.show is not None:
        if args.show >= len(rows):
            raise UserError(f"--show {args.show}: GSM8K train has {len(rows)} solutions, 0 to {len(rows) - 1}.")
        print(show(rows[args.show]))
    if args.check:
        try:
            result = check(rows, args.workers, args.sample)
        except KeyboardInterrupt:
            raise KeyboardInterrupt("interrupted: the check did not finish and keeps nothing; run it again") from None
        print("\n".join(report(result)))
        if result["mismatches"] or result["max_calls"] > MAX_TOOL_CALLS:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
