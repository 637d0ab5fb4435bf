"""Generation cost versus thinking length N: LongCoT (one growing KV cache) against Delethink (chunks of
C tokens, the KV cache thrown away at every boundary and the m-token carryover re-prefilled).

    uv run python bench/delethink_scaling.py [--lengths 1024 2048 4096 8192 16384] [--chunk_size 1024]

A tiny random Llama (d=64, 2 layers, vocab 256, built from a config: no download, no tokenizer) decodes
greedily with EOS ignored, so every run produces exactly N tokens. Time is CPU time of this process
(`time.process_time`, one torch thread, min over repeats): wall time on a shared box is too noisy. KV
bytes are summed from the cache tensors; attention FLOPs are counted analytically (QK^T and AV, causal).
LongCoT's attention grows as N^2 and its cache as N; Delethink's as N*C and C. With d=64 attention
dominates past a context of ~6d tokens, so the crossover is low here (the paper's 1.5B model needs ~30K).
Delethink's carryover uses `alignment.delethink.next_prompt`, the same cut as the rollout mode.
Writes a PNG (time per token and KV MB versus N) when matplotlib is installed.
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from alignment.delethink import next_prompt  # noqa: E402

PROMPT_LENGTH = 64


def build_model(max_positions: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=max_positions)
    return LlamaForCausalLM(config).eval()


def kv_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


@torch.no_grad()
def decode(model, context: list[int], new_tokens: int) -> tuple[list[int], int]:
    """Prefill `context` into a fresh cache (positions from 0), then decode greedily, EOS ignored."""
    cache = DynamicCache()
    logits = model(input_ids=torch.tensor([context]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
    tokens = []
    for step in range(new_tokens):
        token = logits[:, -1].argmax(-1)  # (1,)
        tokens.append(token.item())
        if step + 1 < new_tokens:
            logits = model(input_ids=token[:, None], past_key_values=cache, use_cache=True).logits
    return tokens, kv_bytes(cache)


def longcot(model, prompt, n_tokens, chunk_size, carryover, keep_head):
    _, kv = decode(model, prompt, n_tokens)
    return kv, []


def delethink(model, prompt, n_tokens, chunk_size, carryover, keep_head):
    """Chunks until N tokens exist; returns the peak KV bytes and each chunk's CPU seconds."""
    response, peak, chunk_seconds = [], 0, []
    while len(response) < n_tokens:
        start = time.process_time()
        if not response:
            context, budget = prompt, chunk_size
        else:
            context, budget = next_prompt(prompt, response, keep_head, carryover - keep_head), chunk_size - carryover
        tokens, kv = decode(model, context, min(budget, n_tokens - len(response)))
        response += tokens
        peak = max(peak, kv)
        chunk_seconds.append(time.process_time() - start)
    return peak, chunk_seconds


def attention_flops(n_tokens, chunk_size, carryover, layers=2, width=64, prompt=PROMPT_LENGTH) -> tuple[int, int]:
    """Causal QK^T + AV multiply-adds (x2 for FLOPs) summed over every query: (LongCoT, Delethink)."""
    per_pair = 4 * layers * width  # 2 FLOPs x (QK^T + AV) x d, per layer, per (query, key) pair
    keys = lambda start, stop: (stop * (stop + 1) - start * (start + 1)) // 2  # sum of contexts start+1..stop
    long = keys(0, prompt + n_tokens)
    deli, done = keys(0, prompt + min(chunk_size, n_tokens)), min(chunk_size, n_tokens)
    while done < n_tokens:
        new = min(chunk_size - carryover, n_tokens - done)
        deli += keys(0, prompt + carryover + new)  # re-prefill of prompt + carryover, then decoding
        done += new
    return per_pair * long, per_pair * deli


def fit(lengths, seconds) -> tuple[float, float]:
    """Least squares t = a*N + b*N^2."""
    n = torch.tensor(lengths, dtype=torch.float64)
    design = torch.stack([n, n**2], dim=1)
    a, b = torch.linalg.lstsq(design, torch.tensor(seconds, dtype=torch.float64)[:, None]).solution[:, 0].tolist()
    return a, b


