"""Generated tokens per second of the HF backend at batch 1 and batch 32 (and vLLM vs HF on a GPU).

    uv run python bench/sampling.py [--model smollm2-135m] [--max_tokens 64]

Every completion is forced to exactly --max_tokens tokens (min_tokens = max_tokens), so each setting
does the same amount of work per sequence; prompts are GSM8K-length chat prompts.
"""

import argparse
import time

import torch

from alignment import models
from alignment.sampling import HFSampler, SamplingParams, make_sampler, pick_backend

QUESTION = "Natalia sold clips to {i} of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def tokens_per_second(sampler, prompts, max_tokens: int, batch: int) -> float:
    """Generate for `prompts` in batches of `batch` prompts; generated tokens per wall second."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=max_tokens, seed=0)
    sampler.generate(prompts[:1], SamplingParams(temperature=1.0, max_tokens=2, seed=0))  # warm-up
    start, generated = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        outputs = sampler.generate(prompts[i:i + batch], params)
        generated += sum(len(c.token_ids) for out in outputs for c in out)
    return generated / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    device = models.resolve_device(args.device)
    model, tokenizer = models.load_policy(args.model, device)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": QUESTION.format(i=40 + i)}],
                                             add_generation_prompt=True, tokenize=False) for i in range(32)]
    prompts = [tokenizer(p, add_special_tokens=False).input_ids for p in prompts]
    print(f"{args.model} on {device} ({torch.get_num_threads()} threads), {args.max_tokens} generated tokens "
          f"per sequence, prompts of ~{sum(map(len, prompts)) // len(prompts)} tokens")
    hf = HFSampler(model, tokenizer, batch_size=32)
    one = tokens_per_second(hf, prompts[:4], args.max_tokens, batch=1)
    many = tokens_per_second(hf, prompts, args.max_tokens, batch=32)
    print(f"HF batch 1 : {one:8.1f} generated tok/s")
    print(f"HF batch 32: {many:8.1f} generated tok/s   ({many / one:.1f}x batch 1)")
    if device.startswith("cuda") and pick_backend("auto", device) == "vllm":
        vllm = make_sampler("vllm", None, tokenizer, models.resolve_model(args.model), device)
        v_one = tokens_per_second(vllm, prompts[:4], args.max_tokens, batch=1)
        v_many = tokens_per_second(vllm, prompts, args.max_tokens, batch=32)
        print(f"vLLM batch 1 : {v_one:8.1f} generated tok/s   ({v_one / one:.1f}x HF)")
        print(f"vLLM batch 32: {v_many:8.1f} generated tok/s   ({v_many / many:.1f}x HF)")


if __name__ == "__main__":
    main()
