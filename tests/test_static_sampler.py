"""The static-shape sampler (alignment/static_sampler.py) against the reference loop (sampling.HFSampler):
the same tokens greedily and on the same uniforms, the same stopping rules, a request's tokens independent of
its batch-mates, counter-based draws that are uniform and reproducible, and a decode step that compiles into
one graph without recompiling."""

import collections
import functools
import types

import pytest
import torch

from alignment.sampling import HFSampler, SamplingParams
from alignment.static_sampler import StaticSampler, counter_draws, counter_uniforms, splitmix64
from tests.test_sampling import ScriptedLM

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17]]  # different lengths: left padding differs


def _untied(model):
    # with tied embeddings a random model greedily repeats its last token: untie the head for varied text
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 3)
    return model


def _tokens(outputs):
    return [[c.token_ids for c in group] for group in outputs]


class CounterReference(HFSampler):
    """The reference loop drawing the static sampler's uniforms."""

    def _uniforms(self, seeds, device):
        return counter_draws(seeds, device)


def _splitmix64_reference(x: int) -> int:  # the published algorithm on Python's unbounded ints, mod 2^64
    mask = 2**64 - 1
    z = (x + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def test_splitmix64_in_int64_arithmetic_is_the_published_function():
    values = [0, 1, 2, 12345, 2**62 + 7, 2**63 - 1, -1, -(2**63), -987654321]
    got = splitmix64(torch.tensor(values, dtype=torch.int64)).tolist()
    assert [g % 2**64 for g in got] == [_splitmix64_reference(v % 2**64) for v in values]
    assert _splitmix64_reference(0) == 0xE220A8397B1DCDAF  # the first output of SplitMix64 seeded with 0


def test_counter_uniforms_are_uniform_and_a_pure_function_of_seed_and_step():
    seeds = torch.arange(20_000, dtype=torch.int64) * 7919 + 3
    u = counter_uniforms(seeds, 5)
    assert u.dtype == torch.float64 and 0 <= u.min() and u.max() < 1
    counts = torch.histc(u.float(), bins=10, min=0, max=1)
    assert (counts - 2000).abs().max() < 200  # ~4.5 standard deviations of a bin's count
    assert torch.equal(counter_uniforms(seeds[[7, 3]], 5), u[[7, 3]])  # a row's draw ignores the other rows
    assert not torch.equal(counter_uniforms(seeds, 6), u)  # the next token draws anew
    assert abs(torch.corrcoef(torch.stack([u, counter_uniforms(seeds, 6)]))[0, 1]) < 0.03


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(n=3, temperature=0, max_tokens=12),
    SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=4, logprobs=True),
    SamplingParams(n=2, temperature=0.7, top_p=0.9, max_tokens=10, min_tokens=4, seed=9, logprobs=True),
], ids=["greedy", "greedy-groups", "sampled", "nucleus-min-tokens"])
def test_static_equals_the_reference_on_the_same_uniforms(tiny_model, tokenizer, params):
    _untied(tiny_model)
    reference = CounterReference(tiny_model, tokenizer, batch_size=8).generate(PROMPTS, params)
    static = StaticSampler(tiny_model, tokenizer, batch_size=8, check_every=5).generate(PROMPTS, params)
    assert _tokens(static) == _tokens(reference)
    for ours, theirs in zip(static, reference):
        for a, b in zip(ours, theirs):
            assert (a.text, a.finish_reason, a.stop_reason) == (b.text, b.finish_reason, b.stop_reason)
            if params.logprobs:
                assert len(a.logprobs) == len(a.token_ids)
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_static_equals_the_reference_under_bf16_autocast(tiny_model, tokenizer):
    # the training runs' precision on a bf16 CPU or a GPU: keys leave the rotary embedding in fp32, values in bf16
    # (a cache sized by the keys' dtype alone failed CI on an AVX512-BF16 machine, 2026-11-29)
    _untied(tiny_model)
    params = SamplingParams(n=2, temperature=0, max_tokens=12)  # greedy: bf16's rounding flips sampled draws
    with torch.autocast("cpu", dtype=torch.bfloat16):
        reference = CounterReference(tiny_model, tokenizer, batch_size=8).generate(PROMPTS, params)
        static = StaticSampler(tiny_model, tokenizer, batch_size=8, check_every=5).generate(PROMPTS, params)
    assert _tokens(static) == _tokens(reference)


