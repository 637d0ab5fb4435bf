"""Seconds per GRPO step, this project's `train_rl.main` against TRL's GRPOTrainer, on the same work.

    uv run python bench/rl_step.py                  # 2 rounds x 3 steps per side, about 10 minutes on 2 cores
    uv run python bench/rl_step.py --steps 2 --rounds 1 --natural_length
    uv run --extra vllm-cpu python bench/rl_step.py --backend vllm   # our side samples with vLLM-CPU
    python3 bench/rl_step.py --device cuda --trl_python python3 --precision auto --trl_bf16   # a GPU (gpu_pass.py's trl stage)

Same work on both sides: the HF folder checkpoints/smollm2-135m in fp32 on CPU, one GSM8K test question
with the r1_zero prompt, 16 completions per step (one group), temperature 1, top_p 1, no top-k, at most
128 new tokens, microbatch 8 (two microbatches, one optimizer step per rollout batch), GRPO-clip loss
with eps 0.2 on-policy (one epoch), std-normalised group advantages, no KL term, no reference model, the
project's r1_zero reward on both sides, the same torch thread count. By default every completion is
forced to exactly max_tokens (min_tokens on our sampler, min_new_tokens on TRL's generate), so both sides
generate the same number of tokens; --natural_length lets EOS and `</answer>` end them (our sampler stops
at `</answer>`, TRL's does not) and the table then reports the tokens each side generated.

The floors, measured in the same run: this CPU's matmul rate in fp32 and bf16 (a 2048x576 by 576x1536
product, the shape of SmolLM2's projections, at the same thread count; on a GPU an 8192^3 one), and each phase's FLOPs over the
rate of its precision, for the least work the step needs: generation 2 N per token (the prompt once, then
every generated token with a KV cache), training 6 N per token for one forward and backward over the
prompt once and every response token, with N the parameter count (the tied head is a matmul at every
position, so it counts). Each side's "reached" is that floor over its measured seconds.

Our side is the real training loop, `alignment.train_rl.main`, run on a data folder holding only the
chosen question; its per-step seconds come from its metrics.jsonl. With --backend vllm it samples with a
vLLM engine in the same process (compiled; its start, before step 1, is not part of any step) and pushes
the new weights into it after every step (counted in "train" with the optimizer step). TRL runs in its own environment
(created on first use under checkpoints/bench-trl-venv, git-ignored) with the project's torch and
transformers versions, through bench/_trl_step.py; --trl_python names a Python that imports TRL already (the
GPU machine, where TRL travels as wheels on PYTHONPATH) and no environment is made. The first step of each run is a warm-up and is left
out; the table reports the median of the rest over all rounds. Rounds alternate ours, TRL, ours, TRL, so
that load from other jobs on the machine hits both sides alike. With --keep_freed_memory both sides run
with glibc keeping the memory each step frees (alignment/allocator.py; our side's flag of the same name): fewer
page faults, more resident memory.
"""

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from steps_demo import one_line, positive

from alignment import data, models, train_rl
from alignment.args import RLArgs
from alignment.errors import UserError
from alignment.evaluate import build_prompts
from alignment.folders import RUN_FILES

ROOT = Path(__file__).resolve().parent.parent
TRL_VERSION = "1.16.0"
WORK = ROOT / "outputs" / "bench-rl-step"  # a new dated folder in it unless --work names one
RECORD = ".rl_step.json"  # in --work: this bench made the folder; the sha256 of each data file it wrote there
JSON_KEYS = {"medians", "floors", "ratio_trl_over_ours"}  # a --json this bench wrote: replaced


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def check_work(work: Path) -> dict:
    """--work's record ({} for a new or empty folder). A folder is used only when this bench made it (its record) and
    it holds nothing but what the bench writes there: the record, data/ with the question files as the bench wrote
    them, ours-<round>/ run folders; else one line, before anything is written (a user's file is never replaced or
    deleted: a copy of GSM8K in <work>/data was once cut to one line, a file in ours-0/ deleted)."""
    if work.exists() and not work.is_dir():
        raise SystemExit(f"error: --work {work} is a file: name a new or empty folder (or one this bench made).")
    if not work.exists() or not any(work.iterdir()):
        return {}
    try:
        record = json.loads((work / RECORD).read_text())
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict):
        raise SystemExit(f"error: --work {work} holds files this bench did not write (no record {RECORD} of its own "
                         f"there): name a new or empty folder, or leave --work out (a new dated folder).")
    foreign = []
    for path in sorted(work.rglob("*")):
        name = path.relative_to(work).as_posix()
        if name in record["files"]:
            if not path.is_file() or sha256(path.read_text(errors="replace")) != record["files"][name]:
                foreign.append(f"{name} (changed since this bench wrote it)")
        elif re.fullmatch(r"ours-\d+/.+", name):
            if name.split("/")[1] not in RUN_FILES:
                foreign.append(name)
        elif name not in (RECORD, "data", "data/gsm8k") and not re.fullmatch(r"ours-\d+", name):
            foreign.append(name)
    if foreign:
        raise SystemExit(f"error: --work {work} holds files this bench did not write ({', '.join(foreign[:3])}"
                         f"{', ...' if len(foreign) > 3 else ''}): move them out, or name a new or empty folder.")
    return record


