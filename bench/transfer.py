"""Does RL teach more than the questions it trained on? Evaluate models greedily on a test set and score
them separately on the test questions that never occur among the training questions.

    uv run python bench/transfer.py checkpoints/math_sft checkpoints/rl/add-seed0/checkpoint
    uv run python bench/transfer.py <models...> --train_dataset rg:chain_sum:max_terms=3 --dataset rg:chain_sum:max_terms=4

The defaults fit the default RL run: trained on sums of two numbers of up to two digits, tested on sums
of two numbers of up to three digits, of which the ones with a three-digit number are new. (The RL run's
own evaluation already leaves its questions out of training; this asks how far the skill reaches.) A model already evaluated into --out is not evaluated
again. Prints one table row per model: the answer rate on the new questions and on all, and the format rate.
"""

import argparse
import json
from pathlib import Path

from alignment import data, evaluate
from alignment.args import DEFAULT_RL_TASK, EvalArgs

THREE_DIGIT_SUMS = DEFAULT_RL_TASK.replace("max_digits=2", "max_digits=3")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("models", nargs="+", help="model folders or names, as `alignment.evaluate --model` takes")
    parser.add_argument("--train_dataset", default=DEFAULT_RL_TASK, help="the RL run's --dataset")
    parser.add_argument("--rg_size", type=int, default=2000, help="the RL run's --rg_size (training questions)")
    parser.add_argument("--seed", type=int, default=0, help="the RL run's --seed (it picks the training questions)")
    parser.add_argument("--dataset", default=THREE_DIGIT_SUMS, help="test set (its test split)")
    parser.add_argument("--limit", type=int, default=100, help="test questions")
    parser.add_argument("--max_tokens", type=int, default=128)
    parser.add_argument("--out", default="outputs/transfer", help="one evaluation folder per model inside")
    args = parser.parse_args()

    trained = {row["question"] for row in data.load_dataset(args.train_dataset, "train", None, size=args.rg_size,
                                                            seed=args.seed)}
    questions = [row["question"] for row in data.load_dataset(args.dataset, "test", None)[:args.limit]]
    new = {i for i, question in enumerate(questions) if question not in trained}
    if not new:
        raise SystemExit(f"error: every test question of {args.dataset} occurs in the training questions; "
                         f"choose a --dataset with problems the run never saw.")
    print(f"[transfer] {len(new)} of {len(questions)} test questions never occur in the training questions")
    rows = ["| model | answer rate on new questions | on all | format |", "| --- | --- | --- | --- |"]
    for model in args.models:
        out = Path(args.out) / model.strip("/").replace("/", "_")
        if (out / "results.jsonl").exists():
            print(f"[transfer] {model}: evaluated before, read from {out}")
        else:
            evaluate.main(EvalArgs(model=model, dataset=args.dataset, limit=args.limit, max_tokens=args.max_tokens,
                                   output_dir=str(out)))
        records = [json.loads(line) for line in open(out / "results.jsonl")]
        on_new = [r["answer_reward"] for r in records if r["problem"] in new]
        rows.append(f"| {model} | {sum(on_new) / len(on_new):.3f} | "
                    f"{sum(r['answer_reward'] for r in records) / len(records):.3f} | "
                    f"{sum(r['format_reward'] for r in records) / len(records):.3f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