def test_finished_rows_are_cut_where_the_reference_cuts_them(tiny_model, tokenizer):
    """A stop string and EOS end rows mid-batch (found at a host check several tokens later) while the others
    go on; each row ends exactly where the reference's token-by-token check ends it."""
    _untied(tiny_model)
    free = HFSampler(tiny_model, tokenizer, batch_size=8).generate(PROMPTS, SamplingParams(temperature=0, max_tokens=14))
    row0 = free[0][0].token_ids
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    k = next(k for k in range(1, 10) if decode(row0[k:k + 1]).strip() and decode(row0[k:k + 1]) not in decode(row0[:k]))
    params = SamplingParams(temperature=0, max_tokens=14, stop=(decode(row0[k:k + 1]),))
    reference = HFSampler(tiny_model, tokenizer, batch_size=8).generate(PROMPTS, params)
    for check_every in (1, 3, 8, 20):
        static = StaticSampler(tiny_model, tokenizer, batch_size=8, check_every=check_every).generate(PROMPTS, params)
        assert _tokens(static) == _tokens(reference)
        assert [c.stop_reason for [c] in static] == [c.stop_reason for [c] in reference]
    assert len(reference[0][0].token_ids) == k + 1 and any(len(c.token_ids) > k + 1 for [c] in reference[1:])


@pytest.fixture
def chain(tokenizer):
    ids = tokenizer("Sum: 2 plus 3. The answer is 5.</answer> trailing words", add_special_tokens=False).input_ids
    return ids, ScriptedLM(ids, len(tokenizer), tokenizer.eos_token_id)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=50, stop=("</answer>",)),
    SamplingParams(temperature=0, max_tokens=50),  # EOS: kept in the ids, not in the text
    SamplingParams(temperature=0, max_tokens=3),
    SamplingParams(temperature=0, max_tokens=60, stop=("plus", "."), min_tokens=3),  # stops wait for min_tokens
], ids=["stop-string", "eos", "length", "min-tokens"])
def test_stopping_rules_match_the_reference_on_a_scripted_model(chain, tokenizer, params):
    ids, model = chain  # (a model without a cache: the reference runs it, the static scan reads its tokens)
    reference = HFSampler(model, tokenizer).generate([ids[:2]], params)
    # the scan that finds a row's end, without the model: feed it the reference's tokens in chunks of 4
    sampler = StaticSampler(model, tokenizer, compile=False)
    [[expected]] = reference
    stream = expected.token_ids + [ids[-1]] * 8  # what a static row would have decoded past its end
    generated, finish, max_stop = [], None, max((len(s) for s in params.stop), default=0)
    for start in range(0, params.max_tokens, 4):
        finish = sampler._scan(generated, stream[start:min(start + 4, params.max_tokens)], start, params, max_stop)
        if finish:
            break
    assert generated == expected.token_ids
    assert (finish or ("length", None)) == (expected.finish_reason, expected.stop_reason)


def test_a_requests_tokens_do_not_depend_on_its_batch_mates(tiny_model, tokenizer):
    tiny_model.lm_head.weight = torch.nn.Parameter(torch.randn_like(tiny_model.lm_head.weight) * 0.01)  # near uniform
    sampler = StaticSampler(tiny_model, tokenizer, batch_size=64)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=6, seed=11)
    [eight] = sampler.generate([[1, 2, 3]], params)
    assert len({tuple(c.token_ids) for c in eight}) == 8
    both = sampler.generate([[4, 5, 6, 7, 8, 9], [1, 2, 3]], params, keys=[1, 0])  # wider batch, other prompt
    assert [c.token_ids for c in both[1]] == [c.token_ids for c in eight]
    assert [c.token_ids for c in sampler.generate([[1, 2, 3]], params, keys=[1])[0]] != [c.token_ids for c in eight]