def write_work_file(work: Path, record: dict, name: str, text: str):
    """A data file in --work, recorded first (check_work then knows it for the bench's own on the next run)."""
    record["files"] = {**record.get("files", {}), name: sha256(text)}
    (work / RECORD).write_text(json.dumps(record, indent=1))
    (work / name).parent.mkdir(parents=True, exist_ok=True)
    (work / name).write_text(text)


def check_json(path: str | None, overwrite: bool):
    """--json: a new file, or a record this bench wrote, or anything with --overwrite, in a folder that exists; else one
    line before any run (a missing folder once ended the whole bench in a traceback, its results lost)."""
    if path and not Path(path).resolve().parent.is_dir():
        raise SystemExit(f"error: --json {path}: its folder {Path(path).resolve().parent} does not exist; create it or "
                         f"name a file in a folder that does.")
    if not path or not os.path.lexists(path) or overwrite:
        return
    try:
        mine = JSON_KEYS <= json.loads(Path(path).read_text()).keys()
    except (OSError, ValueError, AttributeError):
        mine = False
    if not mine:
        raise SystemExit(f"error: --json {path} exists and is not a record of this bench: name another file, or add "
                         f"--overwrite to replace it.")


def trl_python(venv: Path) -> Path:
    """The benchmark's TRL environment, created on first use with the project's torch/transformers."""
    python = venv / "bin" / "python"
    if python.exists():
        return python
    pins = [f"trl=={TRL_VERSION}"] + [f"{p}=={importlib.metadata.version(p)}" for p in
                                      ("torch", "transformers", "accelerate", "math-verify", "sympy")]
    pins = [p.split("+")[0] for p in pins]  # torch 2.x.y+cu130 -> the same wheel from the index
    print(f"[bench] creating {venv} with {' '.join(pins)} (once)", flush=True)
    subprocess.run(["uv", "venv", "--python", f"{sys.version_info.major}.{sys.version_info.minor}", str(venv)], check=True)
    subprocess.run(["uv", "pip", "install", "--python", str(python), *pins], check=True)
    return python


def check_trl_python(python: str) -> str:
    """The TRL version `python` imports, as run_trl starts it (this environment, PYTHONPATH kept), or why not: one
    line before any run, not after our side's whole run."""
    try:
        done = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True,
                              timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemExit(f"error: --trl_python {python} does not run ({e}): name a Python that imports TRL "
                         f"{TRL_VERSION}, or leave the flag out (the bench makes its own environment).") from None
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise SystemExit(f"error: --trl_python {python} cannot import trl ({last}): name a Python that imports TRL "
                         f"{TRL_VERSION}, or leave the flag out (the bench makes its own environment).")
    return done.stdout.strip()


def matmul_peak(dtype: torch.dtype, seconds: float = 2.0, device: str = "cpu") -> float:
    """FLOP/s of a 2048x576 @ 576x1536 matmul in `dtype` on this CPU (torch's threads), best of repeats; on a GPU,
    of the 8192^3 product a GPU's floor is quoted at (bench/gpu_pass.py's measurement)."""
    if device == "cuda":
        from gpu_pass import matmul_rate
        return matmul_rate(dtype, "cuda", 8192)
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    for _ in range(3):
        a @ b  # warm-up (oneDNN picks its kernel)
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        best = max(best, 10 * 2 * 2048 * 576 * 1536 / (time.perf_counter() - start))
    return best


