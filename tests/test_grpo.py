"""Policy-gradient maths: hand-computed tiny tensors, and loops against the vectorised code."""

import math

import pytest
import torch

from alignment.grpo import (LOSS_AGG_MODES, aggregate_loss, approx_kl, compute_grpo_clip_loss,
                            compute_grpo_no_clip_loss, compute_group_normalized_rewards, compute_naive_policy_gradient_loss,
                            compute_policy_gradient_loss, filter_groups, grpo_microbatch_train_step, loss_weights,
                            masked_mean, masked_normalize, policy_microbatch_train_step, sft_microbatch_train_step,
                            weighted_sum)


def exact_match_reward(response, ground_truth):
    correct = float(response == ground_truth)
    return {"format_reward": 1.0, "answer_reward": correct, "reward": correct}


def reward_of_response(response, ground_truth):
    return {"reward": float(response)}


# ---- advantages -----------------------------------------------------------------------------------

def test_group_normalized_rewards_by_hand():
    responses = ["a", "b", "a", "a", "x", "y"]  # groups: [1, 0, 1] and [1, 0, 0]
    adv, raw, meta = compute_group_normalized_rewards(exact_match_reward, responses, ["a"] * 6,
                                                      group_size=3, advantage_eps=0.0,
                                                      normalize_by_std=True)
    assert raw.tolist() == [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    # group [1, 0, 1]: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected = [(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s, (2 / 3) / s, (-1 / 3) / s, (-1 / 3) / s]
    torch.testing.assert_close(adv, torch.tensor(expected))
    assert meta["reward_mean"] == pytest.approx(0.5)
    assert meta["reward_std"] == pytest.approx(0.5)
    assert (meta["reward_max"], meta["reward_min"]) == (1.0, 0.0)
    assert meta["zero_std_fraction"] == 0.0
    assert meta["format_reward_mean"] == 1.0 and meta["answer_reward_mean"] == pytest.approx(0.5)


def test_group_normalized_rewards_without_std_and_with_eps():
    responses = ["3", "1", "0", "0"]
    adv, _, _ = compute_group_normalized_rewards(reward_of_response, responses, [""] * 4, 2, 0.1,
                                                 normalize_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([1.0, -1.0, 0.0, 0.0]))
    adv, _, meta = compute_group_normalized_rewards(reward_of_response, responses, [""] * 4, 2, 0.1,
                                                    normalize_by_std=True)
    std = math.sqrt(2.0)  # group [3, 1]: deviations +-1, unbiased variance 2
    torch.testing.assert_close(adv, torch.tensor([1 / (std + 0.1), -1 / (std + 0.1), 0.0, 0.0]))
    assert meta["zero_std_fraction"] == 0.5
    assert "format_reward_mean" not in meta


@pytest.mark.parametrize("normalize_by_std", [True, False])
def test_all_equal_rewards_and_group_size_one_give_zero_not_nan(normalize_by_std):
    # 0.1 is not exact in binary: the group mean may differ from the rewards by round-off.
    responses = ["0.1"] * 3 + ["1"] * 3
    adv, _, meta = compute_group_normalized_rewards(reward_of_response, responses, [""] * 6, 3, 0.0,
                                                    normalize_by_std)
    assert adv.tolist() == [0.0] * 6
    assert meta["zero_std_fraction"] == 1.0
    adv, raw, meta = compute_group_normalized_rewards(reward_of_response, ["1", "0", "0.5"],
                                                      [""] * 3, 1, 0.0, normalize_by_std)
    assert adv.tolist() == [0.0] * 3 and raw.tolist() == [1.0, 0.0, 0.5]
    assert meta["zero_std_fraction"] == 1.0 and not math.isnan(meta["reward_std"])


def test_group_normalized_rewards_rejects_bad_shapes():
    with pytest.raises(ValueError, match="groups of 2"):
        compute_group_normalized_rewards(reward_of_response, ["1"] * 3, [""] * 3, 2, 1e-6, True)
    with pytest.raises(ValueError, match="ground truths"):
        compute_group_normalized_rewards(reward_of_response, ["1"] * 4, [""] * 2, 2, 1e-6, True)


def test_filter_groups():
    rewards = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 0])  # groups of 4
    # accuracies 1.0, 0.0, 0.25, 0.75; the first two have zero variance
    keep = filter_groups(rewards, 4)
    assert keep.tolist() == [False] * 8 + [True] * 8
    keep = filter_groups(rewards, 4, low=0.3, high=0.8)
    assert keep.tolist() == [False] * 12 + [True] * 4
    keep = filter_groups(rewards, 4, high=0.5)
    assert keep.tolist() == [False] * 8 + [True] * 4 + [False] * 4
    assert filter_groups(torch.tensor([1.0, 0.0]), 1).tolist() == [False, False]
    with pytest.raises(ValueError):
        filter_groups(rewards, 3)


def test_filter_groups_bounds_are_on_accuracy_not_on_plus_minus_one_rewards():
    accuracy = torch.tensor([1.0, 1, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 1, 1, 1, 0])  # 1.0, 0.0, 0.25, 0.75
    rewards = 2 * accuracy - 1  # ToRL's +1 / -1: group means 1, -1, -0.5, 0.5
    keep = filter_groups(rewards, 4, low=0.2, high=0.8, accuracy=accuracy)
    assert keep.tolist() == [False] * 8 + [True] * 8  # both mixed groups have accuracy in [0.2, 0.8]
    keep = filter_groups(rewards, 4, low=0.0, accuracy=accuracy)  # low 0 drops only all-equal groups
    assert keep.tolist() == [False] * 8 + [True] * 8
    keep = filter_groups(rewards, 4, high=0.5, accuracy=accuracy)
    assert keep.tolist() == [False] * 8 + [True] * 4 + [False] * 4