class Counted(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_the_host_reads_once_per_check_and_each_step_has_a_fixed_cost(tiny_model, tokenizer, monkeypatch):
    """What a GPU pays per decode step: no host read inside a step (the reference reads two lists per token),
    and the same operations every step (no growing cache or mask, no rows leaving)."""
    _untied(tiny_model)
    reads, tolist = [], torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or tolist(t))

    def run(sampler, max_tokens):
        reads.clear()
        with Counted() as mode:
            sampler.generate(PROMPTS, SamplingParams(n=2, temperature=1.0, max_tokens=max_tokens,
                                                     min_tokens=max_tokens, seed=3))
        return len(reads), mode.ops
    static = StaticSampler(tiny_model, tokenizer, batch_size=8, check_every=8)
    (lists8, ops8), (lists24, ops24) = run(static, 8), run(static, 24)
    assert (lists8, lists24) == (1, 3)  # one read of the new tokens per 8 tokens
    scalar_reads = lambda ops: ops["_local_scalar_dense"] + ops["nonzero"]  # noqa: E731
    assert scalar_reads(ops24) == scalar_reads(ops8) <= 2  # transformers' mask checks in the prefill, none per step
    per_step = (sum(ops24.values()) - sum(ops8.values())) / 16
    (lists40, ops40) = run(static, 40)
    assert sum(ops40.values()) - sum(ops24.values()) == 16 * per_step  # every step the same operations
    lists, _ = run(HFSampler(tiny_model, tokenizer, batch_size=8), 16)
    assert lists == 2 * 16  # the reference: tokens and log-probs, every token


def test_the_decode_step_compiles_into_one_graph_without_recompiling(tiny_model, tokenizer):
    """fullgraph=True fails on any graph break; 20 steps and a second batch of the same shapes reuse the graph.
    (On CPU with the eager backend: the tracing is what is tested; CUDA adds the graph capture.)"""
    torch._dynamo.reset()
    _untied(tiny_model)
    sampler = StaticSampler(tiny_model, tokenizer, batch_size=8, compile=True)
    counts = collections.Counter()

    def backend(graph, example_inputs):
        counts["graphs"] += 1
        return graph.forward
    real = torch.compile
    try:
        torch.compile = lambda fn, mode=None, fullgraph=False: real(fn, backend=backend, fullgraph=True)
        params = SamplingParams(n=2, temperature=1.0, max_tokens=20, min_tokens=20, seed=1)
        first = sampler.generate(PROMPTS[:2], params)
        second = sampler.generate(PROMPTS[2:], params)
        # another budget and floor (Delethink and TIR rounds): the same bucket, the same graph
        third = sampler.generate(PROMPTS[2:], SamplingParams(n=2, temperature=1.0, max_tokens=12, min_tokens=5, seed=2))
    finally:
        torch.compile = real
    assert counts["graphs"] == 1, counts
    assert all(len(c.token_ids) <= 12 for group in third for c in group)
    assert len(sampler._states) == 1  # and the same buffers: CUDA graphs replay on fixed addresses
    eager = StaticSampler(tiny_model, tokenizer, batch_size=8, compile=False)
    # the compiled sampler buckets the width and pads the batch: the same tokens all the same
    assert _tokens(first) == _tokens(eager.generate(PROMPTS[:2], params))
    assert _tokens(second) == _tokens(eager.generate(PROMPTS[2:], params))


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_the_compiled_step_holds_no_scan_longer_than_32(tiny_model, tokenizer, top_p):
    """On CUDA torch 2.11's inductor split the CDF's scan over the vocabulary and failed to generate its code (H200,
    2026-12-04); a scan of at most 32 terms is never split, so the traced step must hold none longer."""
    torch._dynamo.reset()
    scans = []

    def backend(graph, example_inputs):
        for node in graph.graph.nodes:
            if node.target in (torch.cumsum, "cumsum", torch.cummax, "cummax"):  # the CDF and its running maximum
                scans.append(node.args[0].meta["example_value"].shape[-1])  # the scanned length
        return graph.forward
    real = torch.compile
    try:
        torch.compile = lambda fn, mode=None, fullgraph=False: real(fn, backend=backend, fullgraph=True)
        StaticSampler(tiny_model, tokenizer, batch_size=8, compile=True).generate(
            PROMPTS[:2], SamplingParams(n=2, temperature=1.0, top_p=top_p, max_tokens=4, seed=1))
    finally:
        torch.compile = real
        torch._dynamo.reset()
    assert scans and max(scans) <= 32, scans


