"""The fused output head + log-softmax (alignment/head.py) against the plain path through the full logits."""

import pytest
import torch

from alignment import head, tokens
from alignment.head import fused_log_probs
from tests.conftest import build_tiny_model


def plain(hidden, weight, labels, scale):
    z = hidden @ weight.T
    z = z.to(torch.promote_types(z.dtype, torch.float32)) * scale  # (N, V): fp32, or float64 for the truth
    log_norm = torch.logsumexp(z, dim=-1)
    entropy = log_norm - (torch.softmax(z, dim=-1) * z).sum(-1)
    return z.gather(1, labels[:, None]).squeeze(1) - log_norm, entropy


def grads(fn, hidden, weight, labels, scale, weights_lp, weights_h):
    hidden, weight = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    log_probs, entropy = fn(hidden, weight, labels, scale)
    loss = (log_probs * weights_lp).sum() + (0 if weights_h is None else (entropy * weights_h).sum())
    loss.backward()
    return log_probs.detach(), entropy.detach(), hidden.grad, weight.grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [False, True])
@pytest.mark.parametrize("sub", [32, 3])
@pytest.mark.parametrize("keep", [True, False])
def test_fused_head_matches_float64_in_fp32(temperature, entropy_grad, sub, keep, monkeypatch):
    """Log-probs, entropy and both gradients against the plain path in float64 (the truth), in chunks that do
    not divide the positions, and sub-chunks that do not divide the chunks (sub 3: 8 = 3 + 3 + 2, the last
    chunk of 5 = 3 + 2), with the logits kept for backward and recomputed there; fp32's own rounding is the
    tolerance (the plain fp32 path is as far off)."""
    monkeypatch.setattr(head, "SUB_POSITIONS", sub)
    monkeypatch.setattr(head, "SAVE_LOGITS_BYTES", head.SAVE_LOGITS_BYTES if keep else 0)
    torch.manual_seed(0)
    hidden, weight, labels = torch.randn(37, 16, dtype=torch.float64), torch.randn(50, 16, dtype=torch.float64), \
        torch.randint(0, 50, (37,))
    weights_lp, weights_h = torch.randn(37, dtype=torch.float64), torch.randn(37, dtype=torch.float64)
    truth = grads(plain, hidden, weight, labels, 1 / temperature, weights_lp, weights_h if entropy_grad else None)

    def fused(h, w, y, s):
        return fused_log_probs(h, w, y, s, with_entropy=True, chunk=8)
    got = grads(fused, hidden.float(), weight.float(), labels, 1 / temperature, weights_lp.float(),
                weights_h.float() if entropy_grad else None)
    for name, a, b in zip(("log_probs", "entropy", "hidden.grad", "weight.grad"), got, truth):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=2e-5, msg=name)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("sub", [32, 5])
@pytest.mark.parametrize("keep", [True, False])
def test_fused_head_under_bf16_autocast_matches_the_plain_path_under_it(temperature, sub, keep, monkeypatch):
    """Under autocast the head's matmuls are bf16 in both paths, everything after them fp32 (in sub-chunks of
    the bf16 logits: 16 = 5 + 5 + 5 + 1), the logits kept for backward or recomputed there."""
    monkeypatch.setattr(head, "SUB_POSITIONS", sub)
    monkeypatch.setattr(head, "SAVE_LOGITS_BYTES", head.SAVE_LOGITS_BYTES if keep else 0)
    torch.manual_seed(1)
    hidden, weight, labels = torch.randn(40, 32), torch.randn(64, 32), torch.randint(0, 64, (40,))
    weights_lp, weights_h = torch.randn(40), torch.randn(40)
    results = []
    for fn in (plain, lambda h, w, y, s: fused_log_probs(h, w, y, s, with_entropy=True, chunk=16)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(grads(fn, hidden, weight, labels, 1 / temperature, weights_lp, weights_h))
    for name, a, b in zip(("log_probs", "entropy", "hidden.grad", "weight.grad"), *results):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2, msg=name)
    assert results[1][0].dtype == torch.float32 and results[1][1].dtype == torch.float32


@pytest.mark.parametrize("autocast", [False, True])
def test_kept_logits_spare_the_recomputation_and_a_second_backward_recomputes(autocast, monkeypatch):
    """Within SAVE_LOGITS_BYTES backward uses the forward's logits (no head matmul to recompute them); backward
    overwrites them, so a second backward through a retained graph recomputes, to the same gradients."""
    calls = []
    chunk_logits = head._chunk_logits
    monkeypatch.setattr(head, "_chunk_logits", lambda *a, **k: calls.append(1) or chunk_logits(*a, **k))
    torch.manual_seed(2)
    hidden, weight = torch.randn(20, 8, requires_grad=True), torch.randn(30, 8, requires_grad=True)
    labels, weights = torch.randint(0, 30, (20,)), torch.randn(20)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        log_probs, entropy = fused_log_probs(hidden, weight, labels, 1 / 0.7, with_entropy=True, chunk=8)
        loss = (log_probs * weights).sum() + (entropy * weights.flip(0)).sum()
    assert len(calls) == 1  # forward
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    assert len(calls) == 1  # backward used the kept logits
    second = torch.autograd.grad(loss, (hidden, weight))
    assert len(calls) == 2  # the second backward recomputed them
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)  # bf16: products' rounding
    for a, b in zip(first, second):  # (kept: one product over all positions; recomputed: chunk by chunk)
        torch.testing.assert_close(a, b, **tolerance)


def test_entropy_is_free_when_not_asked_for():
    hidden, weight, labels = torch.randn(5, 8, requires_grad=True), torch.randn(12, 8), torch.randint(0, 12, (5,))
    log_probs, entropy = fused_log_probs(hidden, weight, labels)
    assert (entropy == 0).all() and not entropy.requires_grad and log_probs.requires_grad


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("autocast", [False, True])
def test_rollout_log_probs_and_the_model_gradient_are_unchanged_by_the_fusion(tokenizer, monkeypatch, temperature,
                                                                               autocast):
    """The whole path the loss sees (shared prompts, rows of different lengths, padding): log-probs, entropy
    and every parameter's gradient of a policy-gradient-like loss, fused against the plain logits."""
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]
    responses = [[11, 12, 13], [14, 15, 16, 17, 18], [19], [20, 21]]
    advantages = torch.tensor([[0.5], [-1.0], [2.0], [0.3]])
    results = []
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(tokens, "_fused_scale", lambda model: None)
        model = build_tiny_model(tokenizer, seed=3)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = tokens.rollout_log_probs(model, prompts, responses, return_token_entropy=True,
                                           temperature=temperature, entropy_grad=True)
            (-(out["log_probs"] * advantages).sum() - 0.01 * out["token_entropy"].sum()).backward()
        results.append((out, {name: p.grad for name, p in model.named_parameters()}))
    (fused_out, fused_grads), (plain_out, plain_grads) = results
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(fused_out["log_probs"], plain_out["log_probs"], **tol)
    torch.testing.assert_close(fused_out["token_entropy"], plain_out["token_entropy"], **tol)
    assert (fused_out["log_probs"][2, 1:] == 0).all()  # padding reads 0
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], **tol, msg=name)


def test_sft_log_probs_are_unchanged_by_the_fusion(tiny_model, monkeypatch):
    ids = torch.randint(0, 100, (3, 9))
    fused = tokens.get_response_log_probs(tiny_model, ids[:, :-1], ids[:, 1:], return_token_entropy=True)
    monkeypatch.setattr(tokens, "_fused_scale", lambda model: None)
    plain_out = tokens.get_response_log_probs(tiny_model, ids[:, :-1], ids[:, 1:], return_token_entropy=True)
    torch.testing.assert_close(fused["log_probs"], plain_out["log_probs"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused["token_entropy"], plain_out["token_entropy"], rtol=1e-5, atol=1e-5)


def test_a_softcapped_head_is_not_fused():
    from transformers import AutoModelForCausalLM, Gemma2Config, LlamaConfig
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    assert tokens._fused_scale(AutoModelForCausalLM.from_config(Gemma2Config(**sizes, head_dim=16))) is None
    assert tokens._fused_scale(AutoModelForCausalLM.from_config(LlamaConfig(**sizes))) == 1.0