# ---- masked reductions ----------------------------------------------------------------------------

def test_masked_mean_and_normalize_by_hand():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 1]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 6) / 3)
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 6.0]))
    torch.testing.assert_close(masked_mean(x, mask, dim=0), torch.tensor([1.0, 2.0, 6.0]))
    assert masked_normalize(x, mask, 2.0).item() == pytest.approx(4.5)
    torch.testing.assert_close(masked_normalize(x, mask, 4.0, dim=1), torch.tensor([0.75, 1.5]))
    torch.testing.assert_close(masked_normalize(x, mask.bool(), 1.0, dim=0), torch.tensor([1.0, 2.0, 6.0]))


def test_masked_mean_of_fully_masked_row_is_nan():
    # The contract has no epsilon: 0/0. aggregate_loss is what guards empty rows.
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = masked_mean(x, torch.tensor([[1, 0], [0, 0]]), dim=1)
    assert out[0].item() == 1.0 and math.isnan(out[1].item())


# ---- per-token losses -----------------------------------------------------------------------------

def test_naive_policy_gradient_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -3.0]])
    out = compute_naive_policy_gradient_loss(torch.tensor([[2.0], [-1.0]]), logp)
    torch.testing.assert_close(out, torch.tensor([[2.0, 4.0], [-0.5, -3.0]]))
    # a (B,) vector means one value per row, never a broadcast over positions
    torch.testing.assert_close(compute_naive_policy_gradient_loss(torch.tensor([2.0, -1.0]), logp), out)


def clip_case():
    ratios = torch.tensor([[1.5, 0.5, 1.1], [1.5, 0.5, 1.1]])
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]])
    return torch.tensor([[1.0], [-1.0]]), old + ratios.log(), old


def test_grpo_clip_loss_by_hand():
    adv, logp, old = clip_case()
    loss, meta = compute_grpo_clip_loss(adv, logp, old, 0.2)
    # A=+1: min(r, clip(r)) = 1.2, 0.5, 1.1.  A=-1: min(-r, -clip(r)) = -1.5, -0.8, -1.1.
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]]))
    assert meta["clipped"].tolist() == [[True, False, False], [False, True, False]]


def test_grpo_clip_higher_by_hand():
    adv, logp, old = clip_case()
    loss, meta = compute_grpo_clip_loss(adv, logp, old, 0.2, cliprange_high=0.6)
    torch.testing.assert_close(loss, torch.tensor([[-1.5, -0.5, -1.1], [1.5, 0.8, 1.1]]))
    assert meta["clipped"].tolist() == [[False, False, False], [False, True, False]]
    loss, _ = compute_grpo_clip_loss(adv, logp, old, 0.2, cliprange_high=0.28)
    assert loss[0, 0].item() == pytest.approx(-1.28)