def plot(path, lengths, results, chunk_size):
    try:
        import matplotlib
    except ImportError:
        print("[bench] matplotlib is not installed: skipping the plot (add it to the environment to get the PNG)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, rows in results.items():
        left.plot(lengths, [r["seconds"] / n * 1e3 for r, n in zip(rows, lengths)], "o-", label=name)
        right.plot(lengths, [r["kv"] / 2**20 for r in rows], "o-", label=name)
    left.set(xscale="log", xlabel="thinking tokens N", ylabel="CPU ms per token", title="generation cost per token")
    right.set(xscale="log", xlabel="thinking tokens N", ylabel="peak KV cache (MiB)",
              title=f"KV memory (Delethink C={chunk_size})")
    for axis in (left, right):
        axis.legend()
        axis.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"[bench] wrote {path}")


def main(args):
    torch.set_num_threads(1)
    carryover = args.carryover if args.carryover is not None else args.chunk_size // 2
    model = build_model(PROMPT_LENGTH + max(args.lengths) + 1)
    prompt = torch.randint(0, 256, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(0)).tolist()
    decode(model, prompt, 16)  # warm-up
    results = {"LongCoT": [], "Delethink": []}
    print(f"[bench] tiny Llama d=64 L=2 vocab 256, |q|={PROMPT_LENGTH}, Delethink C={args.chunk_size} "
          f"m={carryover} keep_head={args.keep_head}, CPU time with 1 thread, min of {args.repeats}")
    print(f"{'N':>6} | {'mode':<9} | {'CPU s':>7} | {'ms/token':>8} | {'peak KV MiB':>11} | {'attn GFLOP':>10}")
    for n_tokens in args.lengths:
        flops = dict(zip(results, attention_flops(n_tokens, args.chunk_size, carryover)))
        for name, run in (("LongCoT", longcot), ("Delethink", delethink)):
            best, kv, chunks = float("inf"), 0, []
            for _ in range(args.repeats):
                start = time.process_time()
                kv, chunk_seconds = run(model, prompt, n_tokens, args.chunk_size, carryover, args.keep_head)
                seconds = time.process_time() - start
                if seconds < best:
                    best, chunks = seconds, chunk_seconds
            results[name].append({"seconds": best, "kv": kv, "chunks": chunks})
            print(f"{n_tokens:>6} | {name:<9} | {best:>7.2f} | {best / n_tokens * 1e3:>8.3f} | {kv / 2**20:>11.2f} | "
                  f"{flops[name] / 1e9:>10.2f}", flush=True)

    lengths = args.lengths
    for name, rows in results.items():
        a, b = fit(lengths, [r["seconds"] for r in rows])
        growth = (rows[-1]["seconds"] / lengths[-1]) / (rows[0]["seconds"] / lengths[0])
        print(f"[fit] {name:<9}: t = {a:.3e}*N + {b:.3e}*N^2  (b*N/a at N={lengths[-1]}: {b * lengths[-1] / a:.2f}); "
              f"per-token cost x{growth:.2f} from N={lengths[0]} to N={lengths[-1]}")
    chunks = results["Delethink"][-1]["chunks"]
    later = chunks[1:-1] or chunks[1:]
    if later:
        print(f"[delethink] per-chunk CPU s at N={lengths[-1]}: first {chunks[0]:.2f}, later chunks "
              f"{min(later):.2f}-{max(later):.2f} ({len(chunks)} chunks): flat in the chunk index")
    long, deli = results["LongCoT"][-1], results["Delethink"][-1]
    print(f"[ratio] at N={lengths[-1]}: per-token CPU time LongCoT/Delethink = "
          f"{long['seconds'] / deli['seconds']:.2f}, "
          f"peak KV LongCoT/Delethink = {long['kv'] / deli['kv']:.1f}")
    plot(args.plot, lengths, results, args.chunk_size)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384],
                        help="thinking lengths N to measure")
    parser.add_argument("--chunk_size", type=int, default=1024, help="Delethink C")
    parser.add_argument("--carryover", type=int, default=None, help="Delethink m (default C/2)")
    parser.add_argument("--keep_head", type=int, default=100, help="Delethink head kept from chunk 1")
    parser.add_argument("--repeats", type=int, default=2, help="runs per point; the minimum CPU time is kept")
    parser.add_argument("--plot", default="outputs/bench/delethink_scaling.png", help="where to write the PNG")
    main(parser.parse_args())
