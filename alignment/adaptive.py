"""Adaptive group size (`--group_size_max M`): sample a question again while its group shows no reward spread.

A fixed group whose rewards are all equal (every answer right, or every answer wrong) has advantage 0 on
every trace: its samples cost compute and teach nothing. DAPO drops such groups and samples new questions
(`--filter_low/--filter_high`); Reinforce-Ada (Xiong et al. 2025, arXiv 2510.04996) instead keeps sampling
the same question, in rounds, until its pool holds enough right and wrong answers, or has M samples. We
follow its balanced variant, as the authors' code does it (RLHFlow/Reinforce-Ada-Tinker,
`rl/adaptive_sampling.py`: `_should_finish_prompt` and `_downsample_prompt_cache` with strategy "balanced"):
- every question starts with `--group_size` (n) samples; a question whose pool holds fewer than n//2 right
  answers (answer reward 1) or fewer than n - n//2 wrong ones gets n more (fewer in the last round, so the
  pool never exceeds M), until it holds both or has M samples. Samples of a round that arrive after its
  pool became balanced are not added to it (the authors' loop stops reading them); their tokens still
  count as sampled;
- the group it trains on keeps the fixed size n: n//2 right and n - n//2 wrong when the pool has them,
  else as many right ones as the wrong ones leave room for (the authors' fallback), in sampling order;
- its advantages take their baseline from the whole pool (`estimators.pool_statistics`), the "global
  statistics" of the paper: the pool's mean (and std) for grpo, the mean of the other pool members for
  rloo, the pool's mean for reinforce_pp_baseline.
Each round's requests have their own seeds (derived from the run seed, the step, the sampling round and the
growth round; the sampler derives one per request from those), and which questions grow is a function of
earlier rewards only, so a run replays exactly.
"""

import dataclasses
import math

import torch

from alignment.errors import UserError
from alignment.rollout import traces
from alignment.sampling import derive_seed


def grow_groups(args, step: int, sampling_round: int, generate, prompt_ids, params, first_traces, first_scores,
                score) -> tuple[list, list, list[torch.Tensor], dict]:
    """Grow every group of `first_traces` (consecutive groups of n, scored `first_scores`) that is not
    balanced, as the module docstring says. `generate(prompt_ids, params)` runs the rollout mode; `score(trace,
    group)` scores a trace of that group. Returns the n traces per group to train on (in group order), their
    scores, each group's pool of scores (the reward dicts, in sampling order), and the step's numbers:
    samples per question (mean, max), the shares of questions whose pool has reward spread and whose pool
    is balanced, and the sampled tokens of the growth rounds."""
    n, cap = args.group_size, args.group_size_max
    pools = [list(zip(first_traces[g * n:(g + 1) * n], first_scores[g * n:(g + 1) * n]))
             for g in range(len(first_traces) // n)]
    extra_tokens, growth = 0, 0
    while True:
        active = [g for g, pool in enumerate(pools) if not _is_balanced(pool, n) and len(pool) < cap]
        if not active:
            break
        growth += 1
        more = min(n, cap - len(pools[active[0]]))  # every active pool has grown alike
        round_params = dataclasses.replace(params, n=more, seed=derive_seed(args.seed, step, sampling_round,
                                                                            "grow", growth))
        for trace in traces(generate([prompt_ids[g] for g in active], round_params)):
            group = active[trace[-1].group_id]
            for row in trace:  # the question's index in the step, and a trace id of its own
                row.group_id, row.trace_id = group, (len(first_traces) + group * cap + len(pools[group]))
            extra_tokens += sum(sum(row.loss_mask) for row in trace)
            if not _is_balanced(pools[group], n):  # once balanced, the rest of the round is not read
                pools[group].append((trace, score(trace, group)))
    chosen = [_balanced(pool, n) for pool in pools]
    sizes = torch.tensor([len(pool) for pool in pools], dtype=torch.float32)
    metrics = {"samples_per_question": sizes.mean().item(), "samples_per_question_max": sizes.max().item(),
               "spread_fraction": sum(_has_spread(pool) for pool in pools) / len(pools),
               "balanced_fraction": sum(_is_balanced(pool, n) for pool in pools) / len(pools),
               "growth_rounds": growth, "growth_tokens": extra_tokens}
    return ([trace for group in chosen for trace, _ in group], [s for group in chosen for _, s in group],
            [[s for _, s in pool] for pool in pools], metrics)


def _has_spread(pool) -> bool:
    return len({s["reward"] for _, s in pool}) > 1


def _right(score: dict) -> bool:
    if math.isnan(float(score["answer_reward"])):
        raise UserError("--group_size_max grows groups until they hold right and wrong answers, read from each "
                        "answer's answer_reward, which --reward_fn does not return: return it, or drop the flag.")
    return float(score["answer_reward"]) > 0.5


def _is_balanced(pool, n: int) -> bool:
    """The authors' stop rule: at least n//2 right answers and n - n//2 wrong ones."""
    right = sum(_right(s) for _, s in pool)
    return right >= n // 2 and len(pool) - right >= n - n // 2


def _balanced(pool, n: int) -> list:
    """n members of `pool`: n//2 right and n - n//2 wrong when it has them; else as many right ones as the
    wrong ones leave room for (the authors' fallback); each side in sampling order."""
    right = [i for i, (_, s) in enumerate(pool) if _right(s)]
    wrong = [i for i, (_, s) in enumerate(pool) if not _right(s)]
    take_right = min(len(right), max(n // 2, n - len(wrong)))
    return [pool[i] for i in sorted(right[:take_right] + wrong[:n - take_right])]
