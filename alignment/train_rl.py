"""Policy-gradient RL for math reasoning: REINFORCE, REINFORCE with a group baseline, GRPO-clip.

    uv run -m alignment.train_rl --loss_type grpo_clip          # CPU default: short run on rg:chain_sum
    uv run -m alignment.train_rl --model checkpoints/math_sft --dataset gsm8k --rollout_batch_size 256 \
        --train_batch_size 256 --group_size 8 --sampling_max_tokens 1024 --n_steps 200   # reference, GPUs
    uv run -m alignment.train_rl --resume checkpoints/rl/<run>  # same flags + --resume after a crash

One step: sample `group_size` responses for each question with the rollout mode, score them with the
grader, turn rewards into group-normalised advantages (with dynamic sampling: drop groups without
signal and sample more questions until the batch is full), then for each epoch and train batch run
microbatches through `grpo_microbatch_train_step`, clip, step, and push the new weights to the sampler.

Every log-prob the loss uses (current, old, reference) is of softmax(logits / sampling temperature), the
distribution the responses were drawn from. Departures from the reference loop, all for speed and none
changing the maths: the responses of one question share a single prompt forward pass
(`tokens.rollout_log_probs`), logits are computed only at response positions, and when the update is
on-policy (one epoch, one optimizer step per rollout batch) the old log-probs are the current ones
detached instead of a second forward pass.
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
from alignment.errors import MissingFileError, UserError, cli
from alignment.evaluate import PROMPT_SETTINGS, ROLLOUT_MODES, build_prompts, evaluate
from alignment.grpo import compute_group_normalized_rewards, filter_groups, grpo_microbatch_train_step
from alignment.rollout import traces
from alignment.sampling import HFSampler, SamplingParams, WeightPush, derive_seed, make_sampler, pick_backend
from alignment.tokens import rollout_log_probs

# Flags that may differ between a run and its resumption; everything else must match.
RESUMABLE_CHANGES = {"resume", "n_steps", "eval_every", "save_every", "log_rollouts", "logger", "output_dir"}
MAX_BAD_STEPS = 3  # consecutive non-finite losses or gradients before the run aborts


def questions_at(rows: list[dict], position: int, count: int, seed: int) -> list[dict]:
    """`count` questions from position `position` of an endless stream: a seeded permutation of the
    rows per epoch, read in order. A pure function of (position, seed); the loop keeps the position (how
    many questions it has drawn) in its checkpoint, so a resumed run draws what the uninterrupted run
    would have, also when dynamic sampling drew extra questions."""
    picked = []
    for index in range(position, position + count):
        epoch, offset = divmod(index, len(rows))
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        picked.append(rows[order[offset]])
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
    """Run folder, the run's starting model, and the trainer state when resuming (the weights then come
    from the run's checkpoint; the starting model stays the KL reference)."""
    if args.resume:
        run_dir = Path(args.resume)
        checkpoint = run_dir / "checkpoint"
        if not (checkpoint / "trainer_state.pt").exists():
            raise MissingFileError(f"{checkpoint} has no trainer_state.pt; --resume takes a run folder written by "
                                   f"alignment.train_rl that saved at least one checkpoint (see --save_every).")
        saved = json.loads((checkpoint / "run_config.json").read_text())
        changed = sorted(k for k, v in to_dict(args).items() if k not in RESUMABLE_CHANGES and saved.get(k) != v)
        if changed:
            raise UserError(f"resume with the flags of the original run; these differ: {', '.join(changed)} "
                            f"(see {checkpoint / 'run_config.json'}).")
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        return run_dir, state["start_model"], state
    run_dir = Path(args.output_dir or f"checkpoints/rl/{args.loss_type}-{time.strftime('%Y%m%d-%H%M%S')}")
    model = args.model
    if model is None:
        model = "checkpoints/math_sft" if (models.CHECKPOINTS / "math_sft" / "config.json").exists() else "smollm2-135m"
        print(f"[train_rl] --model not given: starting from {model}")
    models.resolve_model(model)  # a missing model fails here, before the run folder exists
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, model, None


