"""Policy-gradient maths: rewards to advantages, per-token losses, masked reductions, aggregation.

Pure tensor-in, tensor-out functions; the training loop calls them. Nothing here sees a model, a
tokenizer, a file or an args object (logits and tokens live in `alignment/tokens.py`). Names and
arguments follow the reference design (Stanford CS336 assignment 5), so code written against it runs
unchanged; the extensions (clip-higher, KL, other aggregations, dynamic sampling) are keyword-only with
defaults that reproduce the reference.

Shapes: B rows (sequences) in a microbatch, T token positions; A is one advantage per row, (B, 1).
"""

import math
from collections.abc import Callable

import einx
import torch

from alignment.args import LOSS_TYPES  # (the flag's choices, defined where the flags are: args.py imports no torch)
from alignment.estimators import clamped_log_ratio, compute_gspo_loss, kl_penalty
from alignment.user_reward import zero_failed_parts

CLIPPED_LOSSES = ("grpo_clip", "gspo")  # the losses that report clip_fraction
LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm", "trace-length")


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score each response and turn rewards into group-relative advantages (GRPO, DeepSeekMath eq. 3).

    Responses come in consecutive groups of `group_size` that share a prompt. The advantage is the reward
    minus its group mean, divided by (the group's unbiased std + advantage_eps) when normalize_by_std
    (Dr. GRPO drops that division: it up-weights groups that are nearly all right or all wrong). A group
    whose rewards are all equal carries no signal and gets advantage exactly 0; this also covers group
    size 1, where the std is undefined, so no NaN can appear.

    Returns (advantages (N,), raw_rewards (N,), metadata) with the reward mean/std/max/min over all
    responses, the fraction of groups with zero variance, and the mean of every other key reward_fn
    returns (usually format_reward and answer_reward).
    """
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(f"got {len(rollout_responses)} responses but {len(repeated_ground_truths)} "
                         "ground truths; repeat each ground truth once per response")
    if group_size < 1 or len(rollout_responses) % group_size:
        raise ValueError(f"{len(rollout_responses)} responses do not split into groups of {group_size}")
    scores = [reward_fn(r, gt) for r, gt in zip(rollout_responses, repeated_ground_truths)]
    raw_rewards = torch.tensor([s["reward"] for s in scores], dtype=torch.float32)  # (N,)

    n = group_size
    mean = einx.mean("(g n) -> g", raw_rewards, n=n)
    centered = einx.subtract("(g n), g -> (g n)", raw_rewards, mean)
    # Unbiased (n - 1) estimate, written out so it does not depend on a backend's default.
    std = (einx.sum("(g n) -> g", centered**2, n=n) / max(n - 1, 1)).sqrt()
    spread = einx.max("(g n) -> g", raw_rewards, n=n) - einx.min("(g n) -> g", raw_rewards, n=n)
    if normalize_by_std:
        centered = einx.divide("(g n), g -> (g n)", centered, std + advantage_eps)
    # Exact zeros for all-equal groups: float round-off in the mean must not become a signal.
    advantages = einx.where("g, (g n), -> (g n)", spread > 0, centered, 0.0)
    return advantages, raw_rewards, reward_metrics(raw_rewards, scores, group_size)


def reward_metrics(raw_rewards: torch.Tensor, scores: list[dict], group_size: int) -> dict[str, float]:
    """The reward mean/std/max/min over all responses, the fraction of groups whose rewards are all equal,
    and the mean of every other key of the reward dicts `scores` (usually format_reward, answer_reward)."""
    spread = einx.max("(g n) -> g", raw_rewards, n=group_size) - einx.min("(g n) -> g", raw_rewards, n=group_size)
    metadata = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std(correction=0).item(),  # population std: defined for N = 1 too
        "reward_max": raw_rewards.max().item(),
        "reward_min": raw_rewards.min().item(),
        "zero_std_fraction": (spread == 0).float().mean().item(),
    }
    scores = zero_failed_parts(scores)  # a --reward_fn call that failed scored 0, its parts too
    for key in scores[0]:
        if key != "reward":  # a part a --reward_fn did not return is NaN: left out, and NaN when none has it
            present = [float(s[key]) for s in scores if not math.isnan(float(s[key]))]
            metadata[f"{key}_mean"] = sum(present) / len(present) if present else math.nan
    return metadata


def filter_groups(rewards: torch.Tensor, group_size: int, low: float | None = None,
                  high: float | None = None, *, accuracy: torch.Tensor | None = None) -> torch.Tensor:
    """Dynamic sampling (DAPO section 3.2): which responses to keep, as a bool mask (N,).

    Drops every group whose rewards are all equal (its advantages are all 0: it costs compute and adds
    nothing), and, when `low`/`high` are given, every group whose accuracy lies outside [low, high]
    (ZeroTIR trains on 0.2-0.8). Accuracy is the mean of `accuracy` (N,), the 0/1 answer reward, over
    the group; without it the rewards stand in, which is right only for 0/1 rewards (ToRL's +1/-1
    reward has mean 2 * accuracy - 1). The RL loop applies it right after scoring, then samples more
    questions until the batch is full (DAPO's refill).
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    accuracy = rewards if accuracy is None else accuracy
    if accuracy.shape != rewards.shape:
        raise ValueError(f"accuracy {tuple(accuracy.shape)} must match rewards {tuple(rewards.shape)}")
    keep = filter_pools(list(rewards.view(-1, group_size)), list(accuracy.float().view(-1, group_size)), low, high)
    return einx.id("g -> (g n)", keep, n=group_size)


def filter_pools(rewards: list[torch.Tensor], accuracy: list[torch.Tensor], low: float | None = None,
                 high: float | None = None) -> torch.Tensor:
    """`filter_groups`' rule, one group at a time, for groups of any size: keep group g (a bool per group)
    when its rewards differ and the mean of `accuracy[g]` lies in [low, high]. With adaptive groups a group
    is its whole grown pool, not the n answers picked from it: the filter reads the statistic of what it
    filters (a pool of 12 with 1 right has accuracy 1/12, however its picked answers split)."""
    spread = torch.tensor([bool((r.max() - r.min()) > 0) for r in rewards])
    mean_accuracy = torch.tensor([a.float().mean().item() for a in accuracy])
    keep = spread
    if low is not None:
        keep &= mean_accuracy >= low
    if high is not None:
        keep &= mean_accuracy <= high
    return keep


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """sum(tensor * mask) / sum(mask) over `dim` (all elements when None). No epsilon, as in the
    reference: a fully masked row gives 0/0 = NaN. The train steps never call it on rows that may be
    empty; `aggregate_loss` guards its own denominators. Masked positions are selected away with
    torch.where, never multiplied by 0, so an inf or NaN there (0 * inf = NaN) stays out."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return _masked_sum(tensor, mask, dim) / count


def masked_normalize(tensor: torch.Tensor, mask: torch.Tensor, normalize_constant: float,
                     dim: int | None = None) -> torch.Tensor:
    """sum(tensor * mask) over `dim` (all elements when None), divided by a constant."""
    return _masked_sum(tensor, mask, dim) / normalize_constant


def _masked_sum(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of tensor over the positions where mask != 0 (weighted by the mask there)."""
    kept = torch.where(mask.bool(), tensor * mask, torch.zeros((), dtype=tensor.dtype, device=tensor.device))
    return kept.sum() if dim is None else kept.sum(dim)


def compute_naive_policy_gradient_loss(raw_rewards_or_advantages: torch.Tensor,
                                       policy_log_probs: torch.Tensor) -> torch.Tensor:
    """REINFORCE per-token loss -A * log pi(o_t) (B, T); A is (B, 1) (a (B,) vector is accepted) or
    per token, (B, T) (GAE, REINFORCE++). With raw rewards this is vanilla REINFORCE; with group-centred
    rewards, REINFORCE with a baseline."""
    return -_per_row(raw_rewards_or_advantages) * policy_log_probs


def _per_row(advantages: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1); (B, 1) and per-token (B, T) advantages are used as they are."""
    return advantages[:, None] if advantages.dim() == 1 else advantages


def compute_grpo_clip_loss(advantages: torch.Tensor, policy_log_probs: torch.Tensor,
                           old_log_probs: torch.Tensor, cliprange: float, *,
                           cliprange_high: float | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO-clip per-token loss (DeepSeekMath eq. 3, PPO's clipped surrogate) (B, T):

        -min(ratio * A, clip(ratio, 1 - cliprange, 1 + cliprange_high) * A),  ratio = pi / pi_old

    `cliprange_high` defaults to `cliprange`; a larger one is DAPO's clip-higher (section 3.1; 0.2/0.28),
    which leaves low-probability tokens room to grow and slows entropy collapse. metadata["clipped"] is
    a bool (B, T) tensor: True where the clipped term is the smaller one, i.e. the token gets no gradient.
    """
    high = cliprange if cliprange_high is None else cliprange_high
    advantages = _per_row(advantages)  # (B, 1) or (B, T)
    ratio = torch.exp(clamped_log_ratio(policy_log_probs, old_log_probs))  # (B, T)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - cliprange, 1 + high) * advantages
    return -torch.minimum(unclipped, clipped), {"clipped": clipped < unclipped}


def compute_grpo_no_clip_loss(advantages: torch.Tensor, policy_log_probs: torch.Tensor,
                              old_log_probs: torch.Tensor) -> torch.Tensor:
    """GRPO-No-Clip per-token loss (CS336 assignment 5's off-policy clip ablation) (B, T): -ratio * A with
    ratio = pi / pi_old, the importance-weighted policy-gradient objective without PPO's clip. On-policy
    (ratio 1) its gradient is REINFORCE with a baseline's, -A * grad log pi; off-policy nothing bounds
    how far one minibatch can move a token's probability, which is what the ablation measures."""
    return -torch.exp(clamped_log_ratio(policy_log_probs, old_log_probs)) * _per_row(advantages)


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    cliprange_high: float | None = None,
    response_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """Per-token loss (B, T) and metadata for `loss_type`; the one place that branches on it.

    no_baseline uses raw_rewards; reinforce_with_baseline uses advantages; grpo_clip uses advantages,
    old_log_probs, cliprange (and cliprange_high); grpo_no_clip uses advantages and old_log_probs; gspo uses advantages (one per row), old_log_probs,
    cliprange and response_mask (its ratio is a mean over the row). Arguments a loss type does not use
    are ignored.
    """
    if loss_type == "no_baseline":
        _require(loss_type, raw_rewards=raw_rewards)
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    elif loss_type == "reinforce_with_baseline":
        _require(loss_type, advantages=advantages)
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    elif loss_type == "grpo_clip":
        _require(loss_type, advantages=advantages, old_log_probs=old_log_probs, cliprange=cliprange)
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange,
                                      cliprange_high=cliprange_high)
    elif loss_type == "grpo_no_clip":
        _require(loss_type, advantages=advantages, old_log_probs=old_log_probs)
        return compute_grpo_no_clip_loss(advantages, policy_log_probs, old_log_probs), {}
    elif loss_type == "gspo":
        _require(loss_type, advantages=advantages, old_log_probs=old_log_probs, cliprange=cliprange,
                 response_mask=response_mask)
        if advantages.dim() == 2 and advantages.shape[1] > 1:
            raise ValueError("gspo takes one advantage per sequence, not per token; use a sequence-level "
                             "estimator (grpo, rloo)")
        return compute_gspo_loss(advantages, policy_log_probs, old_log_probs, response_mask, cliprange,
                                 cliprange_high=cliprange_high)
    raise ValueError(f"unknown loss_type {loss_type!r}; choose one of {', '.join(LOSS_TYPES)}")


def _require(loss_type: str, **arguments) -> None:
    missing = [name for name, value in arguments.items() if value is None]
    if missing:
        raise ValueError(f"loss_type {loss_type!r} needs {', '.join(missing)}")


def approx_kl(policy_log_probs: torch.Tensor, ref_log_probs: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi || pi_ref): exp(r) - r - 1 with r = log pi_ref - log pi.
    Unbiased and always >= 0 (Schulman, "Approximating KL divergence", 2020; DeepSeekMath eq. 4).
    The other estimators: `estimators.kl_penalty`."""
    return kl_penalty(policy_log_probs, ref_log_probs, "k3")


def loss_weights(
    mode: str,
    response_mask: torch.Tensor,
    *,
    num_rows: float,
    num_tokens: float | None = None,
    max_response_length: int | None = None,
    trace_lengths: torch.Tensor | None = None,
    num_traces: float | None = None,
) -> torch.Tensor:
    """Each row's weight (B,) in the train batch's loss: every aggregation mode is a per-row weight times the
    row's masked token sum, loss = sum_r w_r * sum_t mask * loss (prime-rl's form). The counts are of the
    whole train batch, so the weights are computed once per optimizer step and any split of the rows into
    microbatches sums to the same loss. Rows with no response tokens get a finite weight (their sum is 0).

    - seq-mean-token-mean: 1 / (len_r * num_rows): mean over a row's tokens, then over rows (the reference;
      GRPO, DeepSeekMath eq. 3). Long responses get less weight per token.
    - token-mean: 1 / num_tokens: one mean over every response token of the batch (DAPO section 3.3), so
      long responses are not diluted.
    - seq-mean-token-sum-norm: 1 / (max_response_length * num_rows): a constant normaliser (Dr. GRPO, Liu et
      al. 2025, section 3.1); with normalize_by_std=False it removes both of GRPO's length and difficulty biases.
    - trace-length: 1 / (trace_len * num_traces), where a trace spans several rows (Delethink chunks) and
      `trace_lengths` (B,) is the response length of each row's whole trace: Delethink eq. 3,
      (1/G) sum_traces (1/len(trace)) sum over the trace's rows and tokens.
    """
    lengths = response_mask.sum(-1).double()  # (B,); float64: the weighted sum cancels large terms
    if mode == "seq-mean-token-mean":
        return 1.0 / (lengths.clamp(min=1) * num_rows)
    elif mode == "token-mean":
        return torch.full_like(lengths, 1.0 / (num_tokens or 1))
    elif mode == "seq-mean-token-sum-norm":
        if max_response_length is None:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_length "
                             "(Dr. GRPO's constant normaliser, e.g. the sampling max_tokens)")
        return torch.full_like(lengths, 1.0 / (max_response_length * num_rows))
    elif mode == "trace-length":
        if trace_lengths is None or num_traces is None:
            raise ValueError("loss_agg_mode 'trace-length' needs trace_lengths (B,), the response "
                             "length of each row's whole trace, and num_traces in the train batch")
        return 1.0 / (trace_lengths.to(lengths).clamp(min=1) * num_traces)
    raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")


def weighted_sum(per_token: torch.Tensor, mask: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """sum_r w_r * (masked sum of row r): a per-token loss (B, T) reduced with the weights of `loss_weights`
    (in float64: positive and negative advantages make the terms cancel; the result has per_token's dtype)."""
    row_sums = _masked_sum(per_token, mask.to(per_token.dtype), -1)  # (B,)
    return (row_sums.double() * row_weights.to(row_sums.device, torch.float64)).sum().to(per_token.dtype)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "seq-mean-token-mean",
    *,
    gradient_accumulation_steps: int = 1,
    max_response_length: int | None = None,
    num_tokens: int | None = None,
    trace_lengths: torch.Tensor | None = None,
    num_traces: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to this microbatch's scalar share of the train batch's loss, when the
    batch is `gradient_accumulation_steps` microbatches like this one (the reference's assumption: the row
    count, and for token-mean without `num_tokens` the token count, is this microbatch's times that many).
    Whole-batch counts (`num_tokens`, `num_traces`) are used as given. See `loss_weights` for the modes."""
    weights = _accumulation_weights(mode, mask, gradient_accumulation_steps, max_response_length, num_tokens,
                                    trace_lengths, num_traces)
    return weighted_sum(per_token_loss, mask, weights)


def _accumulation_weights(mode, mask, gradient_accumulation_steps, max_response_length, num_tokens, trace_lengths,
                          num_traces) -> torch.Tensor:
    """`loss_weights` for a microbatch that is one of `gradient_accumulation_steps` alike."""
    if mode == "token-mean" and num_tokens is None:
        num_tokens = mask.sum().clamp(min=1).item() * gradient_accumulation_steps
    return loss_weights(mode, mask, num_rows=mask.shape[0] * gradient_accumulation_steps, num_tokens=num_tokens,
                        max_response_length=max_response_length, trace_lengths=trace_lengths, num_traces=num_traces)


def _mean_over_mask(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """For logging: masked mean that reads 0 on an empty mask instead of NaN; a 0-d tensor on the tensors' device
    (read by the loop once per step, not here: a read is a host sync on a GPU)."""
    return (_masked_sum(tensor, mask) / mask.sum().clamp(min=1)).detach()


def sft_microbatch_train_step(policy_log_probs: torch.Tensor, response_mask: torch.Tensor,
                              gradient_accumulation_steps: int,
                              normalize_constant: float = 1.0) -> tuple[torch.Tensor, dict]:
    """SFT: minus the masked sum of log-probs, divided by normalize_constant, by the batch size and by
    gradient_accumulation_steps; calls backward() (gradients accumulate) and returns (loss, metadata)."""
    batch_size = policy_log_probs.shape[0]
    nll = -masked_normalize(policy_log_probs, response_mask, normalize_constant)
    loss = nll / batch_size / gradient_accumulation_steps
    loss.backward()
    metadata = {"num_response_tokens": response_mask.sum().item(),
                "mean_token_log_prob": _mean_over_mask(policy_log_probs.detach(), response_mask)}
    return loss.detach(), metadata


def policy_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    row_weights: torch.Tensor,
    advantages: torch.Tensor,
    old_log_probs: torch.Tensor | None,
    loss_type: str,
    *,
    cliprange: float | None = None,
    cliprange_high: float | None = None,
    ref_log_probs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = "k3",
    token_entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """One RL microbatch: per-token loss, optional KL penalty and entropy bonus, the weighted row sums of
    `loss_weights`, backward(). Gradients accumulate in place across calls. `advantages` (B, 1) or (B, T)
    are what the loss multiplies: for no_baseline the raw rewards themselves. `rollout_is_weights` (B, T,
    detached; `estimators.compute_rollout_is_weights`) multiply each token's policy-gradient term: the
    correction for a sampler whose distribution differs from the learner's old policy.

    With `ref_log_probs` the mean KL to the reference policy (`kl_estimator` k1, k2 or k3) is reported,
    and `kl_coef` * KL is added to every token's loss (GRPO, DeepSeekMath eq. 3; most recent recipes use
    0). With `entropy_coef` > 0, `entropy_coef` * `token_entropy` (differentiable) is subtracted: an
    entropy bonus (PPO, Schulman et al. 2017, eq. 9).

    Returns (the loss that was backpropagated, detached; metadata with clip_fraction over response tokens
    for the clipped losses, and kl when ref_log_probs is given).
    """
    if kl_coef and ref_log_probs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_log_probs from the frozen reference policy")
    if entropy_coef and token_entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} needs token_entropy (with gradient)")
    per_token_loss, loss_metadata = compute_policy_gradient_loss(
        policy_log_probs, loss_type, advantages, advantages, old_log_probs, cliprange,
        cliprange_high=cliprange_high, response_mask=response_mask)
    if rollout_is_weights is not None:
        if loss_type == "gspo" and _varies_within_rows(rollout_is_weights, response_mask):
            raise ValueError("gspo keeps one weight per sequence: rollout-correction weights that vary along a row "
                             "would weigh its tokens apart (use a sequence or geometric level).")
        per_token_loss = per_token_loss * rollout_is_weights.detach()
    metadata = {}
    if entropy_coef:
        per_token_loss = per_token_loss - entropy_coef * token_entropy
    if ref_log_probs is not None:
        kl = kl_penalty(policy_log_probs, ref_log_probs, kl_estimator)  # (B, T)
        if kl_coef:
            per_token_loss = per_token_loss + kl_coef * kl
        metadata["kl"] = _mean_over_mask(kl.detach(), response_mask)
    if "clipped" in loss_metadata:
        metadata["clip_fraction"] = _mean_over_mask(loss_metadata["clipped"].float(), response_mask)
    loss = weighted_sum(per_token_loss, response_mask, row_weights)
    loss.backward()
    return loss.detach(), metadata


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
    *,
    loss_agg_mode: str = "seq-mean-token-mean",
    cliprange_high: float | None = None,
    kl_coef: float = 0.0,
    ref_log_probs: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    entropy_coef: float = 0.0,
    token_entropy: torch.Tensor | None = None,
    max_response_length: int | None = None,
    num_tokens: int | None = None,
    trace_lengths: torch.Tensor | None = None,
    num_traces: int | None = None,
) -> tuple[torch.Tensor, dict]:
    """The reference's RL microbatch step (CS336): per-token loss, aggregation, backward(); returns (the
    scaled loss, detached; metadata). With the defaults: per-sequence masked mean over tokens, then the
    batch mean, divided by gradient_accumulation_steps. Gradients accumulate in place across calls.

    A thin wrapper over `policy_microbatch_train_step` (what the RL loop calls, with weights computed once
    per train batch): the row weights come from `aggregate_loss`'s rules (pass the whole train batch's
    `num_tokens` / `num_traces`, not the microbatch's), and no_baseline multiplies `raw_rewards`.
    """
    weights = _accumulation_weights(loss_agg_mode, response_mask, gradient_accumulation_steps, max_response_length,
                                    num_tokens, trace_lengths, num_traces)
    # the contract's no_baseline multiplies raw_rewards; the loop passes the raw rewards as its advantages
    signal = raw_rewards if loss_type == "no_baseline" else advantages
    return policy_microbatch_train_step(
        policy_log_probs, response_mask, weights, None if signal is None else _per_row(signal), old_log_probs,
        loss_type, cliprange=cliprange, cliprange_high=cliprange_high, ref_log_probs=ref_log_probs, kl_coef=kl_coef,
        kl_estimator=kl_estimator, token_entropy=token_entropy, entropy_coef=entropy_coef)


def _varies_within_rows(weights: torch.Tensor, mask: torch.Tensor) -> bool:
    """Whether a (B, T) weight differs between the masked positions of one row."""
    mask = mask.bool()
    high = torch.where(mask, weights, torch.full_like(weights, -torch.inf)).amax(-1)
    low = torch.where(mask, weights, torch.full_like(weights, torch.inf)).amin(-1)
    return bool(((high - low) > 1e-6 * high.abs().clamp(min=1))[mask.any(-1)].any())