def run_ours(args, question_dir: Path, round_index: int) -> list[dict]:
    run_dir = Path(args.work) / f"ours-{round_index}"
    device = "cuda:0" if args.device == "cuda" else "cpu"  # every role there (the policy goes where CUDA is, if any)
    rl_args = RLArgs(model=args.model, dataset="gsm8k", data_dir=str(question_dir), prompt="r1_zero",
                     loss_type="grpo_clip", group_size=args.group_size, rollout_batch_size=args.group_size,
                     train_batch_size=args.group_size, train_mini_batch_size=args.microbatch,
                     epochs_per_rollout_batch=1, use_std_normalization=True, kl_coef=0.0,
                     sampling_temperature=1.0, sampling_top_p=1.0, sampling_max_tokens=args.max_tokens,
                     learning_rate=1e-5, n_steps=args.steps, eval_every=0, save_every=10**9, log_rollouts=0,
                     seed=args.seed + round_index, output_dir=str(run_dir), sample_device=device,
                     reference_model_device=device, eval_device=device, backend=args.backend, kv_cache_gib=2,
                     sampling_min_tokens=0 if args.natural_length else args.max_tokens, precision=args.precision,
                     keep_freed_memory=args.keep_freed_memory,
                     overwrite=run_dir.exists())  # an earlier round's run (check_work: nothing else is in it)
    rl_args.check()
    train_rl.main(rl_args)
    steps = []
    for m in map(json.loads, open(run_dir / "metrics.jsonl")):
        seconds = {k[len("seconds_"):]: v for k, v in m.items() if k.startswith("seconds_")}
        steps.append({"total": seconds["step"], "generate": seconds["sample"], "score": seconds["score"],
                      "train": seconds["train"] + seconds["sync"], "tokens": m["response_tokens"] * args.group_size})
    shutil.rmtree(run_dir / "checkpoint", ignore_errors=True)  # main() saves at its last step
    if not args.natural_length and any(abs(s["tokens"] - args.group_size * args.max_tokens) > 0.5 for s in steps):
        raise RuntimeError(f"our side did not generate exactly {args.max_tokens} tokens per completion: "
                           f"{[s['tokens'] for s in steps]} tokens per step")
    return steps


