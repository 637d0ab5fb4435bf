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

import dataclasses
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from alignment import data, distributed, models, tir
from alignment.args import RLArgs, parse, to_dict
from alignment.errors import MissingFileError, UserError, cli
from alignment.estimators import compute_value_loss
from alignment.evaluate import PROMPT_SETTINGS, evaluate
from alignment.experience import build_experience, collect_rollouts
from alignment.grpo import aggregate_loss, grpo_microbatch_train_step
from alignment.sampling import HFSampler, SamplingParams, WeightPush, derive_seed, make_sampler, pick_backend
from alignment.tokens import rollout_log_probs, rollout_values

# Flags that may differ between a run and its resumption; everything else must match.
RESUMABLE_CHANGES = {"resume", "n_steps", "eval_every", "save_every", "log_rollouts", "logger", "output_dir"}
MAX_BAD_STEPS = 3  # consecutive non-finite losses or gradients before the run aborts


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
        checkpoint = models.finish_interrupted_save(run_dir / "checkpoint")
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
        if distributed.is_main():
            print(f"[train_rl] --model not given: starting from {model}")
    models.resolve_model(model)  # a missing model fails here, before the run folder exists
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir, model, None


def load_questions(args: RLArgs, log=print) -> tuple[list[dict], list[dict], str]:
    """The training questions, the evaluation questions and the evaluation set's name. Held out means held
    out: a training question that is also an evaluation question (a procedural task can draw the same
    problem under two seeds) is left out of training."""
    train_rows = data.load_dataset(args.dataset, "train", args.data_dir, size=args.rg_size, seed=args.seed)
    eval_name = args.eval_dataset or args.dataset
    eval_rows = data.load_dataset(eval_name, "test", args.data_dir, size=args.eval_limit, seed=args.seed)[:args.eval_limit]
    held_out = {row["question"] for row in eval_rows}
    kept = [row for row in train_rows if row["question"] not in held_out]
    if len(kept) < len(train_rows):
        log(f"[train_rl] {len(train_rows) - len(kept)} of {len(train_rows)} training questions are evaluation "
            f"questions too; they are left out of training.")
    if not kept:
        raise UserError(f"every training question of {args.dataset} is also an evaluation question; choose a "
                        f"task with more distinct problems or a different --eval_dataset.")
    return kept, eval_rows, eval_name


