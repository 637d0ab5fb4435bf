"""Benchmark the grader against math-verify alone: grades per second and agreement, on answer pairs
built from the GSM8K and MATH500 test sets (gold vs itself, vs a lightly reformatted gold, vs the gold
of another row).

    uv run python bench/grader.py [--data_dir ../shared/data] [--limit 400]
"""

import argparse
import json
import logging
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alignment.drgrpo_grader import extract_gsm8k_answer, grade  # noqa: E402
from alignment.grading_worker import symbolic_equal  # noqa: E402


def gsm8k_pairs(rows, rng):
    golds = [extract_gsm8k_answer(r["answer"]) for r in rows]
    pairs = []
    for i, gold in enumerate(golds):
        value = float(gold)
        pretty = f"{value:,.0f}" if value.is_integer() and abs(value) >= 1000 else gold
        reformatted = rng.choice([f"${pretty}", f"{gold}.00" if value.is_integer() else gold,
                                  f"The answer is {pretty}.", f"{pretty} dollars"])
        other = golds[(i + 1 + rng.randrange(len(golds) - 1)) % len(golds)]
        pairs += [(gold, gold, True), (reformatted, gold, True), (other, gold, other == gold)]
    return pairs


def math500_pairs(rows, rng):
    golds = [r["answer"] for r in rows]
    pairs = []
    for i, gold in enumerate(golds):
        reformatted = rng.choice([gold.replace("\\frac", "\\dfrac"), gold.replace(" ", ""),
                                  gold.replace(",", ", "), f"\\left{gold[0]} {gold[1:-1]} \\right{gold[-1]}" if gold[:1] == "(" else gold])
        other = golds[(i + 1 + rng.randrange(len(golds) - 1)) % len(golds)]
        pairs += [(gold, gold, True), (reformatted, gold, True), (other, gold, other == gold)]
    return pairs


def math_verify_grade(given, truth):
    from math_verify import parse, verify

    return bool(verify(parse(f"${truth}$"), parse(f"${given}$")))


def run(name, pairs):
    results = {}
    for label, fn in [("drgrpo_grader (fast=True)", grade), ("math-verify alone", math_verify_grade)]:
        start = time.perf_counter()
        results[label] = [fn(given, truth) for given, truth, _ in pairs]
        elapsed = time.perf_counter() - start
        correct = sum(r == expected for r, (_, _, expected) in zip(results[label], pairs))
        print(f"  {label:28s} {len(pairs) / elapsed:9.1f} grades/s   label accuracy {correct / len(pairs):.3f}")
    ours, theirs = results.values()
    agree = sum(a == b for a, b in zip(ours, theirs)) / len(pairs)
    print(f"  agreement {agree:.3f} on {len(pairs)} {name} pairs")
    disagreements = [(p, a, b) for p, a, b in zip(pairs, ours, theirs) if a != b]
    for (given, truth, expected), a, b in disagreements[:8]:  # a sample; the rest are usually alike
        print(f"    disagree: given={given!r} gold={truth!r} expected={expected} ours={a} math-verify={b}")


def main(args):
    logging.disable(logging.WARNING)
    data_dir = Path(args.data_dir)
    rng = random.Random(0)
    symbolic_equal("1", "1", time.monotonic() + 1)  # start the sympy worker outside the timings
    for name, subdir, build in [("GSM8K", "gsm8k", gsm8k_pairs), ("MATH500", "math500", math500_pairs)]:
        path = data_dir / subdir / "test.jsonl"
        if not path.exists():
            sys.exit(f"{path} not found: pass --data_dir or set ALIGNMENT_DATA_DIR to the folder with {subdir}/")
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:args.limit]
        print(f"{name}-style pairs:")
        run(name, build(rows, rng))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data_dir", default=os.environ.get("ALIGNMENT_DATA_DIR", "../shared/data"),
                        help="folder holding gsm8k/test.jsonl and math500/test.jsonl")
    parser.add_argument("--limit", type=int, default=500, help="rows per data set (keeps the run short)")
    main(parser.parse_args())
