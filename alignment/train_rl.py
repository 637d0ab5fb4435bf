"""Policy-gradient RL for math reasoning: REINFORCE, REINFORCE with a group baseline, GRPO-clip.

    uv run -m alignment.train_rl --loss_type grpo_clip          # CPU default: short run on rg:chain_sum
    uv run -m alignment.train_rl --model checkpoints/math_sft --dataset gsm8k --rollout_batch_size 256 \
        --train_batch_size 256 --group_size 8 --sampling_max_tokens 1024 --n_steps 200   # reference, GPUs
    uv run -m alignment.train_rl --resume checkpoints/rl/<run>  # same flags + --resume after a crash

One step: sample `group_size` responses for each question with the rollout mode, score them with the
grader, turn rewards into group-normalised advantages, then for each epoch and train batch run
microbatches through `grpo_microbatch_train_step`, clip, step, and push the new weights to the sampler.

Departures from the reference loop, all for speed and none changing the maths: the responses of one
question share a single prompt forward pass (`tokens.rollout_log_probs`), logits are computed only at
response positions, and when the update is on-policy (one epoch, one optimizer step per rollout batch)
the old log-probs are the current ones detached instead of a second forward pass.
"""

import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from alignment import data, models, tir
from alignment.args import RLArgs, parse, to_dict
from alignment.evaluate import PROMPT_SETTINGS, ROLLOUT_MODES, build_prompts, evaluate
from alignment.grpo import compute_group_normalized_rewards, filter_groups, grpo_microbatch_train_step, masked_mean
from alignment.rollout import traces
from alignment.sampling import HFSampler, SamplingParams, make_sampler, pick_backend
from alignment.tokens import rollout_log_probs

# Flags that may differ between a run and its resumption; everything else must match.
RESUMABLE_CHANGES = {"resume", "n_steps", "eval_every", "save_every", "log_rollouts", "logger", "output_dir"}
MAX_BAD_STEPS = 3  # consecutive non-finite losses or gradients before the run aborts


def questions_for_step(rows: list[dict], step: int, per_step: int, seed: int) -> list[dict]:
    """The questions of RL step `step`: a seeded permutation per epoch, read in order. A pure function
    of (step, seed), so a resumed run sees exactly the questions the uninterrupted run would have."""
    picked = []
    for position in range(step * per_step, (step + 1) * per_step):
        epoch, index = divmod(position, len(rows))
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(rows[order[index]])
    return picked


class NullLogger:
    """Stand-in for tensorboard/wandb, so the loop never checks whether one is on."""

    def log(self, metrics: dict, step: int):
        pass


def make_logger(kind: str, run_dir: Path, config: dict):
    if kind == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter  # needs `uv pip install tensorboard`
        writer = SummaryWriter(run_dir / "tensorboard")
        logger = NullLogger()
        logger.log = lambda metrics, step: [writer.add_scalar(k, v, step) for k, v in metrics.items()
                                            if isinstance(v, (int, float))]
        return logger
    if kind == "wandb":
        import wandb  # needs `uv pip install wandb`
        run = wandb.init(project="alignment", config=config, dir=str(run_dir))
        logger = NullLogger()
        logger.log = lambda metrics, step: run.log(metrics, step=step)
        return logger
    return NullLogger()


def make_scorer(args: RLArgs):
    """(last row of a trace, ground truth) -> reward dict, with the grader the prompt calls for. The TIR
    reward also reads the trace's execution record (ToRL's optional penalty for code that failed)."""
    reward_fn, _ = PROMPT_SETTINGS[args.prompt]
    if args.prompt == "tir":
        return lambda row, truth: tir.tir_reward_fn(row.text, truth, args.tir_reward_scheme, args.exec_penalty,
                                                    bool(row.stats.get("exec_failed")))
    return lambda row, truth: reward_fn(row.text, truth)


def setup_run(args: RLArgs) -> tuple[Path, str, dict | None]:
    """Run folder, the model to load, and the trainer state when resuming."""
    if args.resume:
        run_dir = Path(args.resume)
        checkpoint = run_dir / "checkpoint"
        if not (checkpoint / "trainer_state.pt").exists():
            raise FileNotFoundError(f"{checkpoint} has no trainer_state.pt; --resume takes a run folder written "
                                    f"by alignment.train_rl that saved at least one checkpoint.")
        saved = json.loads((checkpoint / "run_config.json").read_text())
        changed = sorted(k for k, v in to_dict(args).items() if k not in RESUMABLE_CHANGES and saved.get(k) != v)
        if changed:
            raise ValueError(f"resume with the flags of the original run; these differ: {', '.join(changed)} "
                             f"(see {checkpoint / 'run_config.json'}).")
        return run_dir, str(checkpoint), torch.load(checkpoint / "trainer_state.pt", weights_only=False)
    run_dir = Path(args.output_dir or f"checkpoints/rl/{args.loss_type}-{time.strftime('%Y%m%d-%H%M%S')}")
    run_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        model = "checkpoints/math_sft" if (models.CHECKPOINTS / "math_sft" / "config.json").exists() else "smollm2-135m"
        print(f"[train_rl] --model not given: starting from {model}")
    return run_dir, model, None


