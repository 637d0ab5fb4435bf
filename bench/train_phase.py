"""The train phase of one RL step, lever by lever, against its floor: seconds, share of the floor, peak RSS.

    uv run python bench/train_phase.py                         # every variant, 3 timed steps each
    uv run python bench/train_phase.py --variants plain,default --precision bf16
    uv run python bench/train_phase.py --variants default --profile     # where the time goes (torch profiler)
    uv run python bench/train_phase.py --variants unpacked,default --rows 32 --groups 8 --min_tokens 15 \
        --max_tokens 45       # the default RL run's shape: 8 questions x 4 short answers, 4 microbatches

One step is what `train_rl` does with a rollout batch on-policy (`bench/rl_step.py`'s setting): 16 responses
of 128 tokens to one GSM8K prompt (r1_zero), two microbatches of 8 through `tokens.rollout_log_probs` (with
entropy) and `grpo.policy_microbatch_train_step` (GRPO-clip), then one AdamW step. The responses are random
tokens, the advantages random: the work, not the learning, is measured. `--groups` spreads the rows over that
many questions (the first GSM8K test ones) and `--min_tokens` draws each response's length between it and
`--max_tokens`: the default RL run's shape is `--rows 32 --groups 8 --min_tokens 15 --max_tokens 45`. Each
variant runs in a fresh process (its peak RSS is its own), on the same model, data and threads:

  plain         the full-vocabulary logits, torch's default (per-tensor) AdamW and transformers' SDPA attention:
                the code before the levers
  fused_head    plain with the output head fused with the log-softmax and entropy (alignment/head.py)
  sdpa_attn     fused head and fused AdamW (models.adamw), transformers' SDPA attention
  default       sdpa_attn with the project's attention (alignment/attention.py), the head's logits kept for its
                backward (head.SAVE_LOGITS_BYTES) and the prompt run once for both microbatches
                (tokens.SharedPrompts), and groups of at most tokens.PACK_TOKENS tokens packed into one forward:
                what the scripts run today
  unpacked      default with a prompt cache for every group instead of packing small ones (the code before
                packing; only groups of the default run's size pack: 4 short answers on a question)
  recompute_head    default with the head's logits recomputed in backward (the code before eca2bcd)
  prompt_per_microbatch  default with each microbatch running the prompt itself (the code before SharedPrompts)
  keep_memory   default with glibc keeping freed memory for the next step (alignment/allocator.py), what the
                training scripts' --keep_freed_memory does
  compiled      default with the decoder layers compiled (--compile_layers, inductor: one graph for every layer,
                the element-wise work fused) for the forwards without a cache (packed groups); the warm-up step
                holds the compile
  eager_attn    default with transformers' eager attention instead (measured, not adopted:
                docs/results.md "The train phase, lever by lever")

The floor is 6 N FLOPs per token (N parameters, the tied head included) over each question's prompt once and
every response token, at this CPU's matmul rate in the run's precision, measured in the same run (the same
2048x576 by 576x1536 matmul as bench/rl_step.py). The CPU's reported bf16/AVX flags are printed beside it.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # bench/ is not a package: its scripts share code through the project root

from alignment import allocator, data, grpo, head, models, tokens  # noqa: E402
from alignment.evaluate import build_prompts  # noqa: E402
from bench.rl_step import matmul_peak  # noqa: E402
VARIANTS = ("plain", "fused_head", "sdpa_attn", "default", "unpacked", "recompute_head", "prompt_per_microbatch",
            "keep_memory", "eager_attn", "compiled")


def cpu_flags() -> str:
    """The matmul-relevant flags this CPU reports (what --precision auto decides from)."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    shown = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return " ".join(shown) or "none of avx2/avx512/amx"


