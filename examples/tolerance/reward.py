"""A reward of one's own for examples/tolerance: the r1_zero format (`</think> <answer> ... </answer>`), and the
last number of the answer within the row's `tolerance` of the gold. `tolerance` is a column of questions.jsonl,
which the reward receives by name (every column but the answer one).

    uv run -m alignment.evaluate --dataset examples/tolerance/questions.jsonl --reward_fn examples/tolerance/reward.py:within_tolerance
"""

import re


def within_tolerance(response: str, ground_truth: str, tolerance: float, **columns) -> dict:
    found = re.search(r"<answer>(.*?)</answer>", response, re.DOTALL)
    if "</think>" not in response or found is None:
        return {"reward": 0.0, "format_reward": 0.0, "answer_reward": 0.0}
    numbers = re.findall(r"-?\d+(?:\.\d+)?", found.group(1).replace(",", ""))
    right = bool(numbers) and abs(float(numbers[-1]) - float(ground_truth)) <= float(tolerance)
    return {"reward": float(right), "format_reward": 1.0, "answer_reward": float(right)}
