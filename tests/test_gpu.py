"""What needs CUDA: the device roles and `--precision auto` on a GPU, bf16 autocast over fp32 master weights,
a train step on cuda:0 against the same step on the CPU, the hand-built device_map on one GPU, NCCL with
FSDP2's `fully_shard` in one process, and the weight push into a sampler on the GPU.

Marked `gpu`; each skips where torch sees no CUDA device (every CPU machine, CI). bench/gpu_pass.py runs
them on a lent GPU (`pytest -m gpu`).
"""

import copy
import os

import pytest
import torch

from alignment import distributed, models
from alignment.grpo import grpo_microbatch_train_step
from alignment.sampling import HFSampler, SamplingParams, WeightPush
from alignment.tokens import get_response_log_probs
from tests.conftest import build_tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

GPU = "cuda:0"


def test_one_gpu_takes_every_role_and_auto_precision_is_bf16_over_fp32_weights():
    roles = models.assign_device_roles(models.available_devices())
    assert roles == {"policy": [GPU], "sample": GPU, "reference": GPU, "eval": GPU, "critic": GPU}
    assert models.resolve_device(None) == GPU
    assert models.resolve_precision("auto", GPU) == "bf16"  # every H100/H200 computes bf16
    dtype, autocast = models.train_precision(GPU, "auto")
    assert dtype == torch.float32 and autocast.fast_dtype == torch.bfloat16
    assert models.train_precision(GPU, "auto", bf16_weights=True)[0] == torch.bfloat16
    assert models.default_dtype(GPU, "auto") == torch.bfloat16  # sampler, reference and evaluation copies


def _batch(tokenizer, rows: int = 4, length: int = 12, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, len(tokenizer), (rows, length + 1), generator=generator)
    mask = torch.ones(rows, length)
    mask[:, : length // 3] = 0  # a prompt part
    mask[0, -3:] = 0  # and a shorter row
    return ids[:, :-1], ids[:, 1:], mask


def test_autocast_keeps_fp32_master_weights_and_fp32_log_probs(tokenizer):
    model = build_tiny_model(tokenizer).to(GPU).train()
    inputs, labels, _ = _batch(tokenizer)
    _, autocast = models.train_precision(GPU, "auto")
    with autocast:
        out = get_response_log_probs(model, inputs.to(GPU), labels.to(GPU), return_token_entropy=True)
        inner = model.model.layers[0].mlp.down_proj(torch.randn(2, 128, device=GPU))
    assert inner.dtype == torch.bfloat16  # the matmuls did run in bf16
    assert out["log_probs"].dtype == torch.float32 and out["token_entropy"].dtype == torch.float32
    out["log_probs"].sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())


def _train_step(model, device, inputs, labels, mask, autocast, old=None):
    """One GRPO-clip microbatch step (the CS336 function): its loss, gradient norm and log-probs. `old`: the
    old log-probs (default: the step's own, ratio 1)."""
    model.zero_grad()
    advantages = torch.tensor([[1.0], [-0.5], [0.25], [-1.0]], device=device)
    with autocast:
        logp = get_response_log_probs(model, inputs.to(device), labels.to(device))["log_probs"]
    old = logp.detach() if old is None else old.to(device)
    loss, _ = grpo_microbatch_train_step(logp, mask.to(device), 1, "grpo_clip", None, advantages, old, 0.2)
    grad_norm = torch.norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    return loss.item(), grad_norm.item(), logp.detach().cpu()


def test_a_train_step_on_the_gpu_gives_the_cpu_loss_within_bf16_tolerance(tokenizer):
    cpu_model = build_tiny_model(tokenizer).train()
    gpu_model = copy.deepcopy(cpu_model).to(GPU)
    inputs, labels, mask = _batch(tokenizer)
    old = get_response_log_probs(cpu_model, inputs, labels)["log_probs"].detach() + 0.05  # ratios near 0.95
    cpu = _train_step(cpu_model, "cpu", inputs, labels, mask, models.train_precision("cpu", "fp32")[1], old)
    fp32 = _train_step(gpu_model, GPU, inputs, labels, mask, models.train_precision(GPU, "fp32")[1], old)
    bf16 = _train_step(gpu_model, GPU, inputs, labels, mask, models.train_precision(GPU, "auto")[1], old)
    assert fp32[0] == pytest.approx(cpu[0], rel=1e-4, abs=1e-5) and fp32[1] == pytest.approx(cpu[1], rel=1e-3)
    assert torch.allclose(fp32[2], cpu[2], atol=1e-3)  # TF32 may be on for fp32 matmuls: ~1e-3
    assert bf16[0] == pytest.approx(cpu[0], rel=2e-2, abs=2e-3) and bf16[1] == pytest.approx(cpu[1], rel=5e-2)
    assert (bf16[2] - cpu[2]).abs().max() < 0.1  # bf16: 8 bits of mantissa in each matmul