def run_variant(args, variant: str) -> dict:
    """One variant in this process: the timed steps' seconds and this process's peak RSS."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if variant == "keep_memory":
        allocator.keep_freed_memory()
    if variant == "plain":
        tokens._fused_scale = lambda model: None  # the full-logits path
    if variant in ("plain", "fused_head", "sdpa_attn", "recompute_head"):
        head.SAVE_LOGITS_BYTES = 0  # (plain: unused)
    tokens.PACK_TOKENS = 0 if variant in ("plain", "fused_head", "sdpa_attn", "unpacked") else args.pack_tokens
    model = models.load_model(args.model)
    if variant in ("plain", "fused_head", "sdpa_attn", "eager_attn"):
        model.set_attn_implementation("eager" if variant == "eager_attn" else "sdpa")
    if variant == "compiled":
        models.compile_layers(model)
    model.train()
    _, autocast = models.train_precision("cpu", args.precision)
    adamw = (torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95)) if variant in ("plain", "fused_head") else
             models.adamw(model.parameters(), lr=1e-5, weight_decay=0.0, betas=(0.9, 0.95)))
    tokenizer = models.load_tokenizer(args.model)
    questions = build_prompts(tokenizer, data.load_gsm8k("test", args.data_dir)[:args.groups], "r1_zero")[1]
    prompts = [questions[row * args.groups // args.rows] for row in range(args.rows)]  # group by group
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_tokens or args.max_tokens, args.max_tokens + 1, (args.rows,), generator=generator)
    responses = [torch.randint(0, len(tokenizer), (int(n),), generator=generator).tolist() for n in lengths]
    advantages = torch.randn(args.rows, 1, generator=generator)
    times = []
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) if args.profile else None
    for step in range(args.steps + 1):  # step 0 is a warm-up
        if step == 1 and profiler:
            profiler.start()
        start = time.perf_counter()
        parts = [slice(rows, rows + args.microbatch) for rows in range(0, args.rows, args.microbatch)]
        shared = (None if variant in ("plain", "fused_head", "sdpa_attn", "prompt_per_microbatch") else
                  tokens.SharedPrompts([prompts[part] for part in parts]))
        for part in parts:
            with autocast:
                out = tokens.rollout_log_probs(model, prompts[part], responses[part], return_token_entropy=True,
                                               shared=shared)
                mask = torch.nn.utils.rnn.pad_sequence([torch.ones(len(r)) for r in responses[part]], batch_first=True)
                grpo.policy_microbatch_train_step(out["log_probs"], mask, torch.full((args.microbatch,), 1 / args.rows),
                                                  advantages[part], out["log_probs"].detach(), loss_type="grpo_clip",
                                                  cliprange=0.2, token_entropy=out["token_entropy"])
            if shared is not None:
                shared.done(prompts[part])
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if profiler:
        profiler.stop()
        print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile), file=sys.stderr)
    return {"variant": variant, "seconds": times[1:], "tokens": sum(map(len, questions)) + sum(map(len, responses)),
            "n_params": sum(p.numel() for p in model.parameters()),
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {', '.join(VARIANTS)}")
    parser.add_argument("--model", default="smollm2-135m", help="HF folder or packaged name")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up step)")
    parser.add_argument("--rows", type=int, default=16, help="responses per step (--groups questions, group by group)")
    parser.add_argument("--microbatch", type=int, default=8, help="rows per forward/backward")
    parser.add_argument("--max_tokens", type=int, default=128, help="tokens per response (the most, with --min_tokens)")
    parser.add_argument("--min_tokens", type=int, default=0,
                        help="draw each response's length between this and --max_tokens (0: all --max_tokens long)")
    parser.add_argument("--groups", type=int, default=1, help="questions the rows answer, rows / groups each")
    parser.add_argument("--pack_tokens", type=int, default=tokens.PACK_TOKENS,
                        help="pack groups of at most this many tokens (tokens.PACK_TOKENS; the crossover's measure)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest ops of each variant")
    parser.add_argument("--data_dir", default=str(ROOT.parent / "shared" / "data"))
    parser.add_argument("--_one", help=argparse.SUPPRESS)  # internal: run one variant, print its JSON
    args = parser.parse_args()
    if args._one:
        print(json.dumps(run_variant(args, args._one)))
        return
    variants = args.variants.split(",")
    if unknown := set(variants) - set(VARIANTS):
        parser.error(f"unknown variant(s) {', '.join(sorted(unknown))}: choose from {', '.join(VARIANTS)}")
    if args.rows % args.microbatch:
        parser.error(f"--rows {args.rows} must be a multiple of --microbatch {args.microbatch}")
    if args.rows % args.groups:
        parser.error(f"--rows {args.rows} must be a multiple of --groups {args.groups}")
    if not 0 <= args.min_tokens <= args.max_tokens:
        parser.error(f"--min_tokens {args.min_tokens} must be between 0 and --max_tokens {args.max_tokens}")
    models.resolve_model(args.model)
    torch.set_num_threads(args.threads)
    precision = models.resolve_precision(args.precision, "cpu")
    peak = matmul_peak(torch.bfloat16 if precision == "bf16" else torch.float32)
    print(f"[bench] CPU flags: {cpu_flags()}; {args.threads} threads; precision {precision} ({args.precision}); "
          f"matmul peak {peak / 1e9:.0f} GFLOP/s in {precision}; torch {torch.__version__}", flush=True)
    print(f"{'variant':22} {'s/step':>7} {'floor s':>8} {'reached':>8} {'peak RSS GiB':>13}", flush=True)
    for variant in variants:
        flags = [f"--{k}={v}" for k, v in vars(args).items() if k not in ("variants", "_one")]
        done = subprocess.run([sys.executable, __file__, *flags, f"--_one={variant}"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"variant {variant} failed:\n{done.stderr[-3000:]}")
        if args.profile:
            print(done.stderr, file=sys.stderr)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        seconds = statistics.median(result["seconds"])
        floor = 6 * result["n_params"] * result["tokens"] / peak
        print(f"{variant:22} {seconds:7.2f} {floor:8.2f} {floor / seconds:8.1%} {result['peak_rss_gib']:13.2f}"
              f"   (steps: {', '.join(f'{s:.2f}' for s in result['seconds'])})", flush=True)


if __name__ == "__main__":
    main()
