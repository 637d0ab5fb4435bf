"""What a GPU would pay for in one optimizer step, counted on the CPU (issue 61's guard): aten operations per
decoder layer and host reads per optimizer step, under a `TorchDispatchMode`. On a GPU each operation is a
kernel launch plus its Python (10-20 us), and each host read (`.item()`, a Python `bool` of a tensor, boolean
mask indexing, `.tolist()`) stops the CPU from running ahead of the GPU; the H200 pass measured the train
phase at 4-13% of the GPU's FLOP rate for exactly these (docs/log.md, "The GPU pass: one H100 or H200").

Counted 2026-11-28 (before any of issue 61's levers), one optimizer step of train_rl on a tiny
Llama (8 rows of 6 tokens in 2 microbatches of 4, groups of 4 packed into one forward, fp32): 449 aten
operations per decoder layer (the difference between a 4-layer and a 2-layer model, halved); 28 host reads:
23 `_local_scalar_dense` (`.item()` / `bool()`), 4 boolean-mask indexings, 1 `.tolist()`. The budgets below
were those counts. Then (issue 61, part 2) every logged number stays on the device and is read once per RL
step (train_rl._Means), the rollout-correction check runs once per step on the host, and the step's only read
is whether its loss and gradient are finite: 3 host reads (that one, and two counts of the experience, which
lives on the host), 1 `.tolist()` (also of host tensors)."""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from alignment import train_rl
from alignment.args import RLArgs
from tests.conftest import build_tiny_model

OPS_PER_LAYER_BUDGET = 449
HOST_READS_BUDGET = 4  # was 28: 23 scalar reads, 4 boolean-mask indexings, one .tolist()


class Counted(TorchDispatchMode):
    """Counts every aten operation; host reads apart: a scalar read, nonzero, masked_select, and indexing with
    a boolean mask (on a GPU it runs nonzero, a sync; on the CPU its nonzero is inside the kernel, not seen)."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_reads = 0, collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "nonzero", "masked_select"):
            self.host_reads[name] += 1
        elif name == "index" and any(i is not None and i.dtype == torch.bool for i in args[1]):
            self.host_reads["boolean index"] += 1
        return func(*args, **(kwargs or {}))


def count_an_optimizer_step(tokenizer, tmp_path, monkeypatch, layers: int) -> tuple[int, collections.Counter]:
    model_dir = tmp_path / f"tiny{layers}"
    build_tiny_model(tokenizer, num_layers=layers).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    real, counts = train_rl._optimizer_step, []

    def counted(*args, **kwargs):
        mode, tolist = Counted(), torch.Tensor.tolist

        def counting_tolist(tensor):
            mode.host_reads["tolist"] += 1
            return tolist(tensor)
        monkeypatch.setattr(torch.Tensor, "tolist", counting_tolist)
        try:
            with mode:
                return real(*args, **kwargs)
        finally:
            monkeypatch.setattr(torch.Tensor, "tolist", tolist)
            counts.append(mode)
    monkeypatch.setattr(train_rl, "_optimizer_step", counted)
    monkeypatch.setattr(train_rl, "silent_rows", lambda *a: [])  # the GPU's path (silent rows are CPU-only)
    args = RLArgs(model=str(model_dir), n_steps=1, group_size=4, rollout_batch_size=8, train_batch_size=8,
                  train_mini_batch_size=4, sampling_max_tokens=6, sampling_min_tokens=6, eval_every=0, rg_size=40,
                  precision="fp32", output_dir=str(tmp_path / f"run{layers}"))
    args.check()
    train_rl.main(args)
    [mode] = counts
    return mode.ops, mode.host_reads


def test_an_optimizer_step_stays_within_its_launch_and_sync_budget(tokenizer, tmp_path, monkeypatch):
    ops2, reads2 = count_an_optimizer_step(tokenizer, tmp_path, monkeypatch, 2)
    ops4, reads4 = count_an_optimizer_step(tokenizer, tmp_path, monkeypatch, 4)
    per_layer = (ops4 - ops2) / 2
    assert 0 < per_layer <= OPS_PER_LAYER_BUDGET, f"{per_layer} aten operations per decoder layer"
    assert sum(reads4.values()) <= HOST_READS_BUDGET, f"host reads in one optimizer step: {dict(reads4)}"
    assert reads2 == reads4  # host reads do not grow with depth