def test_the_hand_built_device_map_places_every_layer_on_one_gpu(tokenizer, tiny_model_dir):
    device_map = models.partition_layers(2, [GPU])
    assert set(device_map.values()) == {GPU}
    policy = models.load_model(tiny_model_dir, GPU, torch.float32, device_map=device_map)
    assert {p.device for p in policy.parameters()} == {torch.device(GPU)}
    reference = models.load_model(tiny_model_dir, "cpu", torch.float32)
    inputs, labels, _ = _batch(tokenizer)
    with torch.no_grad():
        on_gpu = get_response_log_probs(policy, inputs.to(GPU), labels.to(GPU))["log_probs"].cpu()
        on_cpu = get_response_log_probs(reference, inputs, labels)["log_probs"]
    assert torch.allclose(on_gpu, on_cpu, atol=1e-3)


def test_nccl_and_fully_shard_in_one_process_train_like_the_plain_model(tokenizer, tmp_path, monkeypatch):
    plain = build_tiny_model(tokenizer).to(GPU).train()
    sharded = copy.deepcopy(plain)
    inputs, labels, mask = _batch(tokenizer)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "gpu-test")  # as torchrun --nproc_per_node 1 sets it
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29400 + os.getpid() % 1000))
    try:
        assert distributed.setup() == GPU and torch.distributed.get_backend() == "nccl"
        distributed.shard(sharded, GPU, bf16=False)
        expected = _train_step(plain, GPU, inputs, labels, mask, models.train_precision(GPU, "fp32")[1])
        got = _train_step(sharded, GPU, inputs, labels, mask, models.train_precision(GPU, "fp32")[1])
        assert got[0] == pytest.approx(expected[0], rel=1e-5, abs=1e-6)
        assert got[1] == pytest.approx(expected[1], rel=1e-4)
        assert distributed.global_sum(2.5) == 2.5  # an all-reduce on NCCL
        full = dict(distributed.full_state_items(sharded))
        assert all(full[name].device.type == "cuda" for name in full)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_weight_push_reaches_a_sampler_on_the_gpu(tokenizer):
    policy = build_tiny_model(tokenizer).to(GPU)
    sampler = HFSampler(build_tiny_model(tokenizer, seed=1).to(GPU).to(torch.bfloat16), tokenizer)
    prompt = [tokenizer.encode("1 + 1 =")]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    push = WeightPush(policy)
    push.policy_changed()
    assert push(sampler) > 0
    for name, tensor in policy.state_dict().items():
        assert torch.equal(sampler.model.state_dict()[name], tensor.to(torch.bfloat16)), name
    own = HFSampler(copy.deepcopy(policy).to(torch.bfloat16), tokenizer)
    assert sampler.generate(prompt, greedy)[0][0].token_ids == own.generate(prompt, greedy)[0][0].token_ids
    assert push(sampler) == 0.0  # in sync: not pushed again


def test_the_static_sampler_compiles_on_the_gpu_and_decodes_as_the_reference(tokenizer):
    """On CUDA `--hf_decoding static` is the static-shape sampler with its decode step compiled and captured; it gives
    the reference loop's tokens on the same uniforms, and its counter draws equal the CPU's."""
    from alignment.samplers import make_sampler
    from alignment.static_sampler import StaticSampler, counter_draws, counter_uniforms
    model = build_tiny_model(tokenizer).to(GPU)
    model.lm_head.weight = torch.nn.Parameter(torch.randn_like(model.lm_head.weight) * 3)
    static = make_sampler("hf", model, tokenizer, batch_size=8, decoding="static")
    assert isinstance(static, StaticSampler) and static.compile

    class CounterReference(HFSampler):
        def _uniforms(self, seeds, device):
            return counter_draws(seeds, device)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13, 14, 15, 16], [17]]
    for params in (SamplingParams(n=2, temperature=0, max_tokens=24),
                   SamplingParams(n=2, temperature=1.0, max_tokens=24, seed=5, logprobs=True)):
        ours = static.generate(prompts, params)
        theirs = CounterReference(model, tokenizer, batch_size=8).generate(prompts, params)
        assert [[c.token_ids for c in g] for g in ours] == [[c.token_ids for c in g] for g in theirs]
    assert static.compile_seconds > 0
    seeds = torch.arange(1000, dtype=torch.int64) * 7919
    assert torch.equal(counter_uniforms(seeds.to(GPU), 3).cpu(), counter_uniforms(seeds, 3))