def main(args: RLArgs) -> dict:
    run_dir, start_model, state = setup_run(args)
    weights_from = str(run_dir / "checkpoint") if state else start_model
    roles = models.assign_device_roles(models.available_devices(), args.sample_device,
                                       args.reference_model_device, args.eval_device)
    backend = pick_backend(args.backend, roles["sample"])
    print(f"[train_rl] {args.loss_type} on {args.dataset} from {weights_from}; devices {roles}; sampler {backend}; "
          f"run folder {run_dir}")
    if args.sampling_top_p < 1:
        print(f"[train_rl] warning: --sampling_top_p {args.sampling_top_p} samples from the nucleus but the loss "
              f"scores the full softmax at T={args.sampling_temperature}: the policy gradient is biased.")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    # Data first: a bad dataset or file fails before a minute of model loading.
    train_rows = data.load_dataset(args.dataset, "train", args.data_dir, size=args.rg_size, seed=args.seed)
    eval_name = args.eval_dataset or args.dataset
    eval_rows = data.load_dataset(eval_name, "test", args.data_dir, size=args.eval_limit, seed=args.seed)[:args.eval_limit]

    # Models: the policy (trained, fp32 master weights), the sampler (shares the policy's weights when
    # it can), the frozen reference for the KL penalty (the run's starting model, also after a resume;
    # only when kl_coef > 0), and the evaluation sampler.
    tokenizer = models.load_tokenizer(weights_from)
    dtype, autocast = models.train_precision(roles["policy"][0], args.bf16_weights)
    policy = models.load_policy_model(weights_from, roles["policy"], dtype)
    if backend == "hf":
        sampler = HFSampler(policy if roles["policy"] == [roles["sample"]] else
                            models.load_model(weights_from, roles["sample"]), tokenizer, args.sample_batch_size)
    else:
        sampler = make_sampler(backend, None, tokenizer, models.resolve_model(weights_from), roles["sample"],
                               seed=args.seed, **args.vllm_options())
    reference = models.load_model(start_model, roles["reference"]) if args.kl_coef > 0 else None
    eval_sampler = sampler if roles["eval"] == roles["sample"] else HFSampler(
        policy if roles["eval"] in roles["policy"] else models.load_model(weights_from, roles["eval"]), tokenizer)
    push = WeightPush(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))

    # The step this run starts at.
    score = make_scorer(args)
    start_step, bad_steps, drawn = 0, 0, 0  # drawn: questions taken from the stream so far
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start_step, bad_steps, drawn = state["step"], state["bad_steps"], state["questions_drawn"]
        _truncate_jsonl(run_dir / "metrics.jsonl", start_step)
        _truncate_jsonl(run_dir / "rollouts.jsonl", start_step)
        print(f"[train_rl] resumed from {run_dir / 'checkpoint'} at step {start_step}")
    logger = make_logger(args.logger, run_dir, to_dict(args))
    (run_dir / "config.json").write_text(json.dumps({**to_dict(args), "start_model": start_model}, indent=2))

    def run_eval(step: int) -> dict:
        push(eval_sampler)
        policy.eval()
        with autocast:
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
        # 1-2. Sample and score groups until the batch holds enough informative ones (one round
        # without dynamic sampling); group-normalised advantages, one per trace.
        policy.eval()
        with autocast:
            batch, drawn = collect_rollouts(args, step, drawn, train_rows, sampler, tokenizer, score)
        times = dict(batch["seconds"])  # sample, score

        # 3. Policy update: epochs x train batches x microbatches.
        start = time.perf_counter()
        policy.train()
        train = _Means()
        if batch["traces"]:
            train_traces = batch["traces"]
            old_log_probs = None if _on_policy(args) else _log_probs_no_grad(policy, train_traces, args, autocast)
            groups = len(train_traces) // args.group_size
            groups_per_batch = max(1, groups * args.train_batch_size // args.rollout_batch_size)
            for epoch in range(args.epochs_per_rollout_batch):
                # a fresh group order per epoch, so off-policy epochs do not repeat the same minibatches
                order = torch.randperm(groups, generator=torch.Generator().manual_seed(derive_seed(args.seed, step, epoch)))
                for first in range(0, groups, groups_per_batch):
                    batch_traces = [g * args.group_size + k for g in order[first:first + groups_per_batch].tolist()
                                    for k in range(args.group_size)]
                    with autocast:
                        ok = _optimizer_step(args, policy, optimizer, reference, train_traces, batch_traces,
                                             batch["advantages"], batch["raw_rewards"], old_log_probs, train, epoch)
                    push.policy_changed()
                    bad_steps = 0 if ok else bad_steps + 1
                    if bad_steps >= MAX_BAD_STEPS:
                        raise RuntimeError(f"{bad_steps} optimizer steps in a row had a non-finite loss or gradient; "
                                           f"lower --learning_rate or check the data. Last good checkpoint: {run_dir / 'checkpoint'}.")
        times["train"] = time.perf_counter() - start
        times["sync"] = push(sampler)

        # 4. Log, write a few full rollouts, evaluate, checkpoint.
        metrics = {"step": step + 1, **batch["metrics"], **train.means(),
                   **{f"seconds_{k}": v for k, v in times.items()}}
        _append_jsonl(run_dir / "metrics.jsonl", metrics)
        for record in batch["samples"][:args.log_rollouts]:
            _append_jsonl(run_dir / "rollouts.jsonl", {"step": step + 1, **record})
        logger.log(metrics, step + 1)
        tqdm.write(_log_line(metrics, args.n_steps))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.n_steps):
            run_eval(step + 1)
        if (step + 1) % args.save_every == 0 or step + 1 == args.n_steps:
            models.save_checkpoint(policy, tokenizer, run_dir / "checkpoint", config=to_dict(args), extra={
                "trainer_state.pt": {"step": step + 1, "optimizer": optimizer.state_dict(), "bad_steps": bad_steps,
                                     "questions_drawn": drawn, "start_model": start_model,
                                     "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}})
    bar.close()
    return {"run_dir": str(run_dir), "last_metrics": _read_jsonl(run_dir / "metrics.jsonl")[-1:]}


def collect_rollouts(args, step: int, drawn: int, rows, sampler, tokenizer, score) -> tuple[dict, int]:
    """Sample, score and (with dynamic sampling) filter groups for one step; returns the batch and the
    new stream position. DAPO's refill (section 3.2): while fewer than rollout_batch_size / group_size
    informative groups were kept, draw that many more questions, up to --max_sampling_rounds rounds;
    the kept groups are cut to one batch. Rewards are logged over every sampled trace.

    batch = {"traces": kept traces (lists of rows), "advantages"/"raw_rewards": (kept traces,),
             "metrics": reward and sampling numbers, "samples": full rollouts for rollouts.jsonl,
             "seconds": {"sample", "score"}}.
    """
    questions = args.rollout_batch_size // args.group_size
    filtering = args.filter_low is not None or args.filter_high is not None
    stop = PROMPT_SETTINGS[args.prompt][1]
    kept, advantages, raw_rewards, metas, samples, mode_rows, lengths = [], [], [], [], [], [], []
    seconds = {"sample": 0.0, "score": 0.0}
    for sampling_round in range(1, args.max_sampling_rounds + 1):
        start = time.perf_counter()
        batch = questions_at(rows, drawn, questions, args.seed)
        drawn += questions
        prompt_texts, prompt_ids = build_prompts(tokenizer, batch, args.prompt, args.chat_template)
        params = SamplingParams(n=args.group_size, temperature=args.sampling_temperature, top_p=args.sampling_top_p,
                                max_tokens=args.sampling_max_tokens, stop=stop, logprobs=True,
                                seed=derive_seed(args.seed, step, sampling_round))
        round_traces = traces(ROLLOUT_MODES[args.rollout_mode](sampler, tokenizer, prompt_ids, params, args))
        seconds["sample"] += time.perf_counter() - start
        start = time.perf_counter()
        scores = []

        def score_and_keep(row, truth):
            scores.append(score(row, truth))
            return scores[-1]
        adv, raw, meta = compute_group_normalized_rewards(
            score_and_keep, [t[-1] for t in round_traces], [batch[t[-1].group_id]["answer"] for t in round_traces],
            args.group_size, args.advantage_eps, args.use_std_normalization)
        keep = torch.ones(len(round_traces), dtype=torch.bool)
        if filtering:
            accuracy = torch.tensor([float(s["answer_reward"]) for s in scores])
            keep = filter_groups(raw, args.group_size, args.filter_low, args.filter_high, accuracy=accuracy)
        metas.append(meta)
        seconds["score"] += time.perf_counter() - start
        mode_rows += [t[-1] for t in round_traces]
        lengths += [sum(sum(r.loss_mask) for r in t) for t in round_traces]  # sampled tokens per trace
        samples += [{"prompt": prompt_texts[t[-1].group_id], "response": t[-1].text, "reward": r,
                     "ground_truth": batch[t[-1].group_id]["answer"], "rows": len(t), "stats": t[-1].stats}
                    for t, r in zip(round_traces, raw.tolist())]
        for i in keep.nonzero().flatten().tolist():
            kept.append(round_traces[i])
            advantages.append(adv[i])
            raw_rewards.append(raw[i])
        if not filtering or len(kept) >= args.rollout_batch_size:
            break
    kept, advantages, raw_rewards = (x[:args.rollout_batch_size] for x in (kept, advantages, raw_rewards))
    metrics = {key: sum(m[key] for m in metas) / len(metas) for key in metas[0]}  # rounds are of equal size
    metrics = {"reward": metrics.pop("reward_mean"), "format_reward": metrics.get("format_reward_mean", 0.0),
               "answer_reward": metrics.get("answer_reward_mean", 0.0), "zero_std_groups": metrics["zero_std_fraction"],
               "response_tokens": sum(lengths) / len(lengths),
               "kept_traces": len(kept), "sampling_rounds": len(metas), "questions_sampled": len(metas) * questions}
    if args.rollout_mode == "tir":
        metrics.update(tir.tir_metrics(mode_rows, [s["reward"] for s in samples]))
    batch = {"traces": kept, "advantages": torch.stack(advantages) if kept else torch.zeros(0),
             "raw_rewards": torch.stack(raw_rewards) if kept else torch.zeros(0), "metrics": metrics, "samples": samples,
             "seconds": seconds}
    return batch, drawn


def _on_policy(args) -> bool:
    return args.epochs_per_rollout_batch == 1 and args.train_batch_size == args.rollout_batch_size


class _Means:
    """Token-weighted running means of the per-microbatch training numbers (and plain per-step lists)."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, key: str, value: float, weight: float = 1.0):
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def means(self) -> dict:
        return {k: self.sums[k] / self.weights[k] for k in self.sums if self.weights[k] > 0}


def _optimizer_step(args, policy, optimizer, reference, all_traces, batch_traces, advantages, raw_rewards,
                    old_log_probs, train: _Means, epoch: int) -> bool:
    """Microbatches of one train batch, gradient clipping and the step. False if it was skipped."""
    first_row = [0]  # flat position of each trace's first row (the order of old_log_probs)
    for trace in all_traces:
        first_row.append(first_row[-1] + len(trace))
    rows = [(i, first_row[i] + k, r) for i in batch_traces for k, r in enumerate(all_traces[i])]
    # Delethink's trace-length normaliser counts the tokens the loss sums over (forced tokens excluded)
    trace_lengths = {i: sum(sum(r.loss_mask) for r in all_traces[i]) for i in batch_traces}
    num_tokens = sum(sum(r.loss_mask) for _, _, r in rows)
    device = next(policy.parameters()).device
    temperature = args.sampling_temperature
    losses = []
    for first in range(0, len(rows), args.train_mini_batch_size):
        micro = rows[first:first + args.train_mini_batch_size]
        prompts, responses = [r.prompt_ids for _, _, r in micro], [r.response_ids for _, _, r in micro]
        out = rollout_log_probs(policy, prompts, responses, return_token_entropy=True, temperature=temperature)
        log_probs = out["log_probs"]  # (B, T)
        mask = _pad([r.loss_mask for _, _, r in micro], log_probs.shape[1], device)  # (B, T)
        trace_index = torch.tensor([i for i, _, _ in micro])
        old = log_probs.detach()  # on-policy: the ratio is 1 and only its gradient matters
        if old_log_probs is not None:
            old = old_log_probs[[k for _, k, _ in micro], :log_probs.shape[1]].to(device)
        ref = None
        if reference is not None:
            with torch.no_grad():
                ref = rollout_log_probs(reference, prompts, responses, temperature=temperature)["log_probs"].to(device)
        loss, meta = grpo_microbatch_train_step(
            log_probs, mask, len(rows) / len(micro), args.loss_type,
            raw_rewards=raw_rewards[trace_index].unsqueeze(-1).to(device),
            advantages=advantages[trace_index].unsqueeze(-1).to(device), old_log_probs=old,
            cliprange=args.cliprange, loss_agg_mode=args.loss_agg_mode, cliprange_high=args.cliprange_high,
            kl_coef=args.kl_coef, ref_log_probs=ref, max_response_length=args.sampling_max_tokens,
            num_tokens=num_tokens, num_traces=len(batch_traces),
            trace_lengths=torch.tensor([trace_lengths[i] for i, _, _ in micro], device=device))
        losses.append(loss.item())
        tokens = mask.sum().item()
        train.add("entropy", (out["token_entropy"] * mask).sum().item() / max(tokens, 1), tokens)
        for key in ("clip_fraction", "kl"):
            if key in meta:
                train.add(key, meta[key], tokens)
        if epoch == 0:  # the old policy is the learner's view of the sampler: log how far they disagree
            sampled = _pad([r.sampler_logprobs or [] for _, _, r in micro], log_probs.shape[1], device, math.nan)
            seen = mask.bool() & ~sampled.isnan()
            if seen.any():
                train.add("sampler_logprob_diff", (sampled - old)[seen].abs().mean().item(), seen.sum().item())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm).item()
    if not (math.isfinite(grad_norm) and all(math.isfinite(x) for x in losses)):
        tqdm.write(f"[train_rl] warning: non-finite loss or gradient (grad norm {grad_norm}); step skipped")
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train.add("loss", sum(losses))
    train.add("grad_norm", grad_norm)
    return True


@torch.no_grad()
def _log_probs_no_grad(policy, all_traces, args, autocast) -> torch.Tensor:
    """Old-policy log-probs (at the sampling temperature) of every row, flat order, before any update of
    this step: (rows, T)."""
    policy.eval()
    rows = [r for trace in all_traces for r in trace]
    width = max(len(r.response_ids) for r in rows)
    out = torch.zeros(len(rows), width)
    for first in range(0, len(rows), args.train_mini_batch_size):
        part = rows[first:first + args.train_mini_batch_size]
        with autocast:
            log_probs = rollout_log_probs(policy, [r.prompt_ids for r in part], [r.response_ids for r in part],
                                          temperature=args.sampling_temperature)["log_probs"]
        out[first:first + len(part), :log_probs.shape[1]] = log_probs.float().cpu()
    policy.train()
    return out


def _pad(lists, width, device, value: float = 0.0) -> torch.Tensor:
    out = torch.full((len(lists), width), value, device=device)
    for i, values in enumerate(lists):
        out[i, :len(values)] = torch.tensor(values, dtype=out.dtype)
    return out


def _log_line(m: dict, n_steps: int) -> str:
    seconds = " ".join(f"{k[8:]} {v:.1f}s" for k, v in m.items() if k.startswith("seconds_"))
    return (f"step {m['step']}/{n_steps} | reward {m['reward']:.3f} | fmt {m['format_reward']:.2f} | "
            f"ans {m['answer_reward']:.2f} | len {m['response_tokens']:.0f} | loss {m.get('loss', float('nan')):.4f} | "
            f"clip {m.get('clip_fraction', 0):.3f} | ent {m.get('entropy', float('nan')):.2f} | "
            f"gnorm {m.get('grad_norm', float('nan')):.2f} | kl {m.get('kl', 0):.4f} | "
            f"mismatch {m.get('sampler_logprob_diff', float('nan')):.4f} | {seconds}")


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
    cli(main, parse(RLArgs))
