"""The HF samplers' decode rate beside the memory-bandwidth floor of a decode step, measured in the same run.

    uv run python bench/decode_rate.py --model smollm2-135m                       # CPU: the loop and the static sampler
    python3 bench/decode_rate.py --model DIR --device cuda --batch 64 --tokens 256  # a GPU (bench/gpu_pass.py's sampler stage)

Each sampler generates `--batch` completions of exactly `--tokens` tokens (min_tokens = max_tokens, temperature 1)
for `--batch` different prompts of `--prompt_tokens` random token ids, after a warm-up of the same shape (the
static sampler compiles and captures its step there on CUDA: that time is printed apart). A decode step must at
least read every weight once and every row's cached keys and values: its floor is those bytes over the device's
copy rate (a large tensor copied, read plus written bytes per second), measured here.
"""

import argparse
import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alignment import models  # noqa: E402
from alignment.errors import UserError  # noqa: E402
from alignment.sampling import HFSampler, SamplingParams  # noqa: E402
from alignment.static_sampler import StaticSampler  # noqa: E402

# static_eager: the static sampler without its compiled step (on the CPU it is never compiled: the same as static)
SAMPLERS = {"loop": HFSampler, "static": StaticSampler, "static_eager": functools.partial(StaticSampler, compile=False)}


def copy_rate(device: str, mib: int = 512, seconds: float = 1.0) -> float:
    """Bytes per second moved by copying a `mib` MiB tensor on `device` (read + write), best of repeats."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = max(best, 2 * src.numel() / (time.perf_counter() - start))
    return best


def _sync(device: str):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def step_bytes(model, batch: int, context: float) -> float:
    """Bytes a decode step reads at least: every parameter once, and each row's keys and values over its
    `context` tokens."""
    config = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    element = next(model.parameters()).element_size()
    return weights + 2 * config.num_hidden_layers * kv_heads * head_dim * element * batch * context


def measure(sampler, prompts, tokens: int, device: str) -> dict:
    params = SamplingParams(temperature=1.0, max_tokens=tokens, min_tokens=tokens, seed=0)
    sampler.generate(prompts, params)  # warm-up of the same shape: kernels, allocator, compiling and capturing
    _sync(device)
    start = time.perf_counter()
    outputs = sampler.generate(prompts, SamplingParams(**{**params.__dict__, "seed": 1}))
    _sync(device)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for out in outputs for c in out)
    return {"tokens_per_s": round(generated / seconds, 1), "ms_per_step": round(1000 * seconds / tokens, 2),
            "compile_s": round(getattr(sampler, "compile_seconds", 0.0), 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2-135m", help="a model name or folder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=16, help="completions per generate call (one per prompt)")
    parser.add_argument("--tokens", type=int, default=64, help="generated tokens per completion (forced)")
    parser.add_argument("--prompt_tokens", type=int, default=100)
    parser.add_argument("--samplers", default="loop,static", help=f"comma-separated: {', '.join(SAMPLERS)}")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    unknown = set(args.samplers.split(",")) - set(SAMPLERS)
    if unknown or min(args.batch, args.tokens, args.prompt_tokens) < 1:
        parser.error(f"--samplers takes {', '.join(SAMPLERS)}; --batch, --tokens and --prompt_tokens are 1 or more")
    model = models.load_model(args.model, args.device)
    tokenizer = models.load_tokenizer(args.model)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, len(tokenizer) - 100, (args.batch, args.prompt_tokens), generator=generator).tolist()
    rate = copy_rate(args.device)
    floor_ms = 1000 * step_bytes(model, args.batch, args.prompt_tokens + args.tokens / 2) / rate
    results = {"device": args.device, "dtype": str(next(model.parameters()).dtype), "batch": args.batch,
               "tokens": args.tokens, "copy_gb_per_s": round(rate / 1e9, 1), "floor_ms_per_step": round(floor_ms, 3),
               "threads": torch.get_num_threads()}
    for name in args.samplers.split(","):
        try:
            results[name] = measure(SAMPLERS[name](model, tokenizer, batch_size=args.batch), prompts, args.tokens,
                                    args.device)
        except UserError as e:  # the static sampler that does not compile here: the other sampler still measured
            results[name] = {"error": str(e)}
            print(f"{name:6s} error: {e}", flush=True)
            continue
        results[name]["floor_fraction"] = round(floor_ms / results[name]["ms_per_step"], 4)
        print(f"{name:6s} {json.dumps(results[name])}", flush=True)
    if all("tokens_per_s" in results.get(name, {}) for name in ("loop", "static")):
        results["static_over_loop"] = round(results["static"]["tokens_per_s"] / results["loop"]["tokens_per_s"], 2)
    print(json.dumps(results), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