def main(args: RLArgs) -> dict:
    # Under torchrun every rank runs this whole loop on its own device, on its share of the questions.
    device = distributed.setup()
    if device:
        distributed.refuse({"--sample_device": args.sample_device, "--reference_model_device": args.reference_model_device,
                            "--eval_device": args.eval_device, "--critic_device": args.critic_device})
        if args.advantage_estimator == "gae":
            raise UserError("under torchrun this loop has no sharded critic: use --advantage_estimator grpo, rloo "
                            "or reinforce_pp[_baseline], or run gae without torchrun.")
        questions, world = args.rollout_batch_size // args.group_size, distributed.world_size()
        if questions % world:
            raise UserError(f"under torchrun a step's {questions} questions are split over {world} ranks in whole "
                            f"groups: make --rollout_batch_size / --group_size a multiple of {world}.")
    # Rank 0 converts the packaged model and names the run folder (a default name holds the time); the
    # other ranks then use that folder.
    setup = setup_run(args) if distributed.is_main() else None
    folder = distributed.gather_objects(setup and str(setup[0]))[0]
    run_dir, start_model, state = setup or setup_run(dataclasses.replace(args, output_dir=folder))
    weights_from = str(run_dir / "checkpoint") if state else start_model
    roles = (dict(policy=[device], sample=device, reference=device, eval=device, critic=device) if device else
             models.assign_device_roles(models.available_devices(), args.sample_device, args.reference_model_device,
                                        args.eval_device, args.critic_device))
    backend = pick_backend("hf" if device and args.backend == "auto" else args.backend, roles["sample"])
    log = tqdm.write if distributed.is_main() else (lambda *a: None)
    log(f"[train_rl] {args.loss_type} on {args.dataset} from {weights_from}; devices {roles}; sampler {backend}; "
        f"{distributed.world_size()} process(es); run folder {run_dir}")
    if args.sampling_top_p < 1:
        log(f"[train_rl] warning: --sampling_top_p {args.sampling_top_p} samples from the nucleus but the loss "
              f"scores the full softmax at T={args.sampling_temperature}: the policy gradient is biased.")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    # Data first: a bad dataset or file fails before a minute of model loading.
    train_rows, eval_rows, eval_name = load_questions(args, log)

    # Models: the policy (trained, fp32 master weights; FSDP2-sharded under torchrun), the sampler (shares
    # the policy's weights when it can, else its own copy), the frozen reference for the KL penalty (the
    # run's starting model, also after a resume; only when kl_coef > 0), the critic (gae only), and the
    # evaluation sampler.
    tokenizer = models.load_tokenizer(weights_from)
    dtype, autocast = models.train_precision(roles["policy"][0], args.bf16_weights)
    policy = models.load_policy_model(weights_from, roles["policy"], dtype)
    if device:
        distributed.shard(policy, device)
    if backend == "hf":
        shares = roles["policy"] == [roles["sample"]] and not device
        sampler = HFSampler(policy if shares else models.load_model(weights_from, roles["sample"]), tokenizer,
                            args.sample_batch_size)
    else:
        sampler = make_sampler(backend, None, tokenizer, models.resolve_model(weights_from), roles["sample"],
                               seed=args.seed, **args.vllm_options())
    reference = models.load_model(start_model, roles["reference"]) if args.kl_coef > 0 else None
    eval_sampler = sampler if roles["eval"] == roles["sample"] else HFSampler(
        policy if roles["eval"] in roles["policy"] else models.load_model(weights_from, roles["eval"]), tokenizer)
    push = WeightPush(policy)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay,
                                  betas=(0.9, 0.95))
    critic = critic_optimizer = None
    if args.advantage_estimator == "gae":
        critic = models.load_critic(str(run_dir / "checkpoint" / "critic") if state else args.critic_model or start_model,
                                    roles["critic"], models.train_precision(roles["critic"], args.bf16_weights)[0])
        critic_optimizer = torch.optim.AdamW(critic.parameters(), lr=args.critic_learning_rate,
                                             weight_decay=args.weight_decay, betas=(0.9, 0.95))

    # The step this run starts at.
    score = make_scorer(args)
    start_step, bad_steps, drawn = 0, 0, 0  # drawn: questions taken from the stream so far
    if state is not None:
        distributed.load_optimizer(run_dir / "checkpoint" / "optimizer", policy, optimizer)
        if critic is not None:
            critic_optimizer.load_state_dict(state["critic_optimizer"])
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["python_rng"])
        start_step, bad_steps, drawn = state["step"], state["bad_steps"], state["questions_drawn"]
        if distributed.is_main():
            _truncate_jsonl(run_dir / "metrics.jsonl", start_step)
            _truncate_jsonl(run_dir / "rollouts.jsonl", start_step)
        log(f"[train_rl] resumed from {run_dir / 'checkpoint'} at step {start_step}")
    # Rank 0 logs, writes metrics and rollouts, and evaluates; the others stand in for it with no-ops.
    logger = make_logger(args.logger, run_dir, to_dict(args)) if distributed.is_main() else NullLogger()
    append = _append_jsonl if distributed.is_main() else (lambda *a: None)
    if distributed.is_main():
        (run_dir / "config.json").write_text(json.dumps({**to_dict(args), "start_model": start_model}, indent=2))

    def run_eval(step: int):
        push(eval_sampler)  # every rank: gathering sharded weights is collective
        if distributed.is_main():
            policy.eval()
            with autocast:
                summary, _ = evaluate(eval_sampler, tokenizer, eval_rows, args.prompt,
                                      SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens),
                                      args.chat_template, args.rollout_mode, args)
            metrics = {"step": step, **{f"eval_{k}": v for k, v in summary.items()}}
            append(run_dir / "metrics.jsonl", metrics)
            logger.log(metrics, step)
            log(f"eval  {step}/{args.n_steps} | {eval_name} x{summary['count']} | format {summary['avg_format_rewards']:.3f}"
                f" | answer {summary['avg_answer_rewards']:.3f} | reward {summary['avg_all_rewards']:.3f}")
        distributed.barrier()

    if args.eval_every and start_step == 0:
        run_eval(0)
    bar = tqdm(range(start_step, args.n_steps), desc="rl", unit="step", initial=start_step, total=args.n_steps,
               disable=not distributed.is_main())
    for step in bar:
        # 1-2. Sample and score groups until the batch holds enough informative ones (one round
        # without dynamic sampling).
        policy.eval()
        with autocast:
            batch, drawn = collect_rollouts(args, step, drawn, train_rows, sampler, tokenizer, score)
        times = dict(batch["seconds"])  # sample, score

        # 3. Before any update: old/reference log-probs and values as needed, then the advantages.
        # Then the update: epochs x train batches x microbatches (the policy waits out the critic warm-up).
        start = time.perf_counter()
        train, learn = _Means(), step >= args.critic_warmup_steps or critic is None
        if distributed.global_sum(len(batch["traces"])):  # every rank joins the update if any kept a group
            experience = build_experience(args, batch, policy, reference, critic, autocast)
            train.update(experience["metrics"])
            policy.train()
            groups = len(batch["traces"]) // args.group_size
            for epoch in range(args.epochs_per_rollout_batch):
                # a fresh group order per epoch, so off-policy epochs do not repeat the same minibatches;
                # rollout / train batch size optimizer steps per epoch (fewer groups kept: smaller steps)
                order = torch.randperm(groups, generator=torch.Generator().manual_seed(derive_seed(args.seed, step, epoch)))
                for chunk in order.tensor_split(args.rollout_batch_size // args.train_batch_size):
                    batch_traces = [g * args.group_size + k for g in chunk.tolist() for k in range(args.group_size)]
                    if not distributed.global_sum(len(batch_traces)):
                        continue  # no rank has a group for this step
                    with autocast:
                        ok = _optimizer_step(args, policy, optimizer, critic, critic_optimizer, experience,
                                             batch_traces, train, epoch, learn)
                    if learn and ok:
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
        append(run_dir / "metrics.jsonl", metrics)
        for record in batch["samples"][:args.log_rollouts]:
            append(run_dir / "rollouts.jsonl", {"step": step + 1, **record})
        logger.log(metrics, step + 1)
        log(_log_line(metrics, args.n_steps))
        if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.n_steps):
            run_eval(step + 1)
        if (step + 1) % args.save_every == 0 or step + 1 == args.n_steps:
            trainer_state = {"step": step + 1, "bad_steps": bad_steps,
                             "questions_drawn": drawn, "start_model": start_model,
                             "torch_rng": torch.get_rng_state(), "python_rng": random.getstate()}
            if critic is not None:
                trainer_state["critic_optimizer"] = critic_optimizer.state_dict()
            models.save_checkpoint(policy, tokenizer, run_dir / "checkpoint", config=to_dict(args),
                                   extra={"trainer_state.pt": trainer_state}, optimizer=optimizer,
                                   submodels={"critic": critic} if critic is not None else None)
    bar.close()
    return {"run_dir": str(run_dir), "last_metrics": _read_jsonl(run_dir / "metrics.jsonl")[-1:]}


