"""More policy-gradient maths: advantage estimators beyond group normalisation, GSPO, the value loss, KL
estimators. Pure tensor functions, like `alignment/grpo.py` (this is its sibling, so that neither file
outgrows one sitting); the RL loop picks an estimator by name in one place.

Shapes: B rows, T token positions; `response_mask` (B, T) is 1 on the tokens the policy sampled and 0 on
padding and on forced tokens (tool output). "Over a row's unmasked tokens" means as if the masked ones
were not there: masked tool output in the middle of a response does not cut a recursion.
"""

import math

import einx
import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
LOG_RATIO_LIMIT = 20.0  # exp(20) = 4.9e8: a ratio past this is a bug or a masked slot, never a signal


def clamped_log_ratio(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """log(p / q), clamped before any exp: an inf at a masked position (a forced token the policy
    gives probability 0) must not overflow to inf, whose gradient through torch.where is NaN."""
    return (numerator - denominator).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def whiten(values: torch.Tensor, mask: torch.Tensor, total=float) -> torch.Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the unmasked entries (population variance); 0 where masked.
    `total(x)` turns a sum over this batch into the sum over the whole batch: the identity in one process,
    a sum over ranks under torchrun (`distributed.global_sum`; every rank calls it, also with no rows)."""
    kept = mask.bool()
    count = total(kept.sum().item())
    if count == 0:
        return torch.zeros_like(values)
    kept_values = values[kept].double()
    mean = total(kept_values.sum().item()) / count
    var = total(((kept_values - mean) ** 2).sum().item()) / count
    return torch.where(kept, (values - mean) / math.sqrt(var + 1e-8), torch.zeros_like(values))


def _scan_unmasked_backwards(step, response_mask: torch.Tensor, carry: list[torch.Tensor]) -> torch.Tensor:
    """Run `value_t, carry = step(t, carry)` from the last position to the first; masked positions are
    skipped (their output is 0 and the carry passes through them unchanged). Vectorised over rows."""
    out = torch.zeros(response_mask.shape, dtype=carry[0].dtype, device=carry[0].device)  # (B, T)
    for t in reversed(range(response_mask.shape[1])):
        keep = response_mask[:, t].bool()  # (B,)
        value, new_carry = step(t, carry)
        out[:, t] = torch.where(keep, value, torch.zeros_like(value))
        carry = [torch.where(keep, new, old) for new, old in zip(new_carry, carry)]
    return out


def compute_gae_advantages(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor,
                           gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016, eq. 16) over each row's unmasked tokens:

        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next,   returns = A + V

    where "next" is the row's next unmasked token, and V after the last one is 0 (the episode ends).
    Returns (advantages, returns), both (B, T), 0 at masked positions; raw (whiten separately if wanted).
    With gamma = lam = 1 and V = 0, A_t is the return-to-go.
    """
    values = values.to(token_rewards.dtype)
    zeros = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)

    def step(t, carry):
        next_value, next_advantage = carry
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        return advantage, [values[:, t], advantage]
    advantages = _scan_unmasked_backwards(step, response_mask, [zeros, zeros])
    returns = torch.where(response_mask.bool(), advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def compute_rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out (Kool et al. 2019; Ahmadian et al. 2024): each reward minus the mean of the
    other n - 1 rewards of its consecutive group. (N,); all zeros for group size 1 (no other sample)."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if group_size == 1:
        return torch.zeros_like(rewards, dtype=torch.float32)
    rewards = rewards.float()
    total = einx.sum("(g n) -> g", rewards, n=group_size)
    others = einx.subtract("g, (g n) -> (g n)", total, rewards) / (group_size - 1)
    return rewards - others


def pool_statistics(rewards: torch.Tensor, pools: list[torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """Baselines from each group's whole pool (adaptive groups, alignment/adaptive.py: the question's every
    sampled reward; the trained group is a subset of it). `rewards` (N,) in consecutive groups of
    `group_size`, `pools[g]` group g's pool. Returns (N,) tensors: the pool's `mean`, unbiased `std` (0 for a
    pool of one), `spread` (max - min), and `leave_one_out`: the mean of the pool without this trace (RLOO;
    the trace's own reward if the pool has no other member). With pools equal to the groups these are the
    fixed-group baselines of compute_group_normalized_rewards, compute_rloo_advantages and subtract_group_mean."""
    if len(pools) * group_size != rewards.numel():
        raise ValueError(f"{rewards.numel()} rewards do not split into {len(pools)} groups of {group_size}")
    rewards = rewards.float()
    per_group = torch.tensor([[p.float().mean(), p.float().std() if len(p) > 1 else 0.0, p.float().sum(), len(p),
                               p.max() - p.min()] for p in pools], dtype=torch.float32).repeat_interleave(group_size, 0)
    mean, std, total, count, spread = per_group.unbind(-1)
    others = torch.where(count > 1, (total - rewards) / (count - 1).clamp(min=1), rewards)
    return {"mean": mean, "std": std, "spread": spread, "leave_one_out": others}


def subtract_group_mean(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each reward minus its consecutive group's mean (REINFORCE++-baseline's first step), (N,)."""
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    rewards = rewards.float()
    return einx.subtract("(g n), g -> (g n)", rewards, einx.mean("(g n) -> g", rewards, n=group_size))


def compute_reinforce_pp_advantages(token_rewards: torch.Tensor, response_mask: torch.Tensor,
                                    gamma: float = 1.0, total=float) -> torch.Tensor:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): the discounted return-to-go over each row's unmasked
    tokens, whitened over every unmasked token of the batch: (G - mean) / sqrt(var + 1e-8), population
    variance. (B, T), 0 at masked positions. For REINFORCE++-baseline pass token rewards built from
    `subtract_group_mean` of the scalar rewards. `total`: see `whiten` (the batch may span ranks)."""
    zeros = torch.zeros(token_rewards.shape[0], dtype=token_rewards.dtype, device=token_rewards.device)

    def step(t, carry):
        ret = token_rewards[:, t] + gamma * carry[0]
        return ret, [ret]
    returns = _scan_unmasked_backwards(step, response_mask, [zeros])
    return whiten(returns, response_mask, total)


def outcome_token_rewards(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token rewards with each row's scalar reward on its last unmasked token, 0 elsewhere."""
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(-1).values  # (B,); -1 for an empty row
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rows = (last >= 0).nonzero().flatten()
    out[rows, last[rows]] = rewards.float().to(mask.device)[rows]
    return out


def compute_gspo_loss(advantages: torch.Tensor, policy_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                      response_mask: torch.Tensor, cliprange: float, *,
                      cliprange_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7 and GSPO-token eq. 13): a sequence-level ratio

        s = exp(mean over the row's response tokens of (logp - old_logp)),   J = min(s A, clip(s, 1-eps, 1+eps) A)

    Per token the ratio is s_t = sg[s] * exp(logp_t - sg[logp_t]): equal to s in value, with gradient
    sg[s] * grad logp_t. So the per-token loss -min(s_t A, clip(s_t) A) has a masked per-row mean equal to
    -J, and its gradient equals the gradient of -J (all tokens of a row clip together). A is (B,) or
    (B, 1). `cliprange_high` (default `cliprange`) is the upper side (the paper: 3e-4 below, 4e-4 above).
    metadata["clipped"] (B, T) marks the tokens of clipped rows."""
    advantages = advantages.reshape(-1, 1)  # (B, 1)
    mask = response_mask.bool()
    delta = torch.where(mask, policy_log_probs - old_log_probs, torch.zeros_like(policy_log_probs))
    mean_log_ratio = delta.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    sequence_ratio = torch.exp(mean_log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    token_log_probs = torch.where(mask, policy_log_probs, torch.zeros_like(policy_log_probs))
    ratio = sequence_ratio.detach() * torch.exp(token_log_probs - token_log_probs.detach())  # (B, T)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cliprange, 1 + (cliprange if cliprange_high is None else cliprange_high)) * advantages
    return -torch.minimum(unclipped, clipped), {"clipped": (clipped < unclipped) & mask}


def compute_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       response_mask: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, dict]:
    """PPO's clipped value loss (B, T): 0.5 * max((V - R)^2, (old_V + clip(V - old_V, -eps, eps) - R)^2).
    metadata["clipped"] marks where the clipped term is the larger one (the value gets no gradient)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    plain, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), {"clipped": (clipped > plain) & response_mask.bool()}


def kl_penalty(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman, "Approximating KL divergence",
    2020), with r = log pi_ref - log pi clamped to [-20, 20] before any exp:
    k1 = -r (unbiased, can be negative), k2 = r^2 / 2 (biased, low variance), k3 = exp(r) - r - 1
    (unbiased, >= 0; DeepSeekMath eq. 4).

    As values (a reward penalty, a logged number) all three estimate KL(pi || pi_ref). As loss terms
    their gradients differ: k1's has expectation 0 (noise only; args refuse it there), k2's is the
    gradient of KL(pi || pi_ref), and k3's is in expectation the gradient of KL(pi_ref || pi), the other
    direction (DeepSeekMath's choice)."""
    log_ratio = clamped_log_ratio(ref_log_probs, policy_log_probs)
    if estimator == "k1":
        return -log_ratio
    elif estimator == "k2":
        return 0.5 * log_ratio**2
    elif estimator == "k3":
        return torch.exp(log_ratio) - log_ratio - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")


def explained_variance(values: torch.Tensor, returns: torch.Tensor, response_mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the unmasked tokens: 1 is a perfect critic, 0 no better than a constant."""
    mask = response_mask.bool()
    if mask.sum() < 2:
        return float("nan")
    v, r = values[mask].float(), returns[mask].float()
    var = r.var(correction=0)
    return (1 - (r - v).var(correction=0) / var).item() if var > 0 else float("nan")


ROLLOUT_IS_MODES = ("none", "truncate", "mask")
ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")


def compute_rollout_is_weights(old_log_probs: torch.Tensor, sampler_log_probs: torch.Tensor,
                               response_mask: torch.Tensor, mode: str, level: str, threshold: float,
                               sequence_log_ratio: torch.Tensor | None = None,
                               sequence_tokens: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Rollout correction: importance weights (B, T) of the learner's old policy against the behaviour
    policy, the sampler that actually drew the tokens (its own log-probs: another kernel, bf16, an older
    weight version). The policy-gradient loss of each token is multiplied by its weight.

    ratio = exp(old - sampler) per token (`level` token); or one ratio per sequence on each of its tokens:
    exp of the masked sum of that difference (`level` sequence: the product of the token ratios), or of its
    masked mean (`level` geometric: their geometric mean, length-normalised as GSPO's own ratio is, so a
    long row is not cut more often for its length). A sequence is a row, or, with `sequence_log_ratio`
    and `sequence_tokens` (B,), whatever those sums were taken over (a Delethink trace's rows: its chunks
    share one ratio). Computed in log space, so nothing overflows.
    `mode` truncate: min(ratio, threshold) (truncated IS, "TIS"; the Delethink recipe uses 2); mask: 1 where
    1/threshold <= ratio <= threshold, else 0 ("MIS"); none: 1. Weights are detached, 0 where the mask is 0,
    and finite whatever a masked position holds (inf, NaN). Metrics over the response tokens:
    rollout_is_weight_mean and rollout_is_clipped_fraction (the share truncated or masked)."""
    if mode not in ROLLOUT_IS_MODES or level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout correction mode {mode!r} / level {level!r}: choose a mode of "
                         f"{', '.join(ROLLOUT_IS_MODES)} and a level of {', '.join(ROLLOUT_IS_LEVELS)}")
    if threshold <= 1 and mode != "none":
        raise ValueError(f"the rollout correction threshold must be above 1, got {threshold}")
    mask = response_mask.bool()
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    log_ratio = torch.where(mask, old_log_probs.detach().float() - sampler_log_probs.float(), zero)  # (B, T)
    if level != "token":
        total = log_ratio.sum(-1) if sequence_log_ratio is None else sequence_log_ratio.float()  # (B,)
        if level == "geometric":
            count = mask.sum(-1) if sequence_tokens is None else sequence_tokens
            total = total / count.clamp(min=1)
        log_ratio = torch.where(mask, total.unsqueeze(-1).expand_as(log_ratio), zero)
    limit = math.log(threshold) if mode != "none" else math.inf
    if mode == "truncate":
        weights, cut = torch.exp(log_ratio.clamp(max=limit)), log_ratio > limit
    elif mode == "mask":
        cut = log_ratio.abs() > limit
        weights = torch.where(cut, zero, torch.ones_like(log_ratio))
    else:
        weights, cut = torch.ones_like(log_ratio), torch.zeros_like(mask)
    weights = torch.where(mask, weights, zero)
    tokens = mask.sum().clamp(min=1)
    return weights, {"rollout_is_weight_mean": weights.sum() / tokens,  # 0-d tensors: read once per step
                     "rollout_is_clipped_fraction": (cut & mask).sum() / tokens}


def sampler_mismatch(sampler_log_probs: torch.Tensor, log_probs: torch.Tensor, mask: torch.Tensor,
                     min_tokens: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of |sampler - learner| log-prob, tokens counted) over sampled tokens the sampler reported (NaN: none),
    a numerics gap between two views of one distribution. Left out: each row's first `min_tokens` sampled tokens,
    where --sampling_min_tokens banned EOS, so the sampler drew from a renormalised distribution (a real
    difference of distributions, which rollout correction weighs, not a mismatch of numerics)."""
    seen = mask.bool() & ~sampler_log_probs.isnan() & (mask.cumsum(-1) > min_tokens)  # (B, T)
    difference = torch.where(seen, (sampler_log_probs - log_probs).abs(), 0.0)  # where: a NaN stays out
    return difference.sum(), seen.sum()