def run_trl(args, python: Path, prompt: str, answer: str, round_index: int) -> list[dict]:
    settings = {"project_root": str(ROOT), "model": str(models.resolve_model(args.model)), "prompt": prompt,
                "answer": answer, "steps": args.steps, "group_size": args.group_size, "microbatch": args.microbatch,
                "max_tokens": args.max_tokens, "temperature": 1.0, "top_p": 1.0, "learning_rate": 1e-5,
                "force_length": not args.natural_length, "threads": args.threads, "seed": args.seed + round_index,
                "bf16": args.trl_bf16, "keep_freed_memory": args.keep_freed_memory, "cuda": args.device == "cuda",
                "output_dir": None}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": str(args.threads)}
    if not args.trl_python:  # the benchmark's own environment sees none of the project's packages
        env["PYTHONPATH"] = ""
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as scratch:  # GRPOTrainer's output_dir: it saves nothing
        settings["output_dir"] = scratch
        done = subprocess.run([str(python), str(ROOT / "bench" / "_trl_step.py"), json.dumps(settings)],
                              env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the TRL run failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"total"')]


def main():
    parser = one_line(argparse.ArgumentParser(description=__doc__,
                                              formatter_class=argparse.RawDescriptionHelpFormatter))
    parser.add_argument("--model", default="smollm2-135m", help="HF folder or packaged name (smollm2-135m)")
    parser.add_argument("--steps", type=positive, default=3, help="steps per run; the first is a warm-up")
    parser.add_argument("--rounds", type=positive, default=2, help="runs per side, alternating ours and TRL")
    parser.add_argument("--group_size", type=positive, default=16, help="completions per step (one question)")
    parser.add_argument("--microbatch", type=positive, default=8, help="rows per forward/backward on both sides")
    parser.add_argument("--max_tokens", type=positive, default=128, help="most generated tokens per completion")
    parser.add_argument("--natural_length", action="store_true", help="let EOS/stop strings end completions")
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="our side's sampler")
    parser.add_argument("--precision", default="fp32", choices=["auto", "fp32", "bf16"], help="our side's --precision")
    parser.add_argument("--trl_bf16", action="store_true", help="TRL's bf16 option (GRPOConfig bf16=True)")
    parser.add_argument("--keep_freed_memory", action="store_true",
                        help="both sides: glibc keeps freed memory for the next step (alignment/allocator.py)")
    parser.add_argument("--question", type=int, default=0, help="index of the GSM8K test question")
    parser.add_argument("--threads", type=positive, default=2, help="torch threads on both sides")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--data_dir", default=os.environ.get("ALIGNMENT_DATA_DIR", str(ROOT.parent / "shared" / "data")))
    parser.add_argument("--trl_venv", default=str(ROOT / "checkpoints" / "bench-trl-venv"))
    parser.add_argument("--trl_python", default=None, help="a Python that imports TRL already (no environment made)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides run")
    parser.add_argument("--work", default=None, help="folder for our side's runs and the question's data: new, empty "
                        "or made by this bench (default: a new dated folder in outputs/bench-rl-step)")
    parser.add_argument("--json", default=None, help="also write the medians, floors and ratios to this file")
    parser.add_argument("--overwrite", action="store_true", help="replace a --json file this bench did not write")
    args = parser.parse_args()
    args.work = args.work or str(WORK / time.strftime("%Y%m%d-%H%M%S"))
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step of each run is a warm-up.")
    if args.group_size < 2 or args.group_size % args.microbatch:
        parser.error(f"--group_size {args.group_size} must be 2 or more (a group's advantages) and a multiple of "
                     f"--microbatch {args.microbatch} (TRL accumulates group_size / microbatch microbatches).")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, and torch sees no CUDA device here.")
    test_split = Path(args.data_dir) / "gsm8k" / "test.jsonl"
    if not test_split.is_file():
        parser.error(f"no GSM8K test split at {test_split}: --data_dir names the folder holding gsm8k/test.jsonl.")
    models.resolve_model(args.model)  # a missing --model is one line before anything runs
    record = check_work(Path(args.work))
    check_json(args.json, args.overwrite)
    trl_version = check_trl_python(args.trl_python) if args.trl_python else TRL_VERSION
    torch.set_num_threads(args.threads)
    python = Path(shutil.which(args.trl_python) or args.trl_python) if args.trl_python else trl_python(Path(args.trl_venv))

    # A data folder holding only the chosen question, as the train split our loop reads. Its test split (never
    # evaluated: eval_every 0) holds the next question: the loop leaves evaluation questions out of training.
    raw = data.read_jsonl(test_split, ("question", "answer"))
    if not 0 <= args.question < len(raw) - 1:
        parser.error(f"--question {args.question}: give an index from 0 to {len(raw) - 2} (the next question is "
                     f"the run's held-out split)")
    question_dir = Path(args.work) / "data"
    Path(args.work).mkdir(parents=True, exist_ok=True)
    for split, index in (("train", args.question), ("test", args.question + 1)):
        write_work_file(Path(args.work), record, f"data/gsm8k/{split}.jsonl", json.dumps(raw[index]) + "\n")
    row = data.load_gsm8k("train", str(question_dir))[0]
    tokenizer = models.load_tokenizer(args.model)
    [prompt], [prompt_ids] = build_prompts(tokenizer, [row], "r1_zero")

    peaks = {"fp32": matmul_peak(torch.float32, device=args.device), "bf16": matmul_peak(torch.bfloat16, device=args.device)}
    n_params = sum(p.numel() for p in models.load_model(args.model).parameters())
    where = f"CPU, {args.threads} threads" if args.device == "cpu" else torch.cuda.get_device_name(0)
    print(f"[bench] matmul peak here: fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s, bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s "
          f"({peaks['bf16'] / peaks['fp32']:.2f}x); model {n_params / 1e6:.1f}M parameters", flush=True)
    print(f"[bench] {args.model}, our precision {models.resolve_precision(args.precision, args.device)}, TRL "
          f"{'bf16' if args.trl_bf16 else 'fp32'}, {where}; {args.group_size} completions of "
          f"{'<=' if args.natural_length else 'exactly '}{args.max_tokens} tokens per step; microbatch {args.microbatch}; "
          f"prompt {len(prompt_ids)} tokens; torch {torch.__version__}; TRL {trl_version}; our sampler {args.backend}",
          flush=True)
    results = {"ours": [], "trl": []}
    loads = [os.getloadavg()[0]]
    for r in range(args.rounds):
        for side in ("ours", "trl"):
            start = time.perf_counter()
            steps = run_ours(args, question_dir, r) if side == "ours" else run_trl(args, python, prompt, row["answer"], r)
            if side == "trl" and steps and steps[0]["prompt_tokens"] != len(prompt_ids):
                print(f"[bench] warning: TRL tokenised the prompt to {steps[0]['prompt_tokens']} tokens, ours to {len(prompt_ids)}")
            loads.append(os.getloadavg()[0])
            print(f"[bench] round {r + 1} {side}: " + ", ".join(f"{s['total']:.1f}s" for s in steps)
                  + f" ({time.perf_counter() - start:.0f}s with loading; load average {loads[-1]:.2f})", flush=True)
            results[side] += steps[1:]

    print(f"\nmedian over {len(results['ours'])} timed steps per side (first step of each run left out); "
          f"1-min load average seen: {min(loads):.2f}-{max(loads):.2f}")
    print(f"{'':6} {'total s':>8} {'generate s':>11} {'score s':>8} {'train s':>8} {'gen tokens':>11} {'tok/s (total)':>14}")
    medians = {}
    for side, steps in results.items():
        m = {k: statistics.median(s[k] for s in steps) for k in ("total", "generate", "score", "train", "tokens")}
        medians[side] = m
        print(f"{side:6} {m['total']:8.1f} {m['generate']:11.1f} {m['score']:8.2f} {m['train']:8.1f} "
              f"{m['tokens']:11.0f} {m['tokens'] / m['total']:14.1f}")
    precision = {"ours": models.resolve_precision(args.precision, args.device), "trl": "bf16" if args.trl_bf16 else "fp32"}
    print(f"\nfloors (FLOPs / this {args.device.upper()}'s matmul peak in the side's precision) and the share of them reached:")
    floors = {}
    for side, m in medians.items():
        peak = peaks[precision[side]]
        generate_floor = 2 * n_params * (len(prompt_ids) + m["tokens"]) / peak
        train_floor = 6 * n_params * (len(prompt_ids) + m["tokens"]) / peak
        floors[side] = {"generate_floor_s": generate_floor, "train_floor_s": train_floor,
                        "generate_reached": generate_floor / m["generate"], "train_reached": train_floor / m["train"]}
        print(f"{side:6} generate floor {generate_floor:6.2f}s ({generate_floor / m['generate']:6.1%} reached) | train "
              f"floor {train_floor:6.2f}s ({train_floor / m['train']:6.1%} reached) | {precision[side]} peak "
              f"{peak / 1e9:.0f} GFLOP/s")
    ours, trl = medians["ours"], medians["trl"]
    print(f"ratio TRL/ours: total {trl['total'] / ours['total']:.2f}x | generate {trl['generate'] / ours['generate']:.2f}x"
          f" | train {trl['train'] / ours['train']:.2f}x | per generated token "
          f"{(trl['total'] / trl['tokens']) / (ours['total'] / ours['tokens']):.2f}x")
    if args.json:
        ratio = {k: trl[k] / ours[k] for k in ("total", "generate", "train")}
        Path(args.json).write_text(json.dumps({
            "device": args.device, "precision": precision, "matmul_peak_gflops": {k: v / 1e9 for k, v in peaks.items()},
            "parameters": n_params, "prompt_tokens": len(prompt_ids), "medians": medians, "floors": floors,
            "steps": results, "ratio_trl_over_ours": ratio}, indent=1))


if __name__ == "__main__":
    try:
        main()
    except UserError as e:  # a missing model or data file: one line, as the project's scripts say it
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # the TRL side's child got the same Ctrl-C and ended; our side stops in its own way
        sys.exit("\n[bench] interrupted (Ctrl-C): the side in progress was stopped; no table and no --json written.")