class _Means:
    """Token-weighted running means of the per-microbatch training numbers (and plain per-step lists)."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, key: str, value: float, weight: float = 1.0):
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def update(self, values: dict):
        for key, value in values.items():
            self.add(key, value)

    def means(self) -> dict:
        """The means over every rank's microbatches (a collective under torchrun)."""
        sums, weights = {}, {}
        for rank_sums, rank_weights in distributed.gather_objects((self.sums, self.weights)):
            for key in rank_sums:
                sums[key] = sums.get(key, 0.0) + rank_sums[key]
                weights[key] = weights.get(key, 0.0) + rank_weights[key]
        return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def _optimizer_step(args, policy, optimizer, critic, critic_optimizer, exp: dict, batch_traces: list[int],
                    train: _Means, epoch: int, learn: bool) -> bool:
    """Microbatches of one train batch, gradient clipping and the step (of the policy when `learn`, of the
    critic when there is one). `exp` is build_experience's output. False if the step was skipped.

    Under torchrun the batch's counts (rows, tokens, traces) that the loss divides by are global (see
    distributed.per_rank_count), and every rank runs as many microbatches as the busiest one, the extra
    ones on a masked dummy row, so the sharded policy's collectives line up."""
    in_batch = set(batch_traces)
    rows = [i for i, trace in enumerate(exp["row_trace"].tolist()) if trace in in_batch]  # flat row indices
    mask_all, row_trace = exp["mask"], exp["row_trace"]
    # Delethink's trace-length normaliser counts the tokens the loss sums over (forced tokens excluded)
    trace_tokens = torch.zeros(len(exp["raw_rewards"]) and int(row_trace.max()) + 1).index_add(0, row_trace, mask_all.sum(-1))
    num_rows = distributed.per_rank_count(len(rows))
    num_tokens = distributed.per_rank_count(mask_all[rows].sum().item())
    num_traces = distributed.per_rank_count(len(batch_traces))
    device = next(policy.parameters()).device
    sharded = distributed.launched()
    kl_coef = 0.0 if args.kl_in_reward else args.kl_coef  # in the reward it already shaped the advantages
    losses = []
    calls = -(-len(rows) // args.train_mini_batch_size)
    for call in range(distributed.even_out(calls) if sharded else calls):
        micro = rows[call * args.train_mini_batch_size:(call + 1) * args.train_mini_batch_size]
        if not micro:  # this rank is out of rows: a dummy forward and backward that changes nothing
            (rollout_log_probs(policy, [[0]], [[0]], one_forward=True)["log_probs"].sum() * 0).backward()
            continue
        prompts = [exp["rows"][i].prompt_ids for i in micro]
        responses = [exp["rows"][i].response_ids for i in micro]
        width = max(map(len, responses))
        mask = mask_all[micro, :width].to(device)  # (B, T)

        def take(name):  # this microbatch's slice of a precomputed (rows, T) tensor, or None
            value = exp[name]
            return None if value is None else value[micro, :width].to(device)
        tokens = mask.sum().item()
        if critic is not None:  # PPO's value loss, token-mean over the train batch (clipped, eq. 9)
            values = rollout_values(critic, prompts, responses)
            value_loss, value_meta = compute_value_loss(values, take("old_values"), take("returns"), mask,
                                                        args.cliprange_value)
            (aggregate_loss(value_loss, mask, "token-mean", num_tokens=num_tokens) * args.value_loss_coef).backward()
            train.add("value_loss", (value_loss.detach() * mask).sum().item() / max(tokens, 1), tokens)
            train.add("value_clip_fraction", value_meta["clipped"].float().sum().item() / max(tokens, 1), tokens)
        with torch.set_grad_enabled(learn):  # during the critic warm-up the policy's forward only logs
            out = rollout_log_probs(policy, prompts, responses, return_token_entropy=True, one_forward=sharded,
                                    temperature=args.sampling_temperature, entropy_grad=bool(args.entropy_coef))
        log_probs = out["log_probs"]  # (B, T)
        old = take("old_log_probs")
        old = log_probs.detach() if old is None else old  # on-policy: the ratio is 1, only its gradient matters
        advantages = exp["advantages"][micro]
        advantages = (advantages if advantages.shape[1] == 1 else advantages[:, :width]).to(device)
        if learn:
            loss, meta = grpo_microbatch_train_step(
                log_probs, mask, num_rows / len(micro), args.loss_type,
                raw_rewards=exp["raw_rewards"][micro].unsqueeze(-1).to(device), advantages=advantages, old_log_probs=old,
                cliprange=args.cliprange, loss_agg_mode=args.loss_agg_mode, cliprange_high=args.cliprange_high,
                kl_coef=kl_coef, ref_log_probs=take("ref_log_probs"), kl_estimator=args.kl_estimator,
                entropy_coef=args.entropy_coef, token_entropy=out["token_entropy"],
                max_response_length=args.sampling_max_tokens, num_tokens=num_tokens, num_traces=num_traces,
                trace_lengths=trace_tokens[row_trace[micro]].to(device))
            losses.append(loss.item())
            for key in ("clip_fraction", "kl"):
                if key in meta:
                    train.add(key, meta[key], tokens)
        train.add("entropy", (out["token_entropy"].detach() * mask).sum().item() / max(tokens, 1), tokens)
        if epoch == 0 and args.sampling_top_p == 1:  # the old policy is the learner's view of the sampler;
            # with top_p < 1 the sampler's log-probs are of the renormalised nucleus: not comparable
            rows_ = [exp["rows"][i] for i in micro]
            sampled = _pad([r.sampler_logprobs or [] for r in rows_], width, device, math.nan)
            seen = mask.bool() & ~sampled.isnan()
            if seen.any():
                train.add("sampler_logprob_diff", (sampled - old)[seen].abs().mean().item(), seen.sum().item())
    ok = True
    if critic is not None:
        ok = _clip_and_step(critic, critic_optimizer, args.max_grad_norm, train, "critic_grad_norm")
    if learn:
        ok = _clip_and_step(policy, optimizer, args.max_grad_norm, train, "grad_norm", losses) and ok
        if ok:
            train.add("loss", sum(losses))
    return ok


def _clip_and_step(model, optimizer, max_grad_norm: float, train: _Means, name: str, losses=()) -> bool:
    """Clip the gradient norm and step, or skip the step (and drop the gradient) when anything is non-finite
    (on any rank: every rank makes the same choice)."""
    grad_norm = distributed.grad_norm_and_clip(model, max_grad_norm)
    if not distributed.global_min(math.isfinite(grad_norm) and all(math.isfinite(x) for x in losses)):
        tqdm.write(f"[train_rl] warning: non-finite loss or gradient ({name} {grad_norm}); step skipped")
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train.add(name, grad_norm)
    return True


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
            f"mismatch {m.get('sampler_logprob_diff', float('nan')):.1e} | {seconds}")


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
