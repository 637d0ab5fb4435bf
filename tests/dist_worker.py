"""A worker for the distributed tests: runs `train_rl.main` or `sft.main` in this process, under torchrun or
alone, with the test's settings (one JSON argument: one run's, or a list of runs made one after another in the
same launch, since it is the launch, torch's import and the process group, that costs).

settings: {"script": "rl" | "sft", "args": {...flags...}, "fixed_rollouts": bool, "uneven": bool,
           "engine_report": path}
- fixed_rollouts: rollouts are a pure function of the prompt (no sampling), and the reward of sample k is
  k's parity, so one process and two see exactly the same data.
- uneven: only the first half of each step's questions (rank 0's share under 2 processes) get rewards
  with spread; the others get a constant reward 0 (with dynamic sampling they are filtered out, so rank 1
  trains on nothing and must still join every collective).
- compile_backend: torch.compile's backend for --compile_layers (models.COMPILE_BACKEND; "aot_eager" in tests)
- engine_report: after the run each rank writes to path.<rank> the largest gap between its own sampler's
  log-probs of a fixed sequence and those of the run's final checkpoint (and of the starting model).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alignment import distributed, experience, models, sft, train_rl  # noqa: E402
from alignment.args import RLArgs, SFTArgs  # noqa: E402
from alignment.evaluate import build_prompts  # noqa: E402
from alignment.rollout import Rollout  # noqa: E402
from alignment.tokens import rollout_log_probs  # noqa: E402


def scripted_rollouts(sampler, tokenizer, prompt_ids, params, args):
    rows = []
    for group, prompt in enumerate(prompt_ids):
        for k in range(params.n):
            response = [(sum(prompt) * 31 + k * 7 + i * 13) % 997 + 100 for i in range(3 + 2 * k)]
            rows.append(Rollout(prompt_ids=list(prompt), response_ids=response, loss_mask=[1] * len(response),
                                trace_id=group * params.n + k, group_id=group, text="x" * (k + 1),
                                finish_reason="length"))
    return rows


ORIGINAL = {"compile_backend": models.COMPILE_BACKEND, "standard": experience.ROLLOUT_MODES["standard"],
            "make_scorer": train_rl.make_scorer, "make_sampler": train_rl.make_sampler}


def main(settings: dict | list[dict]):
    for one in settings if isinstance(settings, list) else [settings]:
        run(one)


def run(settings: dict):
    """One run; what an earlier run of the launch patched is put back first."""
    models.COMPILE_BACKEND = settings.get("compile_backend", ORIGINAL["compile_backend"])
    experience.ROLLOUT_MODES["standard"] = scripted_rollouts if settings.get("fixed_rollouts") else ORIGINAL["standard"]
    train_rl.make_scorer, train_rl.make_sampler = ORIGINAL["make_scorer"], ORIGINAL["make_sampler"]
    if settings["script"] == "sft":
        return sft.main(SFTArgs(**settings["args"]))
    args = RLArgs(**settings["args"])
    args.check()
    mixed = None
    if settings.get("uneven"):  # prompts of the first half of each step's questions
        rows = train_rl.load_questions(args, log=lambda *a: None)[0]
        per_step = args.rollout_batch_size // args.group_size
        questions = [q for s in range(args.n_steps) for q in experience.questions_at(rows, s * per_step, per_step // 2, args.seed)]
        mixed = {tuple(ids) for ids in build_prompts(models.load_tokenizer(args.model), questions, args.prompt)[1]}

    def reward(row, truth):
        right = float(len(row.text) % 2) if mixed is None or tuple(row.prompt_ids) in mixed else 0.0
        return {"reward": right, "format_reward": 1.0, "answer_reward": right}
    train_rl.make_scorer = lambda args, rows=(): reward
    made = []
    train_rl.make_sampler = lambda *a, **k: made.append(ORIGINAL["make_sampler"](*a, **k)) or made[-1]
    train_rl.main(args)
    if settings.get("engine_report"):
        report_engine(made[0], args, settings["engine_report"])


@torch.no_grad()
def token_log_probs(model, ids):
    return rollout_log_probs(model, [ids[:1]], [ids[1:]])["log_probs"][0]


def report_engine(engine, args, path):
    """This rank's engine against the final policy: the log-probs of a fixed sequence."""
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    ids = list(range(100, 140))
    [out] = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], VParams(max_tokens=1, prompt_logprobs=0),
                                use_tqdm=False)
    got = torch.tensor([step[token].logprob for token, step in zip(ids[1:], out.prompt_logprobs[1:])])
    final = token_log_probs(models.load_model(f"{args.output_dir}/checkpoint"), ids)
    start = token_log_probs(models.load_model(args.model), ids)
    gaps = {"to_final": (got - final).abs().max().item(), "to_start": (got - start).abs().max().item()}
    with open(f"{path}.{distributed.rank()}", "w") as f:
        json.dump(gaps, f)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