def main(args: RLArgs) -> dict:
    run_dir, model_name, state = setup_run(args)
    roles = models.assign_device_roles(models.available_devices(), args.sample_device,
                                       args.reference_model_device, args.eval_device)
    backend = pick_backend(args.backend, roles["sample"])
    print(f"[train_rl] {args.loss_type} on {args.dataset} from {model_name}; devices {roles}; sampler {backend}; "
          f"run folder {run_dir}")
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    # Models: the policy (trained), the sampler (shares the policy's weights when it can), the frozen
    # reference for the KL penalty (only when kl_coef > 0), and the evaluation sampler.
    tokenizer = models.load_tokenizer(model_name)
    policy = models.load_policy_model(model_name, roles["policy"])
    shares_policy = roles["policy"] == [roles["sample"]] and backend == "hf"
    sampler = HFSampler(policy, tokenizer, batch_size=args.sample_batch_size) if shares_policy else make_sampler(
        backend, models.load_model(model_name, roles["sample"]), tokenizer, models.resolve_model(model_name),
        roles["sample"], batch_size=args.sample_batch_size, seed=args.seed,
        gpu_memory_utilization=args.gpu_memory_utilization)
    reference = models.load_model(model_name, roles["reference"]) if args.kl_coef > 0 else None
    eval_sampler = sampler if roles["eval"] == roles["sample"] else HFSampler(
        policy if roles["eval"] in roles["policy"] else models.load_model(model_name, roles["eval"]), tokenizer)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))

    # Data and the step this run starts at.
    train_rows = data.load_dataset(args.dataset, "train", args.data_dir, size=args.rg_size, seed=args.seed)
    eval_name = args.eval_dataset or args.dataset
    eval_rows = data.load_dataset(eval_name, "test", args.data_dir, size=args.eval_limit, seed=args.seed)[:args.eval_limit]
    score, stop = make_scorer(args), PROMPT_SETTINGS[args.prompt][1]
    questions_per_step = args.rollout_batch_size // args.group_size
    on_policy = args.epochs_per_rollout_batch == 1 and args.train_batch_size == args.rollout_batch_size
    start_step, bad_steps = 0, 0
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start_step, bad_steps = state["step"], state["bad_steps"]
        _truncate_jsonl(run_dir / "metrics.jsonl", start_step)
        _truncate_jsonl(run_dir / "rollouts.jsonl", start_step)
        print(f"[train_rl] resumed from {run_dir / 'checkpoint'} at step {start_step}")
    logger = make_logger(args.logger, run_dir, to_dict(args))
    (run_dir / "config.json").write_text(json.dumps(to_dict(args), indent=2))

    def run_eval(step: int) -> dict:
        _sync_weights(policy, eval_sampler)
        policy.eval()
        summary, _ = evaluate(eval_sampler, tokenizer, eval_rows, args.prompt,
                              SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens),
                              args.chat_template, args.rollout_mode, args)
        metrics = {"step": step, **{f"eval_{k}": v for k, v in summary.items()}}
        _append_jsonl(run_dir / "metrics.jsonl", metrics)
        logger.log(metrics, step)
        tqdm.write(f"eval  {step}/{args.n_steps} | {eval_name} x{summary['count']} | format {summary['avg_format_rewards']:.3f}"
                   f" | answer {summary['avg_answer_rewards']:.3f} | reward {summary['avg_all_rewards']:.3f}")
        return summary

    if args.eval_every and start_step == 0:
        run_eval(0)
    bar = tqdm(range(start_step, args.n_steps), desc="rl", unit="step", initial=start_step, total=args.n_steps)
    for step in bar:
        times = {}
        start = time.perf_counter()
        # 1. Sample group_size responses per question (the step's seed makes a bad step replayable).
        batch = questions_for_step(train_rows, step, questions_per_step, args.seed)
        prompt_texts, prompt_ids = build_prompts(tokenizer, batch, args.prompt, args.chat_template)
        params = SamplingParams(n=args.group_size, temperature=args.sampling_temperature, top_p=args.sampling_top_p,
                                max_tokens=args.sampling_max_tokens, stop=stop, seed=args.seed * 100_003 + step)
        policy.eval()
        rollouts = ROLLOUT_MODES[args.rollout_mode](sampler, tokenizer, prompt_ids, params, args)
        times["sample"] = time.perf_counter() - start

        # 2. Score each trace on its full text; normalise within groups.
        start = time.perf_counter()
        all_traces = traces(rollouts)
        advantages, raw_rewards, reward_meta = compute_group_normalized_rewards(
            score, [t[-1] for t in all_traces], [batch[t[-1].group_id]["answer"] for t in all_traces],
            args.group_size, args.advantage_eps, args.use_std_normalization)
        keep = torch.ones(len(all_traces), dtype=torch.bool)
        if args.filter_low is not None or args.filter_high is not None:
            keep = filter_groups(raw_rewards, args.group_size, args.filter_low, args.filter_high)
        times["score"] = time.perf_counter() - start

        # 3. Policy update: epochs x train batches x microbatches.
        start = time.perf_counter()
        policy.train()
        kept = [i for i in range(len(all_traces)) if keep[i]]
        train = {"loss": [], "clip_fraction": [], "entropy": [], "grad_norm": [], "kl": []}
        if kept:
            old_log_probs = None if on_policy else _log_probs_no_grad(policy, all_traces, args.train_mini_batch_size)
            traces_per_batch = max(1, args.train_batch_size * len(kept) // len(all_traces))
            for _ in range(args.epochs_per_rollout_batch):
                for first in range(0, len(kept), traces_per_batch):
                    ok = _optimizer_step(args, policy, optimizer, reference, all_traces, kept[first:first + traces_per_batch],
                                         advantages, raw_rewards, old_log_probs, train)
                    bad_steps = 0 if ok else bad_steps + 1
                    if bad_steps >= MAX_BAD_STEPS:
                        raise RuntimeError(f"{bad_steps} optimizer steps in a row had a non-finite loss or gradient; "
                                           f"lower --learning_rate or check the data. Last good checkpoint: {run_dir / 'checkpoint'}.")
        times["train"] = time.perf_counter() - start
        start = time.perf_counter()
        _sync_weights(policy, sampler)
        times["sync"] = time.perf_counter() - start

        # 4. Log, write a few full rollouts, evaluate, checkpoint.
        response_tokens = [sum(sum(r.loss_mask) for r in t) for t in all_traces]
        metrics = {"step": step + 1, "reward": reward_meta["reward_mean"],
                   "format_reward": reward_meta.get("format_reward_mean", 0.0),
                   "answer_reward": reward_meta.get("answer_reward_mean", 0.0),
                   "response_tokens": sum(response_tokens) / len(response_tokens),
                   "zero_std_groups": reward_meta["zero_std_fraction"], "kept_traces": len(kept),
                   **{k: sum(v) / len(v) for k, v in train.items() if v},
                   **{f"seconds_{k}": v for k, v in times.items()}}
        if args.rollout_mode == "tir":
            metrics.update(tir.tir_metrics([t[-1] for t in all_traces], raw_rewards.tolist()))
        _append_jsonl(run_dir / "metrics.jsonl", metrics)
        for t, reward in list(zip(all_traces, raw_rewards.tolist()))[:args.log_rollouts]:
            _append_jsonl(run_dir / "rollouts.jsonl", {"step": step + 1, "prompt": prompt_texts[t[-1].group_id],
                                                       "response": t[-1].text, "ground_truth": batch[t[-1].group_id]["answer"],
                                                       "reward": reward, "rows": len(t), "stats": t[-1].stats})
        logger.log(metrics, step + 1)
        tqdm.write(_log_line(metrics, args.n_steps))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.n_steps):
            run_eval(step + 1)
        if (step + 1) % args.save_every == 0 or step + 1 == args.n_steps:
            models.save_checkpoint(policy, tokenizer, run_dir / "checkpoint", config=to_dict(args), extra={
                "trainer_state.pt": {"step": step + 1, "optimizer": optimizer.state_dict(), "bad_steps": bad_steps,
                                     "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}})
    bar.close()
    return {"run_dir": str(run_dir), "last_metrics": _read_jsonl(run_dir / "metrics.jsonl")[-1:]}


def _optimizer_step(args, policy, optimizer, reference, all_traces, batch_traces, advantages, raw_rewards,
                    old_log_probs, train) -> bool:
    """Microbatches of one train batch, gradient clipping and the step. False if it was skipped."""
    first_row = [0]  # flat position of each trace's first row (the order of old_log_probs)
    for trace in all_traces:
        first_row.append(first_row[-1] + len(trace))
    rows = [(i, first_row[i] + k, r) for i in batch_traces for k, r in enumerate(all_traces[i])]
    trace_lengths = {i: sum(len(r.response_ids) for r in all_traces[i]) for i in batch_traces}
    num_tokens = sum(sum(r.loss_mask) for _, _, r in rows)
    device = next(policy.parameters()).device
    losses = []
    for first in range(0, len(rows), args.train_mini_batch_size):
        micro = rows[first:first + args.train_mini_batch_size]
        prompts, responses = [r.prompt_ids for _, _, r in micro], [r.response_ids for _, _, r in micro]
        out = rollout_log_probs(policy, prompts, responses, return_token_entropy=True)
        log_probs = out["log_probs"]  # (B, T)
        mask = _pad([r.loss_mask for _, _, r in micro], log_probs.shape[1], device)  # (B, T)
        trace_index = torch.tensor([i for i, _, _ in micro])
        old = log_probs.detach()  # on-policy: the ratio is 1 and only its gradient matters
        if old_log_probs is not None:
            old = old_log_probs[[k for _, k, _ in micro], :log_probs.shape[1]].to(device)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = rollout_log_probs(reference, prompts, responses)["log_probs"].to(device)
        loss, meta = grpo_microbatch_train_step(
            log_probs, mask, len(rows) / len(micro), args.loss_type,
            raw_rewards=raw_rewards[trace_index].unsqueeze(-1).to(device),
            advantages=advantages[trace_index].unsqueeze(-1).to(device), old_log_probs=old,
            cliprange=args.cliprange, loss_agg_mode=args.loss_agg_mode, cliprange_high=args.cliprange_high,
            kl_coef=args.kl_coef, ref_log_probs=ref, max_response_length=args.sampling_max_tokens,
            num_tokens=num_tokens, num_traces=len(batch_traces),
            trace_lengths=torch.tensor([trace_lengths[i] for i, _, _ in micro], device=device))
        losses.append(loss.item())
        train["entropy"].append(masked_mean(out["token_entropy"], mask).item() if mask.sum() else 0.0)
        for key in ("clip_fraction", "kl"):
            if key in meta:
                train[key].append(meta[key])
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
    if not (math.isfinite(grad_norm) and all(math.isfinite(x) for x in losses)):
        tqdm.write(f"[train_rl] warning: non-finite loss or gradient (grad norm {grad_norm}); step skipped")
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train["loss"].append(sum(losses))
    train["grad_norm"].append(grad_norm)
    return True


@torch.no_grad()
def _log_probs_no_grad(policy, all_traces, microbatch: int) -> torch.Tensor:
    """Old-policy log-probs of every row (flat order), before any update of this step: (rows, T)."""
    policy.eval()
    rows = [r for trace in all_traces for r in trace]
    width = max(len(r.response_ids) for r in rows)
    out = torch.zeros(len(rows), width)
    for first in range(0, len(rows), microbatch):
        part = rows[first:first + microbatch]
        log_probs = rollout_log_probs(policy, [r.prompt_ids for r in part], [r.response_ids for r in part])["log_probs"]
        out[first:first + len(part), :log_probs.shape[1]] = log_probs.float().cpu()
    policy.train()
    return out


def _sync_weights(policy, sampler):
    """Push the policy's weights to a sampler that holds its own copy (vLLM, or HF on another device)."""
    if getattr(sampler, "model", None) is not policy:
        sampler.load_weights(policy.state_dict())


def _pad(lists, width, device) -> torch.Tensor:
    out = torch.zeros(len(lists), width, device=device)
    for i, values in enumerate(lists):
        out[i, :len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


def _log_line(m: dict, n_steps: int) -> str:
    seconds = " ".join(f"{k[8:]} {v:.1f}s" for k, v in m.items() if k.startswith("seconds_"))
    return (f"step {m['step']}/{n_steps} | reward {m['reward']:.3f} | fmt {m['format_reward']:.2f} | "
            f"ans {m['answer_reward']:.2f} | len {m['response_tokens']:.0f} | loss {m.get('loss', float('nan')):.4f} | "
            f"clip {m.get('clip_fraction', 0):.3f} | ent {m.get('entropy', float('nan')):.2f} | "
            f"gnorm {m.get('grad_norm', float('nan')):.2f} | kl {m.get('kl', 0):.4f} | {seconds}")


def _append_jsonl(path: Path, record: dict):
    """One JSON line; NaN (a rate over an empty subset, e.g. TIR accuracy with code when none used code)
    becomes null so that strict JSON readers accept the file."""
    record = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in record.items()}
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in open(path)] if path.exists() else []


def _truncate_jsonl(path: Path, step: int):
    """Drop records of steps after the checkpoint: the resumed run writes them again."""
    kept = [r for r in _read_jsonl(path) if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


if __name__ == "__main__":
    main(parse(RLArgs))
