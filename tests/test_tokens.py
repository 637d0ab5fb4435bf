"""Token-level helpers on the real SmolLM2 tokenizer and a tiny random model."""

import math

import pytest
import torch

from alignment import tokens
from alignment.tokens import (SharedPrompts, compute_entropy, get_response_log_probs, rollout_log_probs,
                              tokenize_prompt_and_output)


def test_tokenize_prompt_and_output_exact_ids(tokenizer):
    prompts = ["What is 2+2? Answer:", "Hel"]
    outputs = [" 4<|im_end|>", "lo"]
    pieces = [(tokenizer.encode(p, add_special_tokens=False), tokenizer.encode(o, add_special_tokens=False))
              for p, o in zip(prompts, outputs)]
    # "Hel" + "lo" tokenized together is one token, so separate tokenization is observable
    assert tokenizer.encode("Hello", add_special_tokens=False) != pieces[1][0] + pieces[1][1]
    assert pieces[0][1][-1] == tokenizer.eos_token_id  # special tokens in the text are kept

    out = tokenize_prompt_and_output(prompts, outputs, tokenizer)
    assert set(out) == {"input_ids", "labels", "response_mask"}
    length = max(len(p) + len(o) for p, o in pieces)
    pad = tokenizer.pad_token_id
    full = [p + o + [pad] * (length - len(p) - len(o)) for p, o in pieces]
    is_output = [[0] * len(p) + [1] * len(o) + [0] * (length - len(p) - len(o)) for p, o in pieces]
    assert out["input_ids"].tolist() == [row[:-1] for row in full]
    assert out["labels"].tolist() == [row[1:] for row in full]
    assert out["response_mask"].tolist() == [row[1:] for row in is_output]
    assert out["input_ids"].dtype == torch.long and out["input_ids"].shape == (2, length - 1)
    # the short row is padded on the right, and padding is not part of the response
    short = min(range(2), key=lambda i: len(pieces[i][0]) + len(pieces[i][1]))
    assert out["labels"][short, -1].item() == pad and out["response_mask"][short, -1].item() == 0


def naive_entropy(logits):
    probs = torch.softmax(logits.double(), dim=-1)
    return -(probs * torch.log_softmax(logits.double(), dim=-1)).sum(-1)


def test_compute_entropy_by_hand_and_stable():
    uniform = torch.zeros(2, 3, 5)
    torch.testing.assert_close(compute_entropy(uniform), torch.full((2, 3), math.log(5)))
    peaked = torch.tensor([[1000.0, 0.0, 0.0], [0.0, -1000.0, -1000.0]])
    torch.testing.assert_close(compute_entropy(peaked), torch.tensor([0.0, 0.0]))
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 4
    expected = naive_entropy(logits).float()
    torch.testing.assert_close(compute_entropy(logits), expected)
    torch.testing.assert_close(compute_entropy(logits, chunk_positions=2), expected)


def test_get_response_log_probs_matches_naive(tiny_model, tokenizer):
    batch = tokenize_prompt_and_output(["Compute 1+1.", "Hi"], [" 2", " there, friend"], tokenizer)
    out = get_response_log_probs(tiny_model, batch["input_ids"], batch["labels"],
                                 return_token_entropy=True)
    logits = tiny_model(batch["input_ids"]).logits.detach()
    expected = torch.log_softmax(logits, dim=-1).gather(-1, batch["labels"].unsqueeze(-1)).squeeze(-1)
    assert set(out) == {"log_probs", "token_entropy"}
    torch.testing.assert_close(out["log_probs"].detach(), expected)
    torch.testing.assert_close(out["token_entropy"], naive_entropy(logits).float())
    assert out["log_probs"].shape == batch["labels"].shape
    assert 0 < out["token_entropy"].min() and out["token_entropy"].max() <= math.log(len(tokenizer)) + 1e-4

    out["log_probs"].sum().backward()  # log-probs carry gradient to the model
    assert tiny_model.model.embed_tokens.weight.grad.abs().sum() > 0
    assert set(get_response_log_probs(tiny_model, batch["input_ids"], batch["labels"])) == {"log_probs"}


