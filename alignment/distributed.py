"""Past one process: torchrun + FSDP2, as small functions that are no-ops in a single process.

    torchrun --nproc_per_node 2 -m alignment.train_rl ...          # one node, 2 processes
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 -m alignment.train_rl ...

`setup()` sees the launch (torchrun sets WORLD_SIZE, RANK, LOCAL_RANK), starts the process group (nccl on
GPUs, gloo on CPUs) and gives each rank its device. `shard()` wraps the policy with FSDP2's `fully_shard`,
one unit per decoder layer and then the root. FSDP averages gradients over ranks, so a rank divides its
loss by `per_rank_counts(n)` = (the global count) / world size wherever one process would divide by the
count n of the whole batch: the average of the ranks' gradients is then one process's gradient on the
whole batch. (Summing instead needs a reduce op that gloo lacks.) On GPU the compute runs in bf16 with
fp32 master weights (MixedPrecisionPolicy).

Rules every caller keeps: every rank makes the same number of forward and backward calls of a sharded
model, in the same order (each one all-gathers); `even_out(n)` tells a rank how many calls to make, and
the extra ones run on a masked dummy row. Gathering full weights (`full_state_items`) is a collective too.
"""

import os
from contextlib import contextmanager

import torch
import torch.distributed as dist

from alignment.errors import UserError


def launched() -> bool:
    """True in a process started by torchrun, with one process too (its elastic agent sets TORCHELASTIC_RUN_ID),
    or by any launcher that sets WORLD_SIZE > 1: such a process shards its policy with FSDP2."""
    return "TORCHELASTIC_RUN_ID" in os.environ or int(os.environ.get("WORLD_SIZE", "1")) > 1


def setup() -> str:
    """Start the process group when launched by torchrun; return this rank's device ("cpu" or "cuda:N")."""
    if not launched():
        return ""
    on_gpu = torch.cuda.is_available()
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if on_gpu else "cpu"
    if not dist.is_initialized():
        if on_gpu:
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group("nccl" if on_gpu else "gloo", device_id=torch.device(device) if on_gpu else None)
    return device


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def is_main() -> bool:
    return rank() == 0


def barrier():
    if dist.is_initialized():
        dist.barrier()


def global_sum(value: float) -> float:
    """The sum of `value` over ranks (itself in one process)."""
    return global_sums([value])[0] if dist.is_initialized() else value


def global_sums(values: list[float]) -> list[float]:
    """The sums over ranks of several numbers, in one collective (the numbers themselves in one process)."""
    if not dist.is_initialized():
        return list(values)
    tensor = _to_backend(torch.tensor([float(v) for v in values], dtype=torch.float64))
    dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def global_max(value: float) -> float:
    if not dist.is_initialized():
        return value
    tensor = _to_backend(torch.tensor([float(value)], dtype=torch.float64))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.cpu().item())


def global_min(value: float) -> float:
    return -global_max(-value)


def per_rank_counts(*counts: float) -> list[float]:
    """What a rank divides by where one process would divide by each of `counts` summed over the whole
    batch: the global sums over the world size (see the module docstring), in one collective. The counts
    themselves in one process."""
    return [total / world_size() for total in global_sums(counts)]


def gather_objects(obj) -> list:
    """Every rank's `obj` (picklable), in rank order; [obj] in one process."""
    if not dist.is_initialized() or world_size() == 1:
        return [obj]
    out = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def even_out(count: int) -> int:
    """How many collective calls this rank makes so that all make the same number: the most of any rank."""
    return int(global_max(count))


def microbatches(items: list, size: int, collective: bool) -> list[list]:
    """`items` in consecutive parts of `size`, evened out over ranks when `collective` (see `evened`)."""
    return evened([items[i:i + size] for i in range(0, len(items), size)], collective)


def evened(parts: list[list], collective: bool) -> list[list]:
    """`parts`; when `collective` (a sharded model runs on each part), as many as the busiest rank has, the
    extra ones empty, on which the caller runs a dummy forward (and backward) so that every rank's
    collectives line up."""
    return parts + [[] for _ in range(even_out(len(parts)) - len(parts))] if collective else parts


def _to_backend(tensor: torch.Tensor) -> torch.Tensor:
    # nccl reduces CUDA tensors only; gloo CPU tensors
    return tensor.cuda() if dist.get_backend() == "nccl" else tensor


def shard(model, device: str, bf16: bool = True):
    """FSDP2: `fully_shard` each decoder layer, then the root (gradients averaged over ranks). On GPU with
    `bf16`, bf16 compute with fp32 parameters and fp32 gradient reduction (on CPU, autocast does the bf16)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if device.startswith("cuda") and bf16 else MixedPrecisionPolicy()
    for layer in model.get_decoder().layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def full_state_items(model):
    """(name, full tensor) for every entry of the model's state dict, gathered one at a time (a collective
    under FSDP: every rank must iterate it to the end), so no rank holds two full copies at once."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class GatherOnly:
    """The sampler of a rank that does not evaluate: it joins every weight gather and keeps nothing."""

    def load_weights(self, items):
        for _ in items:
            pass


def grad_norm_and_clip(model, max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, returning the global norm as a 0-d tensor (a plain one also for sharded, DTensor,
    gradients), left on the device: reading it is a host sync, which the caller does once per step."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


@contextmanager
def main_first():
    """Run the body on rank 0 first (e.g. converting the packaged model once), then on the others."""
    if not is_main():
        barrier()
    yield
    if is_main():
        barrier()


def refuse(flag_values: dict):
    """Under torchrun, refuse flags whose meaning is per-device roles in one process (one line each)."""
    if not launched():
        return
    for flag, value in flag_values.items():
        if value:
            raise UserError(f"{flag} places a role on a device in one process; under torchrun every rank runs the "
                            f"whole loop on its own device (LOCAL_RANK): drop {flag}.")


def save_optimizer(path, model, optimizer):
    """The optimizer's state with torch.distributed.checkpoint: each rank writes its own shards (one
    process writes them all); keyed by parameter name, so it loads into another world size too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    with _single_process_quiet():
        dcp.save({"optimizer": get_optimizer_state_dict(model, optimizer)}, checkpoint_id=str(path),
                 no_dist=not dist.is_initialized())


def load_optimizer(path, model, optimizer):
    """Load what `save_optimizer` wrote into `optimizer` (of the already sharded `model`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    with _single_process_quiet():
        state = {"optimizer": get_optimizer_state_dict(model, optimizer)}
        dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        set_optimizer_state_dict(model, optimizer, state["optimizer"])


@contextmanager
def _single_process_quiet():
    """torch.distributed.checkpoint warns that it runs in one process; here that is the plan, not news."""
    import warnings
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield
