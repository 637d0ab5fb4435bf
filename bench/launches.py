"""Operations per decoder layer in one optimizer step, eager against --compile_layers, counted on the CPU.

    uv run python bench/launches.py             # a tiny Llama, fp32; about a minute (inductor compiles twice)

What a GPU pays before FLOPs is a launch per operation (issue 61). tests/test_dispatch.py counts the eager step's
top-level aten operations with a TorchDispatchMode, which torch.compile does not run under; this counts with
torch.profiler instead: every aten operation, nested ones too (an `aten::linear` and the `aten::mm` it calls are
two), and the compiled regions. A compiled layer's element-wise work runs as fused kernels that are no aten
operations; what stays are the matrix products (extern kernels), their views, and autograd's gradient
accumulation. "Not views or allocations" leaves out the operations a GPU launches no kernel for. Per layer =
(the 4-layer count - the 2-layer count) / 2, on train_rl's second optimizer step (the first compiles): 8 rows
of 6 tokens, 2 microbatches of 4, groups of 4 packed, as tests/test_dispatch.py. The models and runs go to a
temporary folder, removed at the end.
"""

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from alignment import models, train_rl  # noqa: E402
from alignment.args import RLArgs  # noqa: E402
from tests.conftest import build_tiny_model  # noqa: E402


# operations that launch no kernel on a GPU: views, metadata, allocation
NO_KERNEL = {"as_strided", "transpose", "t", "view", "reshape", "_reshape_alias", "_unsafe_view", "resolve_conj",
             "resolve_neg", "expand", "unsqueeze", "squeeze", "detach", "permute", "slice", "select", "alias", "split",
             "chunk", "unbind", "narrow", "empty", "empty_strided", "empty_like", "lift_fresh", "contiguous"}


def count_second_step(tokenizer, layers: int, compiled: bool, work: Path) -> collections.Counter:
    """Profiler events (name -> count) of train_rl's second optimizer step on a random `layers`-layer Llama."""
    folder = work / f"{layers}-{compiled}"
    build_tiny_model(tokenizer, num_layers=layers).save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    real, seen = train_rl._optimizer_step, []

    def profiled(*args, **kwargs):
        if not seen:  # the first step warms up (and compiles)
            seen.append(None)
            return real(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out = real(*args, **kwargs)
        seen.append(collections.Counter({e.key: e.count for e in prof.key_averages()}))
        return out
    train_rl._optimizer_step = profiled
    try:
        args = RLArgs(model=str(folder / "model"), n_steps=2, group_size=4, rollout_batch_size=8, train_batch_size=8,
                      train_mini_batch_size=4, sampling_max_tokens=6, sampling_min_tokens=6, eval_every=0, rg_size=40,
                      precision="fp32", compile_layers=compiled, output_dir=str(folder / "run"))
        args.check()
        train_rl.main(args)
    finally:
        train_rl._optimizer_step = real
    return seen[-1]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--top", type=int, default=8, help="the operations with the most calls per layer to show")
    args = parser.parse_args()
    tokenizer = models.load_tokenizer("smollm2-135m")
    print(f"[bench] torch {torch.__version__}; torch.compile backend {models.COMPILE_BACKEND}; one optimizer step")
    for compiled in (False, True):
        with tempfile.TemporaryDirectory(prefix="launches-") as work:
            two, four = (count_second_step(tokenizer, n, compiled, Path(work)) for n in (2, 4))
        per_layer = {k: (four[k] - two[k]) / 2 for k in four}
        aten = sum(v for k, v in per_layer.items() if k.startswith("aten::"))
        kernels = sum(v for k, v in per_layer.items() if k.startswith("aten::") and k[6:] not in NO_KERNEL)
        regions = sum(v for k, v in per_layer.items() if k.startswith(("Torch-Compiled", "CompiledFunction")))
        top = sorted(((v, k) for k, v in per_layer.items() if k.startswith("aten::")), reverse=True)[:args.top]
        print(f"{'--compile_layers' if compiled else 'eager':17} aten operations per layer {aten:7.1f}, not views or "
              f"allocations {kernels:6.1f} | compiled regions per layer {regions:4.1f} | most: "
              + ", ".join(f"{k[6:]} {v:.0f}" for v, k in top), flush=True)


if __name__ == "__main__":
    main()
