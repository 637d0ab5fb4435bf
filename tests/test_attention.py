"""The models' attention (alignment/attention.py) against transformers' SDPA attention and a float64 truth."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from alignment import attention, models, tokens


def truth(query, key, value, mask):
    """Softmax attention in float64, key/value heads repeated to the query heads."""
    groups = query.shape[1] // key.shape[1]
    key, value = (t.double().repeat_interleave(groups, 1) for t in (key, value))
    scores = query.double() @ key.transpose(-1, -2) / query.shape[-1] ** 0.5
    return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ value).transpose(1, 2)  # (B, L, H, D)


class Module(torch.nn.Module):
    is_causal = True


def inputs(length: int, prompt: int = 9):
    """8 query heads over 2 key/value heads: `length` answer positions attending to a shared prompt and causally
    to themselves, the mask as transformers hands it over."""
    torch.manual_seed(0)
    query = torch.randn(3, 8, length, 16, requires_grad=True)
    key, value = (torch.randn(3, 2, prompt + length, 16, requires_grad=True) for _ in range(2))
    mask = torch.ones(length, prompt + length, dtype=torch.bool).tril(prompt)[None, None].expand(3, 1, -1, -1)
    return query, key, value, mask


def test_grouped_heads_match_the_truth_in_fp32():
    query, key, value, mask = inputs(5)
    out, _ = attention.attention(Module(), query, key, value, mask)
    assert out.shape == (3, 5, 8, 16)
    torch.testing.assert_close(out.double(), truth(query, key, value, mask), atol=1e-5, rtol=1e-5)
    out.sum().backward()
    grads = [t.grad.clone() for t in (query, key, value)]
    for t in (query, key, value):
        t.grad = None
    truth(query, key, value, mask).sum().backward()
    for mine, exact in zip(grads, (query.grad, key.grad, value.grad)):
        torch.testing.assert_close(mine, exact, atol=1e-5, rtol=1e-5)


def test_short_queries_run_in_fp32_under_bf16_autocast():
    """Queries and keys arrive in fp32 (after the rotary embedding): up to FP32_QUERIES query tokens the kernel
    keeps them, so under bf16 autocast the output is the exact attention rounded once to bf16 (for the output
    projection), where transformers' SDPA computes in bf16 and is off in most places."""
    query, key, value, mask = inputs(attention.FP32_QUERIES)
    rounded = truth(query, key, value, mask).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = attention.attention(Module(), query, key, value, mask)
        theirs = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(4, 1), value.repeat_interleave(4, 1), attn_mask=mask).transpose(1, 2)
    assert ours.dtype == theirs.dtype == torch.bfloat16  # what the output projection gets, as before
    assert (ours == rounded).float().mean() > 0.999  # (a last-bit tie here and there)
    assert (theirs == rounded).float().mean() < 0.9


def test_a_bf16_model_without_autocast_gets_bf16_back():
    """Evaluation and sampling run a model whose weights are bf16, without autocast: the output projection needs
    bf16, short query blocks included."""
    model = attention.use_in(gqa_model("sdpa")).to(torch.bfloat16)
    ids = torch.randint(0, 300, (2, 7))
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
        step = model(ids[:, :1], attention_mask=torch.ones(2, 8, dtype=torch.long), past_key_values=out.past_key_values)
    assert out.logits.dtype == step.logits.dtype == torch.bfloat16


def test_long_queries_run_in_the_autocast_dtype():
    query, key, value, mask = inputs(attention.FP32_QUERIES + 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, _ = attention.attention(Module(), query, key, value, mask)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), truth(query, key, value, mask), atol=3e-2, rtol=3e-2)


def test_causal_without_a_mask_and_other_devices_go_to_transformers(monkeypatch):
    query, key, value, causal = inputs(6, prompt=0)  # no prompt: the mask is the plain causal one
    out, _ = attention.attention(Module(), query, key, value, None)  # the prompt's forward: the kernel's causal mask
    torch.testing.assert_close(out.double(), truth(query, key, value, causal), atol=1e-5, rtol=1e-5)
    calls = []
    monkeypatch.setattr(attention, "sdpa_attention_forward", lambda *a, **k: calls.append(a[1].device.type))
    attention.attention(Module(), *(t.detach().to("meta") for t in (query, key, value)), None)
    assert calls == ["meta"]


def gqa_model(implementation: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    config._attn_implementation = implementation
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_shared_prompt_log_probs_and_gradients_match_transformers_sdpa(precision):
    """The train phase's path (tokens.rollout_log_probs: one prompt forward, answers of different lengths on
    repeated prompt caches) with this attention against transformers' SDPA: the same log-probs, entropy and
    gradients, to fp32's rounding in fp32 and within bf16's in bf16 (where ours rounds less)."""
    prompts = [[5, 6, 7, 8, 9, 10, 11]] * 3 + [[20, 21, 22]] * 2
    responses = [[30, 31, 32, 33, 34, 35], [40, 41], [50], [60, 61, 62, 63, 64, 65, 66, 67, 68], [70, 71, 72]]
    results = []
    for implementation in ("sdpa", attention.NAME):
        model = gqa_model(implementation).train()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            out = tokens.rollout_log_probs(model, prompts, responses, return_token_entropy=True)
        out["log_probs"].sum().backward()
        results.append((out["log_probs"].detach(), out["token_entropy"], [p.grad for p in model.parameters()]))
    (lp_a, h_a, g_a), (lp_b, h_b, g_b) = results
    tolerance = 1e-5 if precision == "fp32" else 5e-2
    torch.testing.assert_close(lp_b, lp_a, atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(h_b, h_a, atol=tolerance, rtol=tolerance)
    for a, b in zip(g_a, g_b):
        torch.testing.assert_close(b, a, atol=tolerance, rtol=tolerance)


def test_models_load_with_this_attention_and_save_without_it(tiny_model_dir, tmp_path):
    model = models.load_model(tiny_model_dir)
    assert model.config._attn_implementation == attention.NAME
    model.save_pretrained(tmp_path)  # a saved checkpoint names no attention: vLLM and transformers read it as before
    assert attention.NAME not in (tmp_path / "config.json").read_text()


def test_a_model_on_another_attention_keeps_it():
    assert attention.use_in(gqa_model("eager")).config._attn_implementation == "eager"
    assert attention.use_in(gqa_model("sdpa")).config._attn_implementation == attention.NAME