def test_a_decode_step_that_does_not_compile_is_one_line_that_says_use_the_loop(tiny_model, tokenizer, monkeypatch):
    """torch 2.11's inductor failed on the static sampler's step on an H200 (2026-12-04): the compiler's error
    becomes a UserError naming --hf_decoding loop, not a traceback from inside the sampler."""
    from alignment.errors import UserError
    torch._dynamo.reset()

    def backend(graph, example_inputs):  # inductor's failure, as dynamo reports a backend's error
        raise TypeError("list indices must be integers or slices, not NoneType")
    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode=None, fullgraph=False: real(fn, backend=backend,
                                                                                        fullgraph=True))
    sampler = StaticSampler(tiny_model, tokenizer, batch_size=8, compile=True)
    with pytest.raises(UserError, match=r"did not compile with torch .*list indices.*use --hf_decoding loop\.$"):
        sampler.generate(PROMPTS[:2], SamplingParams(n=2, temperature=1.0, max_tokens=8, seed=1))
    torch._dynamo.reset()


def test_auto_decoding_is_the_loop_on_a_gpu_too():
    """auto picks the loop on CUDA as on the CPU until a GPU pass shows the compiled static sampler working."""
    from alignment.samplers import hf_decoding
    gpu_model = types.SimpleNamespace(device=torch.device("cuda", 0), _can_compile_fullgraph=True,
                                      config=types.SimpleNamespace(layer_types=None))
    assert hf_decoding(gpu_model, "auto") == "loop"
    assert hf_decoding(gpu_model, "static") == "static"


def test_hf_decoding_picks_the_sampler_and_refuses_what_cannot_work(tiny_model, tokenizer):
    from alignment.errors import UserError
    from alignment.samplers import make_sampler
    hf_sampler = functools.partial(make_sampler, "hf")
    assert type(hf_sampler(tiny_model, tokenizer)) is HFSampler  # auto on the CPU: the reference loop
    assert type(hf_sampler(tiny_model, tokenizer, decoding="static")) is StaticSampler
    assert not hf_sampler(tiny_model, tokenizer, decoding="static").compile  # compiled only on CUDA
    scripted = ScriptedLM([1, 2], len(tokenizer), tokenizer.eos_token_id)
    with pytest.raises(UserError, match="use --hf_decoding loop"):
        hf_sampler(scripted, tokenizer, decoding="static")
    tiny_model.config.layer_types = ["sliding_attention", "full_attention"]  # a sliding window's cache wraps
    with pytest.raises(UserError, match="full-attention layers only"):
        hf_sampler(tiny_model, tokenizer, decoding="static")


def test_an_rl_run_samples_with_the_static_sampler(tokenizer, tmp_path, monkeypatch):
    """train_rl --hf_decoding static on the CPU: the run goes through the static sampler and trains."""
    from alignment import train_rl
    from alignment.args import RLArgs, parse
    from tests.conftest import build_tiny_model
    build_tiny_model(tokenizer).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    used = []
    real = StaticSampler._generate_batch
    monkeypatch.setattr(StaticSampler, "_generate_batch", lambda self, *a: used.append(1) or real(self, *a))
    args = parse(RLArgs, ["--model", str(tmp_path / "tiny"), "--n_steps", "1", "--group_size", "4",
                          "--rollout_batch_size", "8", "--train_batch_size", "8", "--sampling_max_tokens", "6",
                          "--eval_every", "0", "--rg_size", "40", "--precision", "fp32", "--hf_decoding", "static",
                          "--output_dir", str(tmp_path / "run")])
    metrics = train_rl.main(args)["last_metrics"][-1]
    assert used and metrics["step"] == 1 and metrics["sampled_tokens"] > 0