def test_grpo_no_clip_loss_by_hand():
    adv, logp, old = clip_case()
    # -ratio * A with ratios 1.5, 0.5, 1.1: nothing is clipped, whatever the sign of A
    torch.testing.assert_close(compute_grpo_no_clip_loss(adv, logp, old),
                               torch.tensor([[-1.5, -0.5, -1.1], [1.5, 0.5, 1.1]]))
    torch.testing.assert_close(compute_grpo_no_clip_loss(adv[:, 0], logp, old),  # (B,) advantages too
                               compute_grpo_no_clip_loss(adv, logp, old))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grpo_no_clip_step_equals_a_loop_over_tokens(seed):
    """Loss and gradient of the loop's step on random masks against a plain loop: per row, the mean over its
    response tokens of -exp(logp - old) * A, then the mean over rows (the default aggregation)."""
    _, mask, _ = random_batch(seed)
    g = torch.Generator().manual_seed(seed + 10)
    logp = (-torch.rand(mask.shape, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.5 * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape[0], 1, generator=g)
    weights = loss_weights("seq-mean-token-mean", mask, num_rows=mask.shape[0])
    loss, meta = policy_microbatch_train_step(logp, mask, weights, adv, old, "grpo_no_clip")
    assert "clip_fraction" not in meta  # nothing is clipped; the log line reads 0
    expected, grad = 0.0, torch.zeros_like(logp)
    rows, positions = mask.shape
    for r in range(rows):
        tokens = [t for t in range(positions) if mask[r, t]]
        for t in tokens:
            ratio = math.exp(logp[r, t].item() - old[r, t].item())
            expected += -ratio * adv[r, 0].item() / len(tokens) / rows
            grad[r, t] = -ratio * adv[r, 0].item() / len(tokens) / rows  # d(ratio)/d(logp) = ratio
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    torch.testing.assert_close(logp.grad, grad)


def test_grpo_no_clip_on_policy_gradient_is_reinforce_with_baselines():
    """On-policy (old = current, detached) the ratio is 1 and its gradient is grad log pi: the step equals
    reinforce_with_baseline's, through the logits; off-policy the gradient is scaled by the ratio, unclipped
    where grpo_clip gives 0."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 9, generator=g, requires_grad=True)
    labels = torch.randint(0, 9, (3, 4), generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]])
    adv = torch.tensor([[0.7], [-1.2], [0.4]])
    weights = loss_weights("seq-mean-token-mean", mask, num_rows=3)

    def gradient(loss_type, shift=0.0):
        logits.grad = None
        logp = torch.log_softmax(logits, -1).gather(-1, labels[..., None]).squeeze(-1)  # (B, T)
        policy_microbatch_train_step(logp, mask, weights, adv, logp.detach() - shift, loss_type, cliprange=0.2)
        return logits.grad.clone()
    no_clip = gradient("grpo_no_clip")
    torch.testing.assert_close(no_clip, gradient("reinforce_with_baseline"))
    assert no_clip.abs().sum() > 0
    # off-policy, every ratio exp(1): no_clip scales the on-policy gradient by e; grpo_clip (ratio far past
    # 1.2) gives 0 for A > 0 and keeps the A < 0 row unchanged
    torch.testing.assert_close(gradient("grpo_no_clip", shift=1.0), math.e * no_clip)
    clipped = gradient("grpo_clip", shift=1.0)
    assert clipped[[0, 2]].abs().sum() == 0 and clipped[1].abs().sum() > 0


def test_policy_gradient_loss_dispatch():
    adv, logp, old = clip_case()
    rewards = torch.tensor([[3.0], [0.0]])
    junk = torch.full_like(logp, float("nan"))  # unused arguments must be ignored
    out, meta = compute_policy_gradient_loss(logp, "no_baseline", rewards, junk, junk, 0.2)
    torch.testing.assert_close(out, -rewards * logp)
    assert meta == {}
    out, _ = compute_policy_gradient_loss(logp, "reinforce_with_baseline", junk, adv, junk, 0.2)
    torch.testing.assert_close(out, -adv * logp)
    out, meta = compute_policy_gradient_loss(logp, "grpo_clip", junk, adv, old, 0.2)
    torch.testing.assert_close(out, compute_grpo_clip_loss(adv, logp, old, 0.2)[0])
    assert meta["clipped"].any()
    out, meta = compute_policy_gradient_loss(logp, "grpo_no_clip", junk, adv, old, junk)
    torch.testing.assert_close(out, compute_grpo_no_clip_loss(adv, logp, old))
    assert meta == {}
    with pytest.raises(ValueError, match="needs old_log_probs"):
        compute_policy_gradient_loss(logp, "grpo_no_clip", advantages=adv)
    with pytest.raises(ValueError, match="no_baseline, reinforce_with_baseline, grpo_clip"):
        compute_policy_gradient_loss(logp, "ppo", rewards, adv, old, 0.2)
    with pytest.raises(ValueError, match="old_log_probs"):
        compute_policy_gradient_loss(logp, "grpo_clip", advantages=adv, cliprange=0.2)


def test_k3_kl_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    # r = log(0.25 / 0.5): exp(r) - r - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(approx_kl(logp, ref), torch.tensor([[0.5 + math.log(2) - 1, 0.0]]))


# ---- aggregation: hand-computed, loops, microbatches ----------------------------------------------

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [0, 0, 1], [0, 0, 0]])  # the last row is fully masked


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("seq-mean-token-mean", {}, (1.5 + 6.0 + 0.0) / 3),
    ("token-mean", {}, (1 + 2 + 6) / 3),
    ("token-mean", {"num_tokens": 9}, (1 + 2 + 6) / 9),
    ("seq-mean-token-sum-norm", {"max_response_length": 4}, (3 / 4 + 6 / 4 + 0) / 3),
    # rows 0 and 1 form one trace of length 3, row 2 a trace of its own (length 0); G = 2
    ("trace-length", {"trace_lengths": torch.tensor([3, 3, 0]), "num_traces": 2}, (9 / 3 + 0) / 2),
])
def test_aggregate_loss_by_hand(mode, kwargs, expected):
    assert aggregate_loss(LOSS, MASK, mode, **kwargs).item() == pytest.approx(expected)
    scaled = aggregate_loss(LOSS, MASK, mode, gradient_accumulation_steps=2, **kwargs).item()
    whole_batch_normaliser = "num_tokens" in kwargs or mode == "trace-length"
    assert scaled == pytest.approx(expected if whole_batch_normaliser else expected / 2)


def test_aggregate_loss_errors():
    with pytest.raises(ValueError, match="token-mean, seq-mean-token-sum-norm"):
        aggregate_loss(LOSS, MASK, "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        aggregate_loss(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="trace_lengths"):
        aggregate_loss(LOSS, MASK, "trace-length")


def random_batch(seed, rows=8, positions=7, traces=3):
    g = torch.Generator().manual_seed(seed)
    loss = torch.randn(rows, positions, generator=g)
    mask = (torch.rand(rows, positions, generator=g) < 0.6).long()
    mask[1] = 0  # always one fully masked row
    trace_of_row = torch.randint(0, traces, (rows,), generator=g)
    trace_of_row[:traces] = torch.arange(traces)  # every trace has at least one row
    return loss, mask, trace_of_row


def loop_aggregate(loss, mask, mode, max_len, trace_of_row):
    rows, positions = loss.shape
    sums = [sum(loss[r, t].item() for t in range(positions) if mask[r, t]) for r in range(rows)]
    counts = [sum(int(mask[r, t]) for t in range(positions)) for r in range(rows)]
    if mode == "seq-mean-token-mean":
        return sum(s / c if c else 0.0 for s, c in zip(sums, counts)) / rows
    if mode == "token-mean":
        return sum(sums) / sum(counts)
    if mode == "seq-mean-token-sum-norm":
        return sum(s / max_len for s in sums) / rows
    # trace-length: (1/G) sum over traces of (1/len(trace)) sum over its rows and tokens
    traces = sorted(set(trace_of_row.tolist()))
    total = 0.0
    for trace in traces:
        members = [r for r in range(rows) if trace_of_row[r] == trace]
        length = sum(counts[r] for r in members)
        total += sum(sums[r] for r in members) / length if length else 0.0
    return total / len(traces)


def trace_arguments(mask, trace_of_row):
    per_trace = torch.zeros(int(trace_of_row.max()) + 1).index_add_(0, trace_of_row, mask.sum(-1).float())
    return {"trace_lengths": per_trace[trace_of_row], "num_traces": len(set(trace_of_row.tolist())),
            "max_response_length": 10, "num_tokens": int(mask.sum())}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_aggregate_loss_equals_loop(mode, seed):
    loss, mask, trace_of_row = random_batch(seed)
    kwargs = trace_arguments(mask, trace_of_row)
    if mode == "token-mean":
        del kwargs["num_tokens"]  # the default (this batch's own count) must equal the loop too
    expected = loop_aggregate(loss, mask, mode, 10, trace_of_row)
    assert aggregate_loss(loss, mask, mode, **kwargs).item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_microbatches_accumulate_to_the_big_batch_gradient(mode):
    _, mask, trace_of_row = random_batch(3)
    g = torch.Generator().manual_seed(4)
    logp = (-torch.rand(mask.shape, generator=g) * 3).requires_grad_()
    old = (logp.detach() + 0.3 * torch.randn(mask.shape, generator=g))
    adv = torch.randn(mask.shape[0], 1, generator=g)
    kwargs = trace_arguments(mask, trace_of_row)

    def step(rows, accumulation_steps):
        per_row = {k: v[rows] if k == "trace_lengths" else v for k, v in kwargs.items()}
        loss, _ = grpo_microbatch_train_step(logp[rows], mask[rows], accumulation_steps, "grpo_clip",
                                             None, adv[rows], old[rows], 0.2, loss_agg_mode=mode,
                                             **per_row)
        return loss.item()

    big_loss = step(slice(None), 1)
    big_grad = logp.grad.clone()
    logp.grad = None
    small_losses = [step(slice(i, i + 2), 4) for i in range(0, 8, 2)]  # traces straddle microbatches
    assert sum(small_losses) == pytest.approx(big_loss, rel=1e-5)
    torch.testing.assert_close(logp.grad, big_grad)
    assert big_loss == pytest.approx(loop_aggregate(
        compute_grpo_clip_loss(adv, logp.detach(), old, 0.2)[0], mask, mode, 10, trace_of_row), rel=1e-5)


@pytest.mark.parametrize("mode, kwargs, expected", [
    ("seq-mean-token-mean", {}, [1 / (2 * 3), 1 / (1 * 3), 1 / 3]),  # 1 / (len_r * rows), len clamped to 1
    ("token-mean", {"num_tokens": 3}, [1 / 3] * 3),
    ("seq-mean-token-sum-norm", {"max_response_length": 4}, [1 / (4 * 3)] * 3),
    ("trace-length", {"trace_lengths": torch.tensor([3, 3, 0]), "num_traces": 2}, [1 / 6, 1 / 6, 1 / 2]),
])
def test_loss_weights_by_hand(mode, kwargs, expected):
    weights = loss_weights(mode, MASK, num_rows=3, **kwargs)
    torch.testing.assert_close(weights, torch.tensor(expected, dtype=torch.float64))
    assert weighted_sum(LOSS, MASK, weights).item() == pytest.approx(aggregate_loss(LOSS, MASK, mode, **kwargs).item())


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_weights_computed_once_make_any_microbatch_split_exact(mode):
    """The loop's step: weights from the whole train batch's counts, then microbatches of uneven sizes (the
    reference's gradient_accumulation_steps division is exact only for equal ones) sum to the batch's
    loss and gradient, and equal the hand-written loop over the batch."""
    _, mask, trace_of_row = random_batch(5)
    g = torch.Generator().manual_seed(6)
    logp = (-torch.rand(mask.shape, generator=g) * 3).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape[0], 1, generator=g)
    counts = trace_arguments(mask, trace_of_row)
    weights = loss_weights(mode, mask, num_rows=mask.shape[0], **counts)

    def step(rows):
        loss, _ = policy_microbatch_train_step(logp[rows], mask[rows], weights[rows], adv[rows], old[rows],
                                               "grpo_clip", cliprange=0.2)
        return loss.item()
    big_loss = step(list(range(8)))
    big_grad, logp.grad = logp.grad.clone(), None
    parts = [[0], [1, 2, 3], [4, 5, 6, 7]]  # uneven, and traces straddle them
    assert sum(step(rows) for rows in parts) == pytest.approx(big_loss, rel=1e-6)
    torch.testing.assert_close(logp.grad, big_grad)
    per_token = compute_grpo_clip_loss(adv, logp.detach(), old, 0.2)[0]
    assert big_loss == pytest.approx(loop_aggregate(per_token, mask, mode, 10, trace_of_row), rel=1e-6)


def test_the_loop_step_equals_the_reference_step():
    adv, logp, old = clip_case()
    logp.requires_grad_()
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    reference, _ = grpo_microbatch_train_step(logp, mask, 2, "grpo_clip", None, adv, old, 0.2)
    loop, _ = policy_microbatch_train_step(logp, mask, loss_weights("seq-mean-token-mean", mask, num_rows=4), adv, old,
                                           "grpo_clip", cliprange=0.2)
    assert loop.item() == pytest.approx(reference.item())
    rewards = torch.tensor([[2.0], [-1.0]])  # no_baseline: the contract's raw_rewards are the loop's advantages
    reference, _ = grpo_microbatch_train_step(logp, mask, 1, "no_baseline", rewards, advantages=torch.zeros(2, 1))
    loop, _ = policy_microbatch_train_step(logp, mask, loss_weights("seq-mean-token-mean", mask, num_rows=2), rewards,
                                           None, "no_baseline")
    assert loop.item() == pytest.approx(reference.item()) != 0


# ---- train steps ----------------------------------------------------------------------------------

def test_sft_step_by_hand_and_accumulates():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    loss, meta = sft_microbatch_train_step(logp, mask, gradient_accumulation_steps=3,
                                           normalize_constant=2.0)
    assert loss.item() == pytest.approx((2 + 3 + 4) / 2 / 2 / 3)
    assert meta["num_response_tokens"] == 3
    torch.testing.assert_close(logp.grad, -mask / (2.0 * 2 * 3))
    sft_microbatch_train_step(logp, mask, 3, 2.0)
    torch.testing.assert_close(logp.grad, -2 * mask / (2.0 * 2 * 3))


def test_grpo_step_default_is_the_reference_and_accumulates():
    adv, logp, old = clip_case()
    logp.requires_grad_()
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    loss, meta = grpo_microbatch_train_step(logp, mask, 2, "grpo_clip", None, adv, old, 0.2)
    per_token = torch.tensor([[-1.2, -0.5, -1.1], [1.5, 0.8, 1.1]])
    reference = masked_mean(per_token, mask, dim=1).mean() / 2  # ((-1.7 / 2) + (1.9 / 2)) / 2 / 2
    assert loss.item() == pytest.approx(reference.item()) == pytest.approx(0.025)
    assert float(meta["clip_fraction"]) == pytest.approx(2 / 4)  # tokens (0, 0) and (1, 1) are clipped
    first = logp.grad.clone()
    assert first[0, 0] == 0 and first[0, 2] == 0 and first[0, 1] != 0  # clipped and masked: no grad
    grpo_microbatch_train_step(logp, mask, 2, "grpo_clip", None, adv, old, 0.2)
    torch.testing.assert_close(logp.grad, 2 * first)


def test_grpo_step_kl_penalty():
    logp = torch.log(torch.tensor([[0.5, 0.2]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.2]]))
    rewards = torch.tensor([[0.0]])
    mask = torch.tensor([[1, 1]])
    kl0 = 0.5 + math.log(2) - 1
    loss, meta = grpo_microbatch_train_step(logp, mask, 1, "no_baseline", rewards, ref_log_probs=ref)
    assert loss.item() == 0.0 and float(meta["kl"]) == pytest.approx(kl0 / 2)
    loss, meta = grpo_microbatch_train_step(logp, mask, 1, "no_baseline", rewards, kl_coef=0.1,
                                            ref_log_probs=ref)
    assert loss.item() == pytest.approx(0.1 * kl0 / 2)
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp) = 0.5 on token 0
    torch.testing.assert_close(logp.grad, torch.tensor([[0.1 * 0.5 / 2, 0.0]]))
    with pytest.raises(ValueError, match="ref_log_probs"):
        grpo_microbatch_train_step(logp, mask, 1, "no_baseline", rewards, kl_coef=0.1)


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_fully_masked_rows_give_no_nan(mode):
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], requires_grad=True)
    mask = torch.tensor([[0, 0], [0, 0]])
    loss, _ = grpo_microbatch_train_step(logp, mask, 1, "reinforce_with_baseline", None,
                                         torch.tensor([[1.0], [-1.0]]), loss_agg_mode=mode,
                                         max_response_length=2, trace_lengths=torch.tensor([0, 0]),
                                         num_traces=2)
    assert loss.item() == 0.0
    assert torch.equal(logp.grad, torch.zeros_like(logp))


@pytest.mark.parametrize("loss_type", ["no_baseline", "grpo_clip"])
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_inf_at_a_masked_position_gives_finite_loss_and_gradient(loss_type, mode):
    # Position 2 is a forced token (tool output, mask 0) that the old policy and the reference gave
    # probability 0 and the policy -inf: the k3 KL and the ratio overflow there unless kept out.
    logp = torch.tensor([[-1.0, -2.0, -math.inf]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -math.inf]])
    ref = torch.tensor([[-1.2, -2.1, math.inf]])
    mask = torch.tensor([[1, 1, 0]])
    loss, meta = grpo_microbatch_train_step(logp, mask, 1, loss_type, torch.tensor([[1.0]]), torch.tensor([[0.5]]),
                                            old, 0.2, loss_agg_mode=mode, kl_coef=0.1, ref_log_probs=ref,
                                            max_response_length=3, num_tokens=2, num_traces=1,
                                            trace_lengths=torch.tensor([2]))
    assert math.isfinite(loss.item()) and math.isfinite(meta["kl"])
    assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0 and logp.grad[0, :2].abs().sum() > 0
    assert masked_mean(torch.tensor([1.0, math.inf]), torch.tensor([1, 0])).item() == 1.0


@pytest.mark.parametrize("advantage", [1.5, -0.7])
def test_no_baseline_gradient_matches_closed_form(advantage):
    vocab, label = 7, 3
    logits = torch.randn(1, 1, vocab, generator=torch.Generator().manual_seed(0), requires_grad=True)
    logp = torch.log_softmax(logits, dim=-1)[..., label]  # (1, 1)
    grpo_microbatch_train_step(logp, torch.ones(1, 1), 1, "no_baseline", torch.tensor([[advantage]]))
    onehot = torch.nn.functional.one_hot(torch.tensor(label), vocab).float()
    expected = -advantage * (onehot - torch.softmax(logits.detach()[0, 0], dim=-1))
    torch.testing.assert_close(logits.grad[0, 0], expected)


# ---- more estimators (alignment/estimators.py) ----------------------------------------------------

from alignment.estimators import (compute_gae_advantages, compute_gspo_loss, compute_reinforce_pp_advantages,  # noqa: E402
                                  compute_rloo_advantages, compute_value_loss, explained_variance, kl_penalty,
                                  outcome_token_rewards, subtract_group_mean)


def test_gae_by_hand_with_a_masked_hole():
    # one row: tokens 0, 1, [2 masked: tool output], 3; reward 1 at the end; gamma 0.9, lam 0.5
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0]])  # the 5.0 sits on a masked token: ignored
    values = torch.tensor([[0.2, 0.4, 9.0, 0.6]])
    mask = torch.tensor([[1, 1, 0, 1]])
    adv, ret = compute_gae_advantages(rewards, values, mask, gamma=0.9, lam=0.5)
    d3 = 1.0 + 0.9 * 0 - 0.6
    d1 = 0.0 + 0.9 * 0.6 - 0.4  # the next unmasked value is token 3's, across the hole
    d0 = 0.0 + 0.9 * 0.4 - 0.2
    a3 = d3
    a1 = d1 + 0.45 * a3
    a0 = d0 + 0.45 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.0, a3]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.2, a1 + 0.4, 0.0, a3 + 0.6]]))


def gae_loop(rewards, values, mask, gamma, lam):
    adv, ret = torch.zeros_like(rewards), torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        next_v = next_a = 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            next_a = delta + gamma * lam * next_a
            next_v = values[b, t].item()
            adv[b, t], ret[b, t] = next_a, next_a + values[b, t]
    return adv, ret


@pytest.mark.parametrize("seed", range(3))
def test_gae_rloo_reinforce_pp_equal_loops_on_random_masks_with_holes(seed):
    g = torch.Generator().manual_seed(seed)
    rewards, values = torch.randn(6, 9, generator=g), torch.randn(6, 9, generator=g)
    mask = (torch.rand(6, 9, generator=g) > 0.35).long()
    mask[0] = 0  # an empty row
    for gamma, lam in [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)]:
        adv, ret = compute_gae_advantages(rewards, values, mask, gamma, lam)
        loop_adv, loop_ret = gae_loop(rewards, values, mask, gamma, lam)
        torch.testing.assert_close(adv, loop_adv)
        torch.testing.assert_close(ret, loop_ret)
    # GAE with gamma = lam = 1 and a zero critic is the return-to-go
    adv, _ = compute_gae_advantages(rewards, torch.zeros_like(values), mask, 1.0, 1.0)
    returns_to_go = torch.zeros_like(rewards)
    for b in range(6):
        running = 0.0
        for t in reversed(range(9)):
            if mask[b, t]:
                running += rewards[b, t].item()
                returns_to_go[b, t] = running
    torch.testing.assert_close(adv, returns_to_go)
    # REINFORCE++: discounted return-to-go over unmasked tokens, whitened over the batch's unmasked tokens
    gamma = 0.9
    loop = torch.zeros_like(rewards)
    for b in range(6):
        running = 0.0
        for t in reversed(range(9)):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                loop[b, t] = running
    kept = loop[mask.bool()]
    whitened = torch.where(mask.bool(), (loop - kept.mean()) / torch.sqrt(kept.var(correction=0) + 1e-8), 0.0)
    torch.testing.assert_close(compute_reinforce_pp_advantages(rewards, mask, gamma), whitened)
    # RLOO: each reward minus the mean of the others in its group
    flat = torch.randn(12, generator=g)
    loop = torch.tensor([flat[i] - (flat[i // 4 * 4:i // 4 * 4 + 4].sum() - flat[i]) / 3 for i in range(12)])
    torch.testing.assert_close(compute_rloo_advantages(flat, 4), loop)


def test_rloo_and_group_mean_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])  # groups of 3: [1, 0, 0], [1, 1, 1]
    torch.testing.assert_close(compute_rloo_advantages(rewards, 3), torch.tensor([1.0, -0.5, -0.5, 0.0, 0.0, 0.0]))
    assert compute_rloo_advantages(rewards, 1).tolist() == [0.0] * 6
    torch.testing.assert_close(subtract_group_mean(rewards, 3), torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError):
        compute_rloo_advantages(rewards, 4)


def test_reinforce_pp_by_hand():
    rewards = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    mask = torch.tensor([[1, 1], [1, 1]])
    # gamma 1: returns [[1, 1], [-1, -1]]; mean 0, population variance 1
    torch.testing.assert_close(compute_reinforce_pp_advantages(rewards, mask),
                               torch.tensor([[1.0, 1.0], [-1.0, -1.0]]) / math.sqrt(1 + 1e-8))


def test_outcome_token_rewards_go_on_the_last_unmasked_token():
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
    out = outcome_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 2.0, 0, 0], [0, 0, 3.0, 0], [0, 0, 0, 0]]


def test_gspo_by_hand_and_its_gradient_is_the_sequence_objectives():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.2, -1.9, -0.4], [-0.3, -0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv = torch.tensor([1.0, -2.0])
    loss, meta = compute_gspo_loss(adv, logp, old, mask, 0.2)
    s0 = math.exp((0.2 - 0.1 - 0.1) / 3)  # = 1: unclipped
    s1 = math.exp((0.0 - 0.5) / 2)  # 0.78: below 1 - eps with A < 0 -> the clipped term is the min
    per_row = (loss * mask).sum(-1) / mask.sum(-1)
    expected = torch.tensor([-min(s0 * 1.0, min(max(s0, 0.8), 1.2) * 1.0),
                             -min(s1 * -2.0, min(max(s1, 0.8), 1.2) * -2.0)])
    torch.testing.assert_close(per_row, expected)
    assert meta["clipped"][1, :2].all() and not meta["clipped"][0].any() and not meta["clipped"][1, 2]
    per_row.sum().backward()
    grad = logp.grad.clone()
    # autograd of the written-out sequence objective
    logp2 = logp.detach().clone().requires_grad_()
    ratio = torch.exp(((logp2 - old) * mask).sum(-1) / mask.sum(-1))
    objective = torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    (-objective).sum().backward()
    torch.testing.assert_close(grad, logp2.grad)
    assert grad[1].abs().sum() == 0  # the clipped row gets no gradient


def test_gspo_clip_higher():
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    old = logp.detach() - 0.1  # s = exp(0.1) = 1.105
    loss, _ = compute_gspo_loss(torch.tensor([1.0]), logp, old, torch.ones(1, 2), 0.05, cliprange_high=0.08)
    assert loss[0, 0].item() == pytest.approx(-1.08)  # clipped at 1 + 0.08, not 1 + 0.05


def test_gspo_through_the_dispatch_and_the_train_step():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, meta = grpo_microbatch_train_step(logp, torch.tensor([[1, 1]]), 1, "gspo", None, torch.tensor([[1.0]]),
                                            logp.detach() - 0.05, 0.2)
    assert loss.item() == pytest.approx(-math.exp(0.05)) and "clip_fraction" in meta
    with pytest.raises(ValueError, match="one advantage per sequence"):
        compute_policy_gradient_loss(logp, "gspo", advantages=torch.ones(1, 2), old_log_probs=logp.detach(),
                                     cliprange=0.2, response_mask=torch.ones(1, 2))


def test_value_loss_by_hand():
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.5, 0.0]])
    returns = torch.tensor([[2.0, 1.0]])
    loss, meta = compute_value_loss(values, old, returns, torch.tensor([[1, 1]]), 0.2)
    # token 0: plain (1 - 2)^2 = 1; clipped old + 0.2 = 0.7 -> (0.7 - 2)^2 = 1.69: the max is the clipped one
    torch.testing.assert_close(loss, torch.tensor([[0.5 * 1.69, 0.5 * 1.0]]))
    assert meta["clipped"].tolist() == [[True, False]]
    loss.sum().backward()
    assert values.grad.tolist() == [[0.0, -1.0]]


def test_kl_estimators_by_hand():
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    r = math.log(0.5)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(-r)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * r * r)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - r - 1)
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k4")
    assert explained_variance(torch.tensor([[1.0, 2.0, 3.0]]), torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3)) == 1.0


def test_entropy_bonus_and_per_token_advantages_in_the_train_step():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    entropy = torch.tensor([[0.5, 1.5]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0]])  # per token
    loss, _ = grpo_microbatch_train_step(logp, torch.tensor([[1, 1]]), 1, "reinforce_with_baseline", None, adv,
                                         entropy_coef=0.1, token_entropy=entropy)
    # mean over tokens of -A * logp - 0.1 * H = ((1 * 1 - 0.05) + (-2 - 0.15)) / 2
    assert loss.item() == pytest.approx(((1.0 - 0.05) + (-2.0 - 0.15)) / 2)
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.5, 0.5]]))
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.05, -0.05]]))


def rollout_is_loop(old, sampler, mask, mode, level, threshold):
    """compute_rollout_is_weights written from its definition, one token at a time."""
    rows, positions = mask.shape
    weights = torch.zeros(rows, positions)
    for r in range(rows):
        sequence = sum(old[r, t].item() - sampler[r, t].item() for t in range(positions) if mask[r, t])
        geometric = sequence / max(1, int(mask[r].sum()))
        for t in range(positions):
            if not mask[r, t]:
                continue
            ratio = math.exp({"sequence": sequence, "geometric": geometric}.get(level, old[r, t].item() - sampler[r, t].item()))
            if mode == "truncate":
                weights[r, t] = min(ratio, threshold)
            elif mode == "mask":
                weights[r, t] = 1.0 if 1 / threshold <= ratio <= threshold else 0.0
            else:
                weights[r, t] = 1.0
    return weights


@pytest.mark.parametrize("mode", ["none", "truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rollout_is_weights_equal_the_definition(mode, level):
    from alignment.estimators import compute_rollout_is_weights
    g = torch.Generator().manual_seed(11)
    mask = (torch.rand(6, 5, generator=g) < 0.7).long()
    old = -torch.rand(6, 5, generator=g) * 3
    sampler = old + torch.randn(6, 5, generator=g) * (0.2 if level == "sequence" else 0.5 if level == "geometric" else 1.0)
    sampler[~mask.bool()] = float("nan")  # what a forced token holds
    old[0, ~mask[0].bool()] = float("-inf")
    weights, metrics = compute_rollout_is_weights(old, sampler, mask, mode, level, 1.5)
    expected = rollout_is_loop(old, sampler, mask, mode, level, 1.5)
    torch.testing.assert_close(weights, expected, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(weights).all() and not weights.requires_grad
    assert float(metrics["rollout_is_weight_mean"]) == pytest.approx(expected[mask.bool()].mean().item(), rel=1e-5)
    untruncated = rollout_is_loop(old, sampler, mask, "truncate", level, 1e9)
    changed = {"none": torch.zeros_like(mask, dtype=torch.bool), "mask": (expected != 1.0) & mask.bool(),
               "truncate": (expected < untruncated) & mask.bool()}[mode]
    assert float(metrics["rollout_is_clipped_fraction"]) == pytest.approx(changed.sum().item() / mask.sum().item())
    if mode != "none":
        assert 0 < metrics["rollout_is_clipped_fraction"] < 1  # the case has tokens on both sides


def test_rollout_is_weights_change_the_gradient_and_masked_infs_stay_out():
    from alignment.estimators import compute_rollout_is_weights
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -2.5]], requires_grad=True)
    sampler = torch.tensor([[-2.0, -2.0, float("-inf")], [-0.3, -1.0, float("nan")]])
    sampler[1, 2] = -2.5
    adv = torch.tensor([[1.0], [-1.0]])
    weights, _ = compute_rollout_is_weights(logp.detach(), sampler, mask, "truncate", "token", 2.0)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 1.0, 0.0], [1.0, math.exp(-0.2), 1.0]]))
    row_weights = loss_weights("token-mean", mask, num_rows=2, num_tokens=5)
    loss, _ = policy_microbatch_train_step(logp, mask, row_weights, adv, logp.detach(), "grpo_clip", cliprange=0.2,
                                           rollout_is_weights=weights)
    corrected = logp.grad.clone()
    logp.grad = None
    plain, _ = policy_microbatch_train_step(logp, mask, row_weights, adv, logp.detach(), "grpo_clip", cliprange=0.2)
    assert torch.isfinite(loss) and torch.isfinite(corrected).all()
    # on-policy the token's gradient is -A * w / num_tokens: the weight reaches the gradient, not only a metric
    torch.testing.assert_close(corrected, -adv * weights / 5)
    torch.testing.assert_close(logp.grad, -adv * mask / 5)


@pytest.mark.parametrize("level", ["sequence", "geometric"])
def test_gspo_with_rollout_correction_keeps_one_weight_per_sequence(level):
    """The review's case: log(old / sampler) = [+1, 0, -1] is a sequence ratio of exactly 1, so with A = 1 the
    per-token gradient of GSPO (on-policy, 3 tokens) is -1/3 on every token; token-level weights gave
    [-0.67, -0.33, -0.12]. Sequence-level weights keep the gradient equal along the row."""
    from alignment.estimators import compute_rollout_is_weights
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    mask = torch.ones(1, 3)
    sampler = logp.detach() - torch.tensor([[1.0, 0.0, -1.0]])
    weights, _ = compute_rollout_is_weights(logp.detach(), sampler, mask, "truncate", level, 2.0)
    torch.testing.assert_close(weights, torch.ones(1, 3))
    row_weights = loss_weights("seq-mean-token-mean", mask, num_rows=1, num_tokens=3)
    policy_microbatch_train_step(logp, mask, row_weights, torch.tensor([[1.0]]), logp.detach(), "gspo", cliprange=0.2,
                                 rollout_is_weights=weights)
    torch.testing.assert_close(logp.grad, torch.full((1, 3), -1 / 3))
    # a row of unequal sequence: every token still gets the same gradient
    logp.grad = None
    sampler = logp.detach() - torch.tensor([[0.9, 0.3, 0.6]])
    weights, _ = compute_rollout_is_weights(logp.detach(), sampler, mask, "truncate", level, 1.5)
    policy_microbatch_train_step(logp, mask, row_weights, torch.tensor([[1.0]]), logp.detach(), "gspo", cliprange=0.2,
                                 rollout_is_weights=weights)
    assert torch.allclose(logp.grad, logp.grad[0, :1].expand(1, 3))
    token_weights, _ = compute_rollout_is_weights(logp.detach(), sampler, mask, "truncate", "token", 2.0)
    with pytest.raises(ValueError, match="one weight per sequence"):
        policy_microbatch_train_step(logp, mask, row_weights, torch.tensor([[1.0]]), logp.detach(), "gspo",
                                     cliprange=0.2, rollout_is_weights=token_weights)


def test_gspo_takes_geometric_correction_by_default_and_refuses_token_level(capsys):
    from alignment.args import RLArgs, parse
    assert parse(RLArgs, ["--loss_type", "gspo"]).rollout_is_level == "geometric"
    assert parse(RLArgs, []).rollout_is_level == "token"
    assert parse(RLArgs, ["--loss_type", "gspo", "--rollout_is", "none", "--rollout_is_level", "token"])
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--loss_type", "gspo", "--rollout_is_level", "token"])
    assert "gspo keeps one weight per sequence" in capsys.readouterr().err


def test_the_sampler_mismatch_leaves_out_the_tokens_where_eos_was_banned():
    """Issue 77.5: with --sampling_min_tokens the sampler draws its first tokens from the distribution without EOS,
    renormalised; counting them made sampler_logprob_diff report a distribution change as a numerics gap."""
    from alignment.estimators import sampler_mismatch
    learner = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-1.0, -1.0, -1.0, 0.0]])
    sampler = learner + torch.tensor([[0.5, 0.5, 0.1, 0.2], [0.5, float("nan"), 0.3, 9.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    total, count = sampler_mismatch(sampler, learner, mask)
    assert count == 6 and total.item() == pytest.approx(0.5 + 0.5 + 0.1 + 0.2 + 0.5 + 0.3)  # NaN and padding out
    total, count = sampler_mismatch(sampler, learner, mask, min_tokens=2)
    assert count == 3 and total.item() == pytest.approx(0.1 + 0.2 + 0.3)