def test_tokenize_rejects_mismatched_lists(tokenizer):
    with pytest.raises(ValueError, match="2 prompts but 1 outputs"):
        tokenize_prompt_and_output(["a", "b"], ["c"], tokenizer)


@pytest.mark.parametrize("pack_tokens", [0, 6, tokens.PACK_TOKENS])  # prompt caches; group [9, 10] packed; both
def test_rollout_log_probs_match_full_sequence_log_probs_and_gradients(tokenizer, pack_tokens, monkeypatch):
    from conftest import build_tiny_model

    from alignment.tokens import get_response_log_probs, rollout_log_probs
    monkeypatch.setattr(tokens, "PACK_TOKENS", pack_tokens)
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10], [5, 6, 7, 8]]  # rows 0, 1, 3 share a prompt
    responses = [[11, 12, 13], [14, 15, 16, 17, 18], [19], [20, 21]]
    fast_model, slow_model = build_tiny_model(tokenizer, seed=3), build_tiny_model(tokenizer, seed=3)
    fast = rollout_log_probs(fast_model, prompts, responses, return_token_entropy=True)
    width = max(len(p) + len(r) for p, r in zip(prompts, responses))
    ids = torch.full((4, width), tokenizer.pad_token_id)
    mask = torch.zeros(4, width - 1)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        ids[i, :len(p) + len(r)] = torch.tensor(p + r)
        mask[i, len(p) - 1:len(p) + len(r) - 1] = 1
    slow = get_response_log_probs(slow_model, ids[:, :-1], ids[:, 1:], return_token_entropy=True)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        expected = slow["log_probs"][i, len(p) - 1:len(p) + len(r) - 1]
        torch.testing.assert_close(fast["log_probs"][i, :len(r)], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(fast["token_entropy"][i, :len(r)],
                                   slow["token_entropy"][i, len(p) - 1:len(p) + len(r) - 1], atol=1e-5, rtol=1e-5)
        assert (fast["log_probs"][i, len(r):] == 0).all()
    fast["log_probs"].sum().backward()
    (slow["log_probs"] * mask).sum().backward()
    for (name, a), b in zip(fast_model.named_parameters(), slow_model.parameters()):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_one_forward_mode_gives_the_same_log_probs_and_entropy(tiny_model):
    prompts = [[1, 2, 3], [1, 2, 3], [7, 8]]
    responses = [[4, 5, 6, 9], [4, 11], [10]]
    shared = rollout_log_probs(tiny_model, prompts, responses, return_token_entropy=True, temperature=0.7)
    one = rollout_log_probs(tiny_model, prompts, responses, return_token_entropy=True, temperature=0.7, one_forward=True)
    torch.testing.assert_close(one["log_probs"], shared["log_probs"], atol=1e-5, rtol=0)
    torch.testing.assert_close(one["token_entropy"], shared["token_entropy"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("autocast", [False, True])
def test_prompts_shared_across_microbatches_give_the_same_log_probs_and_gradient(tokenizer, autocast, monkeypatch):
    """Three microbatches of one optimizer step: prompt A spans all three, B two, C one. With `SharedPrompts`
    A and B run once and their gradient goes through each once, after its last microbatch: the same log-probs, entropies and
    parameter gradient as a forward and backward of every prompt in every microbatch (in fp32 to its rounding;
    under bf16 autocast no further from the fp32 gradient than the unshared bf16 one). Groups are not packed
    here (the prompt-cache path both ways; packing: test_packed_groups_*)."""
    from conftest import build_tiny_model
    monkeypatch.setattr(tokens, "PACK_TOKENS", 0)
    a, b, c = [5, 6, 7, 8], [9, 10, 11], [12, 13]
    parts = [([a, a, b], [[14, 15, 16], [17], [18, 19]]), ([a, b, c], [[20, 21], [22, 23, 24, 25], [26]]),
             ([a], [[27, 28, 29]])]
    weights = torch.randn(3, 3, 4, generator=torch.Generator().manual_seed(0))

    def run(use_shared: bool, bf16: bool):
        model = build_tiny_model(tokenizer, seed=4)
        tokens.check_output_head(model)  # once per model (the scripts do it when they load one): not counted below
        shared = SharedPrompts([prompts for prompts, _ in parts]) if use_shared else None
        outs, calls, held = [], [], []
        hook = model.get_decoder().register_forward_hook(lambda module, args, kwargs, out: calls.append(1),
                                                         with_kwargs=True)
        for (prompts, responses), w in zip(parts, weights):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = rollout_log_probs(model, prompts, responses, return_token_entropy=True, temperature=0.7,
                                        shared=shared)
            (out["log_probs"] * w[:len(prompts), :out["log_probs"].shape[1]]).sum().backward()
            outs.append(out)
            if shared:
                shared.done(prompts)
                held.append(set(shared._runs))
        if shared:
            assert shared.prompts == {tuple(a), tuple(b)}
            # B's gradient went through it after its last microbatch (the second), A's after the third
            assert held == [{tuple(a), tuple(b)}, {tuple(a)}, set()]
        hook.remove()
        # the decoder's calls: each distinct prompt of a microbatch, then its answers' call where an answer has more
        # than one token (c's has one); shared, A and B run once: 3 + 5 instead of 6 + 5
        assert len(calls) == (8 if use_shared else 11)
        return outs, {name: p.grad for name, p in model.named_parameters()}

    (plain_outs, plain_grads), (shared_outs, shared_grads) = run(False, autocast), run(True, autocast)
    for x, y in zip(plain_outs, shared_outs):
        torch.testing.assert_close(y["log_probs"], x["log_probs"], atol=1e-6, rtol=0)  # the same forward
        torch.testing.assert_close(y["token_entropy"], x["token_entropy"], atol=1e-6, rtol=0)
    truth = run(False, False)[1] if autocast else None
    for name, grad in plain_grads.items():
        if autocast:  # the order of bf16 roundings differs: compare each one's distance from the fp32 gradient
            plain_error = (grad - truth[name]).abs().max().item()
            shared_error = (shared_grads[name] - truth[name]).abs().max().item()
            assert shared_error <= 2 * plain_error + 1e-6, (name, shared_error, plain_error)
        else:
            torch.testing.assert_close(shared_grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)


def _decoder_calls(model) -> list:
    tokens.check_output_head(model)  # once per model (the scripts do it when they load one): not counted
    calls = []
    model.get_decoder().register_forward_hook(lambda module, args, out: calls.append(1))
    return calls


@pytest.mark.parametrize("autocast", [False, True])
def test_packed_groups_give_the_prompt_cache_paths_log_probs_entropy_and_gradient(tokenizer, autocast, monkeypatch):
    """Three groups of rows of different lengths (one row of a single token, one empty) at temperature 0.7: packed,
    one decoder call for all of them, the same log-probs, entropies and gradient as a prompt cache per group (two
    calls each; in fp32 to its rounding, under bf16 autocast no further from fp32 than the cache path's bf16)."""
    from conftest import build_tiny_model
    prompts = [[5, 6, 7, 8]] * 3 + [[9, 10]] * 2 + [[11, 12, 13]] * 2
    responses = [[14, 15, 16], [17], [18, 19, 20, 21, 22], [23, 24], [25, 26, 27, 28], [29, 30, 31, 32, 33, 34], []]
    weights = torch.randn(7, 6, generator=torch.Generator().manual_seed(1))

    def run(pack_tokens: int, bf16: bool):
        monkeypatch.setattr(tokens, "PACK_TOKENS", pack_tokens)
        model = build_tiny_model(tokenizer, seed=5)
        calls = _decoder_calls(model)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = rollout_log_probs(model, prompts, responses, return_token_entropy=True, temperature=0.7)
        (out["log_probs"] * weights).sum().backward()
        return out, {name: p.grad for name, p in model.named_parameters()}, len(calls)

    (cached, cached_grads, cached_calls), (packed, packed_grads, packed_calls) = run(0, autocast), run(512, autocast)
    assert (cached_calls, packed_calls) == (6, 1)
    assert packed["log_probs"].shape == (7, 6) and (packed["log_probs"][1, 1:] == 0).all()
    assert (packed["log_probs"][6] == 0).all() and (packed["token_entropy"][6] == 0).all()  # the empty response
    # fp32: ~45 ulp of entropies near 10.8 (on an AMX Xeon the two were 1.05e-5 apart, 11 ulp: its kernels round differently)
    tolerance = dict(atol=3e-2, rtol=0) if autocast else dict(atol=1e-5, rtol=3e-6)
    torch.testing.assert_close(packed["log_probs"], cached["log_probs"], **tolerance)
    torch.testing.assert_close(packed["token_entropy"], cached["token_entropy"], **tolerance)
    truth = run(0, False)[1] if autocast else None
    for name, grad in cached_grads.items():
        if autocast:
            cached_error = (grad - truth[name]).abs().max().item()
            packed_error = (packed_grads[name] - truth[name]).abs().max().item()
            assert packed_error <= 2 * cached_error + 1e-6, (name, packed_error, cached_error)
        else:
            torch.testing.assert_close(packed_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def test_only_groups_within_pack_tokens_and_not_shared_across_microbatches_are_packed(tiny_model, monkeypatch):
    """A group over PACK_TOKENS and one whose prompt SharedPrompts runs keep their prompt caches (a prompt call and
    an answers call each); the other two go in one call between them, with the same log-probs."""
    monkeypatch.setattr(tokens, "PACK_TOKENS", 7)
    prompts = [[1, 2, 3]] * 2 + [[4, 5, 6, 7, 8]] * 2 + [[9, 10]] + [[11, 12]]
    responses = [[13, 14], [15, 16, 17], [18, 19, 20], [21, 22], [23, 24], [25, 26, 27]]  # packed: 6, 8, 3 and 4
    shared = SharedPrompts([[[9, 10]], [[9, 10]]])
    calls = _decoder_calls(tiny_model)
    with torch.no_grad():
        out = rollout_log_probs(tiny_model, prompts, responses, shared=shared)
        assert len(calls) == 1 + 2 + 2  # [1, 2, 3] and [11, 12] packed; [4, ..., 8] (8 tokens) and [9, 10] cached
        monkeypatch.setattr(tokens, "PACK_TOKENS", 0)
        plain = rollout_log_probs(tiny_model, prompts, responses)
    assert len(calls) == 5 + 4 * 2
    torch.testing.assert_close(out["log_probs"], plain["log_probs"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("change, packs", [(None, True), ("eager", False), ("sliding", False)])
def test_packing_needs_a_mask_taking_attention_without_sliding_windows(tokenizer, change, packs):
    """Eager attention adds its mask (a boolean one would be read as numbers) and a sliding window limits what a
    position sees beyond any mask given: such models keep the prompt-cache path, with the same numbers."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, use_sliding_window=change == "sliding",
                         sliding_window=4, max_window_layers=0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).eval()
    if change == "eager":
        model.set_attn_implementation("eager")
    assert tokens.packs(model) is packs
    prompts, responses = [[5, 6, 7]] * 2 + [[9, 10]], [[11, 12, 13, 14, 15, 16], [15, 16], [17, 18, 19]]
    with torch.no_grad():
        out = rollout_log_probs(model, prompts, responses, return_token_entropy=True)
        full = rollout_log_probs(model, prompts, responses, return_token_entropy=True, one_forward=True)
    torch.testing.assert_close(out["log_probs"], full["log_probs"], rtol=1e-4, atol=1e-5)


def test_shared_prompts_without_gradient_are_reused_and_keep_no_graph(tiny_model):
    shared = SharedPrompts([[[1, 2, 3]], [[1, 2, 3], [4, 5]]])
    with torch.no_grad():
        first = rollout_log_probs(tiny_model, [[1, 2, 3]], [[6, 7]], shared=shared)
        second = rollout_log_probs(tiny_model, [[1, 2, 3], [4, 5]], [[6, 7], [8]], shared=shared)
    plain = rollout_log_probs(tiny_model, [[1, 2, 3], [4, 5]], [[6, 7], [8]])
    torch.testing.assert_close(second["log_probs"], plain["log_probs"].detach(), atol=1e-6, rtol=0)
    torch.testing.assert_close(first["log_probs"][0], plain["log_probs"][0].detach(), atol=1e-6, rtol=0)
    assert not shared._graphs


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite", "llama"])
def test_the_shared_prompt_path_applies_the_models_own_post_head_step(family):
    """Gemma-2 caps its logits (tanh), Cohere scales them, Granite divides them, all after the output head: the
    shared-prompt path, which calls the head itself, must give the log-probs of the model's own forward."""
    from transformers import AutoModelForCausalLM, CohereConfig, Gemma2Config, GraniteConfig, LlamaConfig
    from alignment.tokens import check_output_head, rollout_log_probs
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128)
    config = {"gemma2": lambda: Gemma2Config(**sizes, head_dim=16, final_logit_softcapping=0.5),
              "cohere": lambda: CohereConfig(**sizes, logit_scale=3.0),
              "granite": lambda: GraniteConfig(**sizes, logits_scaling=0.25),
              "llama": lambda: LlamaConfig(**sizes)}[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    prompts = [[5, 6, 7], [5, 6, 7], [9, 10]]
    responses = [[11, 12, 13, 14], [15, 16], [17, 18, 19]]
    shared = rollout_log_probs(model, prompts, responses, return_token_entropy=True)
    full = rollout_log_probs(model, prompts, responses, return_token_entropy=True, one_forward=True)
    torch.testing.assert_close(shared["log_probs"], full["log_probs"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(shared["token_entropy"], full["token_entropy"], rtol=1e-4, atol=1e-5)
    check_output_head(model)  # passes: the post-head step is reproduced


@pytest.mark.parametrize("family", ["hyperclovax", "falcon_h1"])
def test_sft_log_probs_are_the_models_own_for_families_that_scale_logits_otherwise(family):
    """HyperCLOVAX multiplies its logits by `logits_scaling` (Granite divides), FalconH1 by `lm_head_multiplier`:
    SFT's and expert iteration's fused head (get_response_log_probs) once treated both as Granite's divisor or
    ignored them, 0.8-0.93 nats off the model's own log-probs."""
    from transformers import AutoModelForCausalLM, FalconH1Config, HyperCLOVAXConfig
    from alignment.tokens import get_response_log_probs
    sizes = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=128)
    config = {"hyperclovax": lambda: HyperCLOVAXConfig(**sizes, logits_scaling=3.0),
              "falcon_h1": lambda: FalconH1Config(**sizes, lm_head_multiplier=3.0, mamba_d_ssm=32, mamba_n_heads=4,
                                                  mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=8)}[family]()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    labels = torch.tensor([[6, 7, 8, 9, 10], [11, 12, 13, 14, 15]])
    with torch.no_grad():
        own = torch.log_softmax(model(ids).logits.float(), -1).gather(-1, labels[..., None])[..., 0]
        ours = get_response_log_probs(model, ids, labels)["log_probs"]
    torch.testing.assert_close(ours, own, rtol=1e-4, atol=1e-5)


def test_a_model_whose_forward_changes_its_logits_unknowably_is_refused():
    from transformers import LlamaConfig, LlamaForCausalLM
    from alignment.errors import UserError
    from alignment.tokens import check_output_head, get_response_log_probs

    class Doubled(LlamaForCausalLM):  # a post-head step output_logits does not know
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 2
            return out

    model = Doubled(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1)).eval()
    with pytest.raises(UserError, match="changes its logits after the output head"):
        check_output_head(model)
    with pytest.raises(UserError, match="changes its logits after the output head"):  # SFT's and EI's path too
        get_response_log_probs(model, torch.tensor([[5, 6, 7]]), torch.tensor([[6, 7, 8]]))
