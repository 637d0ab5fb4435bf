"""A worker for the distributed tests: runs `train_rl.main` or `sft.main` in this process, under torchrun or
alone, with the test's settings (one JSON argument).

settings: {"script": "rl" | "sft", "args": {...flags...}, "fixed_rollouts": bool, "uneven": bool}
- fixed_rollouts: rollouts are a pure function of the prompt (no sampling), and the reward of sample k is
  k's parity, so one process and two see exactly the same data.
- uneven: only the first half of each step's questions (rank 0's share under 2 processes) get rewards
  with spread; the others get a constant reward and are filtered out, so rank 1 trains on nothing and
  must still join every collective.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alignment import data, experience, models, sft, train_rl  # noqa: E402
from alignment.args import RLArgs, SFTArgs  # noqa: E402
from alignment.evaluate import build_prompts  # noqa: E402
from alignment.rollout import Rollout  # noqa: E402


def scripted_rollouts(sampler, tokenizer, prompt_ids, params, args):
    rows = []
    for group, prompt in enumerate(prompt_ids):
        for k in range(params.n):
            response = [(sum(prompt) * 31 + k * 7 + i * 13) % 997 + 100 for i in range(3 + 2 * k)]
            rows.append(Rollout(prompt_ids=list(prompt), response_ids=response, loss_mask=[1] * len(response),
                                trace_id=group * params.n + k, group_id=group, text="x" * (k + 1),
                                finish_reason="length"))
    return rows


def main(settings: dict):
    if settings["script"] == "sft":
        return sft.main(SFTArgs(**settings["args"]))
    args = RLArgs(**settings["args"])
    args.check()
    if settings.get("fixed_rollouts"):
        experience.ROLLOUT_MODES["standard"] = scripted_rollouts
    mixed = None
    if settings.get("uneven"):  # prompts of the first half of each step's questions
        rows = data.load_dataset(args.dataset, "train", args.data_dir, size=args.rg_size, seed=args.seed)
        per_step = args.rollout_batch_size // args.group_size
        questions = [q for s in range(args.n_steps) for q in experience.questions_at(rows, s * per_step, per_step // 2, args.seed)]
        mixed = {tuple(ids) for ids in build_prompts(models.load_tokenizer(args.model), questions, args.prompt)[1]}

    def reward(row, truth):
        right = float(len(row.text) % 2) if mixed is None or tuple(row.prompt_ids) in mixed else 0.0
        return {"reward": right, "format_reward": 1.0, "answer_reward": right}
    train_rl.make_scorer = lambda args: reward
    train_rl.main(args)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
