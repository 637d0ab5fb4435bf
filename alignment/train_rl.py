"""Policy-gradient RL for math reasoning: REINFORCE, REINFORCE with a group baseline, GRPO-clip.

    uv run -m alignment.train_rl --loss_type grpo_clip          # CPU default: short run on rg:chain_sum
    uv run -m alignment.train_rl --model checkpoints/math_sft --dataset gsm8k --rollout_batch_size 256 \
        --train_batch_size 256 --group_size 8 --sampling_max_tokens 1024 --n_steps 200   # reference, GPUs
    uv run -m alignment.train_rl --resume checkpoints/rl/<run>  # same flags + --resume after a crash

One step: sample `group_size` responses for each question with the rollout mode and score them with the
grader (with dynamic sampling: drop groups without signal and sample more questions until the batch is
full); build the step's `Experience` (old/reference log-probs, values, advantages) before any update; then
for each epoch and train batch compute the loss weights once, run the microbatches through
`policy_microbatch_train_step`, clip, step, and push the new weights to the sampler. With `--async_steps 1`
the next step's batch is sampled while this one trains (alignment/async_rollouts.py says how that stays
correct). The run folder, its metrics and checkpoints are `alignment.run.Run`'s.

Every log-prob the loss uses (current, old, reference) is of softmax(logits / sampling temperature), the
distribution the responses were drawn from. Departures from the reference loop, all for speed and none
changing the maths: the responses of one question share a single prompt forward pass
(`tokens.rollout_log_probs`), logits are computed only at response positions, and when the update is
on-policy (one epoch, one optimizer step per rollout batch) the old log-probs are the current ones
detached instead of a second forward pass.
"""

import contextlib
import random
import time
from dataclasses import dataclass
from pathlib import Path

from alignment.args import RLArgs, parse

if __name__ == "__main__":  # the flags before torch loads: --help and a bad flag answer in 0.1 s, not 9
    ARGS = parse(RLArgs)

import torch
from tqdm.auto import tqdm

from alignment import allocator, data, distributed, lora, models, tir, user_reward
from alignment.async_rollouts import RolloutSource
from alignment.errors import UserError, cli
from alignment.estimators import compute_rollout_is_weights, compute_value_loss, sampler_mismatch
from alignment.evaluate import PROMPT_SETTINGS, check_context, context_need, evaluate, make_scorer, summary_line
from alignment.experience import Experience, SamplingStopped, build_experience, collect_rollouts
from alignment.grpo import CLIPPED_LOSSES, policy_microbatch_train_step, weighted_sum
from alignment.run import Run
from alignment.samplers import make_sampler, pick_backend
from alignment.sampling import SamplingParams, WeightPush, derive_seed
from alignment.tokens import SharedPrompts, rollout_log_probs, rollout_values, to_device

RESUMABLE_CHANGES = {"n_steps"}  # flags a resumed run may change, besides the run folder's own (run.py)
MAX_BAD_STEPS = 3  # consecutive non-finite losses or gradients before the run aborts
# --microbatch_tokens' default on CUDA, where the train phase is bound by launches (docs/results.md, "Second pass:
# the train phase under the profiler"): the 1.5B pass's whole train batch (64 rows of a prompt and 256 answer
# tokens) in one microbatch. Its peak memory with 16-row microbatches (38.7 GiB of the H200's 139) puts this at
# roughly 100 GiB; not yet measured on a GPU (a smaller GPU or a larger model: lower --microbatch_tokens)
CUDA_MICROBATCH_TOKENS = 32_768


def load_questions(args: RLArgs, log=print, script: str = "train_rl") -> tuple[list[dict], list[dict], str]:
    """The training questions, the evaluation questions and the evaluation set's name. Held out means held
    out: a training question that is also an evaluation question (a procedural task can draw the same
    problem under two seeds) is left out of training."""
    keys = dict(question_key=args.question_key, answer_key=args.answer_key)  # a file's columns
    train_rows = data.load_dataset(args.dataset, "train", args.data_dir, size=args.rg_size, seed=args.seed, **keys)
    eval_name = args.eval_dataset or args.dataset
    eval_rows = data.load_dataset(eval_name, "test", args.data_dir, size=args.eval_limit, seed=args.seed, **keys,
                                  flag="--eval_dataset" if args.eval_dataset else "--dataset")[:args.eval_limit]
    if data.is_file(eval_name):
        log(f"[{script}] held out of training: the test split of {eval_name} (one question in {data.HELD_OUT_EVERY}, "
            f"by a hash of the question, the same for every seed, unless a `datasets` folder names its own)"
            f"{f'; evaluated: its first {len(eval_rows)} questions' if eval_rows and args.eval_every else ''}")
    held_out = {data.twin(row["question"]) for row in eval_rows}  # a copy differing in spacing or case is the same
    kept = [row for row in train_rows if data.twin(row["question"]) not in held_out]
    if len(kept) < len(train_rows):
        later = "" if args.eval_every else (" (no evaluation in this run, --eval_every 0: held out so that an "
                                            "alignment.evaluate of them later measures questions never trained on)")
        log(f"[{script}] {len(train_rows) - len(kept)} of {len(train_rows)} training questions are among the "
            f"{len(eval_rows)} evaluation questions ({eval_name}, --eval_limit {args.eval_limit}); they are left out "
            f"of training{later}.")
    # the evaluation set's whole test split too, beyond --eval_limit: `evaluate --dataset NAME` scores all of it (an
    # rg: task's first 2,000, a file's hashed tenth, whose hash keeps case: "WHAT IS 3 + 7?" can fall in train while
    # "What is 3 + 7?" is a test question; a `datasets` folder's own test split)
    test = data.test_twins(eval_name, args.data_dir, flag="--eval_dataset" if args.eval_dataset else "--dataset", **keys)
    before, kept = len(kept), [row for row in kept if data.twin(row["question"]) not in test]
    if len(kept) < before:
        log(f"[{script}] {before - len(kept)} more training questions are copies (the same, or in other spacing or "
            f"case) of questions in the test split of {eval_name}, which `alignment.evaluate --dataset {eval_name}` "
            f"scores; left out too.")
    data.log_trained_test_questions(args.dataset, eval_name, [row["question"] for row in kept], log, script,
                                    args.data_dir, **keys)
    if not kept:
        raise UserError(f"every training question of {args.dataset} is also an evaluation question; choose a "
                        f"task with more distinct problems or a different --eval_dataset.")
    per_step = args.rollout_batch_size // args.group_size  # EI: its --questions_per_step (EIArgs.rollout_batch_size)
    if per_step > len(kept):  # the stream would repeat questions within one step, each counted as another
        flags = (f"--questions_per_step {per_step}" if script == "expert_iteration" else
                 f"--rollout_batch_size {args.rollout_batch_size} / --group_size {args.group_size}")
        raise UserError(f"{flags} draws {per_step} questions a step, but {args.dataset} has {len(kept)} to train on "
                        f"(after the held-out ones): lower it{', or raise --rg_size' if args.dataset.startswith('rg:') else ''}.")
    return kept, eval_rows, eval_name


@dataclass
class Models:
    """What the loop runs. The policy trains in fp32 master weights (FSDP2-sharded under torchrun); the
    sampler shares its weights when it can, else holds its own copy (refreshed by the weight push); the
    frozen reference is the run's starting model, also after a resume (only when kl_coef > 0; with LoRA the
    policy itself, run with its adapters off); the critic is for gae only."""

    tokenizer: object
    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    sampler: object
    eval_sampler: object
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    critic_optimizer: torch.optim.Optimizer | None
    autocast: object  # the forward passes' precision context


@user_reward.closes_workers
def main(args: RLArgs) -> dict:
    # Under torchrun every rank runs this whole loop on its own device, on its share of the questions.
    args.check()
    allocator.apply(args.keep_freed_memory)  # each step reusing the last one's memory: faster, more resident
    device = distributed.setup()
    _refuse_under_torchrun(args, device)
    run = Run(args, f"checkpoints/rl/{args.loss_type}-{time.strftime('%Y%m%d-%H%M%S')}", start_model(args),
              RESUMABLE_CHANGES)
    run.refuse_finished(args.n_steps, "--n_steps")
    roles, backend = _devices_and_backend(args, device)
    _say_plan(args, run, roles, backend, device)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    # Data first: a bad dataset or file fails before a minute of model loading.
    train_rows, eval_rows, eval_name = load_questions(args, run.say)
    if args.rollout_mode != "tir":  # before the weights load and an engine starts (delethink: one chunk)
        need, length = context_need(args, max(args.sampling_max_tokens, args.eval_max_tokens))
        check_context(args.vllm_max_model_len if backend == "vllm" else None, models.load_tokenizer(run.weights),
                      train_rows + eval_rows, args.prompt, args.chat_template, need, run.weights, length, args.prompt_file)
    else:  # tir checks its budget as it goes; its prompts are written now, so a {column} the rows lack fails here
        template = data.prompt_template(args.prompt, args.prompt_file)
        for row in train_rows + eval_rows:
            data.format_prompt(template, row["question"], row.get("columns"))
    score = make_scorer(args, train_rows + eval_rows)  # a bad --reward_fn is refused before the weights load
    user_reward.recall_returned(score, run.metrics() if run.start_step else [])  # (a resume reads as a run never stopped)
    m = load_models(args, run, roles, device, backend)
    reference = ("the policy with its adapters off (no second copy)" if m.reference is m.policy else
                 f"{run.start_model} on {roles['reference']}" if m.reference is not None else "none (--kl_coef 0)")
    run.say(f"[train_rl] policy: {lora.describe(m.policy, args)}; KL reference: {reference}")
    once = {"trainable_params": sum(p.numel() for p in lora.trainable_parameters(m.policy))}  # in the first record
    push = WeightPush(m.policy)
    # on a GPU the clock is read once the queued kernels have run, so a phase's time does not land in the next one
    settle = (lambda: torch.cuda.synchronize(roles["policy"][0])) if roles["policy"][0].startswith("cuda") else (lambda: None)
    state = run.restore(m.policy, m.optimizer) or {}
    if m.critic is not None and state:
        m.critic_optimizer.load_state_dict(state["critic_optimizer"])
    bad_steps = state.get("bad_steps", 0)
    generated_tokens = state.get("generated_tokens", 0)  # cumulative: compares runs at equal sampling work

    # a stop during the refill gives the step up (synchronous loop); a batch sampled ahead is finished
    # (a checkpoint holds it: the resumed run trains on what the uninterrupted one would have)
    stopping = lambda: not args.async_steps and run.signal > 0  # noqa: E731

    def collect(step: int, drawn: int):  # drawn: the position in the question stream
        return collect_rollouts(args, step, drawn, train_rows, m.sampler, m.tokenizer, score, stopping)
    source = RolloutSource(args.async_steps, args.n_steps, collect, lambda: push(m.sampler),
                           state.get("questions_drawn", 0), state.get("in_flight"))

    def run_eval(step: int):  # greedy, on rank 0; the others join the weight gather and wait
        _evaluate(args, run, m, source, push, eval_rows, eval_name, step, generated_tokens, score)

    def save(steps: int):  # every rank; the checkpoint after `steps` finished steps
        critic = {"critic_optimizer": m.critic_optimizer.state_dict()} if m.critic is not None else {}
        run.save(steps, m.policy, m.tokenizer, m.optimizer,
                 {"bad_steps": bad_steps, "generated_tokens": generated_tokens, **source.state(), **critic},
                 submodels={"critic": m.critic} if m.critic is not None else None)

    if args.eval_every and args.eval_before_train and run.start_step == 0:
        run_eval(0)
    bar = tqdm(range(run.start_step, args.n_steps), desc="rl", unit="step", initial=run.start_step,
               total=args.n_steps, disable=not run.main)
    with run.stop_on_signal():  # the first Ctrl-C or SIGTERM ends the run after this step, saved
        for step in bar:
            # 1-3. Sample and score this step's batch, build its experience, update on it.
            batch, train, times, bad_steps = _one_step(args, run, m, source, push, step, bad_steps, save, settle)
            check_reward(args, run, score, batch, step)
            generated_tokens += int(batch.metrics["sampled_tokens"])

            # 4. Log, write a few full rollouts, evaluate, checkpoint.
            metrics = {"step": step + 1, **batch.metrics, "generated_tokens": generated_tokens,
                       "policy_lag": step - batch.policy_version, **train.means(),
                       **{f"seconds_{k}": v for k, v in times.items()}, **once}
            once = {}
            run.log(metrics)
            run.log_rollouts(step + 1, batch.samples[:args.log_rollouts])
            run.say(_log_line(metrics, args.n_steps, args.critic_warmup_steps if m.critic is not None else 0))
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.n_steps):
                run_eval(step + 1)
            stop = run.stop_requested()  # Ctrl-C or SIGTERM: checkpoint this step, then end
            if stop or (step + 1) % args.save_every == 0 or step + 1 == args.n_steps:
                save(step + 1)
            if stop:
                run.stopped(step + 1)
    bar.close()
    return {"run_dir": str(run.dir), "last_metrics": run.metrics()[-1:]}


def _devices_and_backend(args: RLArgs, device: str) -> tuple[dict, str]:
    """Each model's device (under torchrun all on this rank's) and the sampler's backend, refusing what cannot work."""
    roles = (dict(policy=[device], sample=device, reference=device, eval=device, critic=device) if device else
             models.assign_device_roles(models.available_devices(), args.sample_device, args.reference_model_device,
                                        args.eval_device, args.critic_device))
    precision = models.resolve_precision(args.precision, roles["policy"][0])
    if args.bf16_weights and not (roles["policy"][0].startswith("cuda") and precision == "bf16"):
        raise UserError(f"--bf16_weights keeps bf16 parameters on a GPU that computes in bf16; here the policy runs on "
                        f"{roles['policy'][0]} in {precision} (--precision {args.precision}), where it would change "
                        f"nothing: drop it.")
    backend = pick_backend("hf" if device and args.backend == "auto" else args.backend, roles["sample"])
    if args.async_steps and backend == "hf" and roles["policy"] == [roles["sample"]]:
        raise UserError("--async_steps 1 samples while the policy trains, so the sampler needs weights of its own: "
                        "use --backend vllm, or put the sampler on another device with --sample_device.")
    return roles, backend


def _say_plan(args: RLArgs, run: Run, roles: dict, backend: str, device: str):
    """The start line (loss, advantages, devices, sampler, precision, microbatches); warnings on biased flags."""
    tokens = microbatch_tokens(args, roles["policy"][0])
    microbatch = f"up to {tokens} tokens" if tokens else f"{args.train_mini_batch_size} rows"
    if tokens and "train_mini_batch_size" in getattr(args, "given_flags", ()):  # (given both: refused at parse)
        run.say(f"[train_rl] --train_mini_batch_size is not used on {roles['policy'][0]}, where microbatches are sized "
                f"by tokens (--microbatch_tokens, default {tokens} there): add --microbatch_tokens 0 for rows.")
    run.say(f"[train_rl] {args.loss_type} loss, {args.advantage_estimator} advantages"
            f"{' (the raw reward)' if args.advantage_estimator == 'none' else ''}, rollout correction {args.rollout_is}"
            f"{f' ({args.rollout_is_level} level)' if args.rollout_is != 'none' else ''}, on {args.dataset} from {run.weights}; "
            f"devices {roles}; sampler {backend}; precision {models.resolve_precision(args.precision, roles['policy'][0])}"
            f" ({args.precision}); microbatches of {microbatch}; "
            f"{distributed.world_size()} process(es){' (torchrun, FSDP2)' if device else ''}; "
            f"run folder {run.dir}")
    if args.sampling_min_tokens:
        run.say(f"[train_rl] warning: --sampling_min_tokens {args.sampling_min_tokens} keeps the sampler from ending "
                f"early, but the loss scores the full softmax, where ending is possible: the gradient is biased (meant "
                f"for benchmarks that force equal work).")
    if args.sampling_top_p < 1:
        run.say(f"[train_rl] warning: --sampling_top_p {args.sampling_top_p} samples from the nucleus but the loss "
                f"scores the full softmax at T={args.sampling_temperature}: the policy gradient is biased.")


def _evaluate(args: RLArgs, run: Run, m: Models, source, push, eval_rows, eval_name: str, step: int, generated_tokens,
              score):
    """Greedy evaluation on rank 0, logged; the other ranks join the weight gather and wait."""
    source.wait()  # the sampler and the grader are the loop's again
    push(m.eval_sampler)
    if run.main:
        budget = args.delethink_budget() if args.rollout_mode == "delethink" else f"up to {args.eval_max_tokens} tokens"
        run.say(f"eval  {step}/{args.n_steps} | {len(eval_rows)} {eval_name} questions, greedy, {budget} each ...")
        m.policy.eval()
        with m.autocast:
            summary, _ = evaluate(m.eval_sampler, m.tokenizer, eval_rows, args.prompt,
                                  SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens),
                                  args.chat_template, args.rollout_mode, args, progress=True, score=score,
                                  prompt_file=args.prompt_file)
        run.log({"step": step, "generated_tokens": generated_tokens, **{f"eval_{k}": v for k, v in summary.items()}})
        run.say(f"eval  {step}/{args.n_steps} | {eval_name} x{summary['count']} | {summary_line(summary)}")
    distributed.barrier()
    check_eval_reward(args, run, score, summary if run.main else None, step)


def check_eval_reward(args, run: Run, score, summary: dict | None, step: int, script: str = "train_rl"):
    """A --reward_fn on the evaluation's answers (graded on rank 0: `summary` there, None elsewhere): each failure
    kind said once as the evaluation's, not the next step's; one line when it failed on every answer, as evaluate
    stops (a reward of 0.000 would read like the model's) - on every rank, so none waits for the others."""
    reward = getattr(score, "user_reward", None)
    if reward is None:
        return
    failed_all = bool(summary and summary["count"] and
                      summary.get("reward_failures") == summary["count"] * summary["n_samples"])
    if distributed.global_sum(float(failed_all)):
        then = "resume (--resume)" if step > 0 else "start again"
        example = f", e.g. {reward.errors[-1]}" if reward.errors else ""
        raise UserError(f"--reward_fn {args.reward_fn} failed on every answer of the evaluation at step {step} "
                        f"({summary['count'] if summary else '?'} held-out questions){example}: fix it, then {then}.")
    for error in reward.news():
        run.say(f"[{script}] evaluation at step {step}: a --reward_fn call failed (scored 0): {error}")


def check_reward(args, run: Run, score, batch, step: int, script: str = "train_rl"):
    """A --reward_fn that failed on every sample of the run's first step (or of a resume's first, after the reward
    changed) is a bug, not an odd sample: one line. Later, as in a run never stopped, failures are counted; each
    kind is said once in the log (train_rl and expert_iteration)."""
    reward = getattr(score, "user_reward", None)
    if reward is None:
        return
    resumed = step > 0
    if (step == 0 or (step == run.start_step and args.accept_changed_reward)) and \
            batch.metrics["reward_failures"] >= batch.metrics["questions_sampled"] * args.group_size:
        which, then = ("resumed run", "resume again") if resumed else ("run", "start again")
        raise UserError(f"--reward_fn {args.reward_fn} failed on every sample of the {which}'s first step, e.g. "
                        f"{reward.errors[-1] if reward.errors else '(on another rank)'}: fix it, then {then}.")
    for error in reward.news():
        run.say(f"[{script}] step {step + 1}: a --reward_fn call failed (scored 0): {error}")


def _one_step(args: RLArgs, run: Run, m: Models, source, push, step: int, bad_steps: int, save, settle) -> tuple:
    """Sample, build the experience, update: (batch, training numbers, seconds, consecutive skipped steps)."""
    # 1-2. Sample and score groups until the batch holds enough informative ones (one round without dynamic
    # sampling); one step ahead, this step's batch was sampled while the last step trained.
    step_start = time.perf_counter()
    m.policy.eval()
    with contextlib.nullcontext() if args.async_steps else m.autocast:  # async: the sampler is a copy
        try:
            batch = source.take(step)
        except SamplingStopped as stopped:  # nothing of this step is kept: save where the last one ended
            run.say(f"[run] {stopped}: the step is given up, before any update")
            if step > run.start_step:  # else the checkpoint, if any, already holds this state
                save(step)
            run.stopped(step)
    times = dict(batch.seconds)  # sample, score (async: in the background; wait and sync in the loop)
    # 3. Before any update: old/reference log-probs, values and advantages. Then the update.
    start, train = time.perf_counter(), _Means()
    if distributed.global_sum(len(batch.traces)):  # every rank joins the update if any kept a group
        experience = build_experience(args, batch, m.policy, m.reference, m.critic, m.autocast)
        train.update(experience.metrics)
        bad_steps = _update(args, m, experience, len(batch.traces) // args.group_size, step, train, push,
                            bad_steps, run.checkpoint)
    settle()
    times["train"] = time.perf_counter() - start
    times["sync"] = times.get("sync", 0.0) + source.after_update()
    settle()
    times["step"] = time.perf_counter() - step_start  # the step's wall time, evaluation and checkpoint aside
    return batch, train, times, bad_steps


def _refuse_under_torchrun(args: RLArgs, device: str):
    if not device:
        return
    lora.refuse_under_torchrun(args)
    distributed.refuse({"--sample_device": args.sample_device, "--reference_model_device": args.reference_model_device,
                        "--eval_device": args.eval_device, "--critic_device": args.critic_device})
    if args.async_steps:
        raise UserError("--async_steps 1 is not supported under torchrun (each rank's sampling joins collectives that "
                        "would interleave with training's): run it without torchrun, or with --async_steps 0.")
    if args.group_size_max:
        raise UserError("--group_size_max is not supported under torchrun (each rank would grow its groups in a "
                        "different number of rounds, and the sharded policy samples in lock-step): run it without "
                        "torchrun, or with fixed groups.")
    if args.advantage_estimator == "gae":
        raise UserError("under torchrun this loop has no sharded critic: use --advantage_estimator grpo, rloo "
                        "or reinforce_pp[_baseline], or run gae without torchrun.")
    questions, world = args.rollout_batch_size // args.group_size, distributed.world_size()
    if questions % world:
        raise UserError(f"under torchrun a step's {questions} questions are split over {world} ranks in whole "
                        f"groups: make --rollout_batch_size / --group_size a multiple of {world}.")


def start_model(args) -> str | None:
    """The model a new run starts from (a resumed run's folder knows its own). A missing model fails here,
    before the run folder exists; rank 0 converts the packaged model first."""
    if args.resume:
        return None
    model = args.model or ("checkpoints/math_sft" if models.is_model_folder(models.CHECKPOINTS / "math_sft")
                           else "smollm2-135m")
    with distributed.main_first():
        models.resolve_model(model)
    return model


def load_models(args: RLArgs, run: Run, roles: dict, device: str, backend: str) -> Models:
    tokenizer = models.load_tokenizer(run.weights)
    dtype, autocast = models.train_precision(roles["policy"][0], args.precision, args.bf16_weights)
    policy = models.load_policy(run, args, roles["policy"], dtype)
    if device:
        distributed.shard(policy, device, bf16=models.resolve_precision(args.precision, device) == "bf16")
    if args.compile_layers:  # after sharding; the samplers below are copies, or share it only on the CPU
        run.say(f"[train_rl] --compile_layers: {models.compile_layers(policy)} decoder layers compiled "
                f"({models.COMPILE_BACKEND}); the first forward of each kind pays the compile")

    def copy(name, role):  # a model that is only run, in the run's precision on its device
        return models.load_model(name, roles[role], models.default_dtype(roles[role], args.precision))
    if backend == "hf":  # sharing the policy, it samples under the policy's autocast; the static sampler on CUDA gets
        # its own bf16 copy (pushed after each update), so its compiled step reads bf16 weights, not casts of fp32 ones
        static = args.hf_decoding == "static"
        shares = roles["policy"] == [roles["sample"]] and not device and not (static and roles["sample"].startswith("cuda"))
        sampler = make_sampler("hf", policy if shares else copy(run.weights, "sample"), tokenizer,
                               batch_size=args.sample_batch_size, decoding=args.hf_decoding)
    else:
        sampler = make_sampler(backend, None, tokenizer, models.resolve_model(run.weights), roles["sample"],
                               seed=args.seed, **args.vllm_options())
    # LoRA: the policy with its adapters off is the start model (build_experience runs it in lora.frozen)
    reference = (policy if lora.is_lora(policy) else copy(run.start_model, "reference")) if args.kl_coef > 0 else None
    eval_sampler = sampler if roles["eval"] == roles["sample"] else make_sampler(
        "hf", policy if roles["eval"] in roles["policy"] else copy(run.weights, "eval"), tokenizer,
        decoding=args.hf_decoding)
    optimizer = models.adamw(lora.trainable_parameters(policy), lr=args.learning_rate,
                             weight_decay=args.weight_decay, betas=(0.9, 0.95))
    critic = critic_optimizer = None
    if args.advantage_estimator == "gae":
        critic = models.load_critic(str(run.checkpoint / "critic") if run.state else args.critic_model or run.start_model,
                                    roles["critic"], models.train_precision(roles["critic"], args.precision,
                                                                            args.bf16_weights)[0])
        critic_optimizer = models.adamw(critic.parameters(), lr=args.critic_learning_rate,
                                        weight_decay=args.weight_decay, betas=(0.9, 0.95))
    return Models(tokenizer, policy, optimizer, sampler, eval_sampler, reference, critic, critic_optimizer, autocast)


class _Means:
    """Token-weighted running means of the per-microbatch training numbers (and plain per-step lists)."""

    def __init__(self):
        self.sums, self.weights = {}, {}

    def add(self, key: str, value, weight=1.0):
        """Floats, or 0-d tensors on the device (summed there: read once, in means(), not per microbatch)."""
        self.sums[key] = self.sums.get(key, 0.0) + value * weight
        self.weights[key] = self.weights.get(key, 0.0) + weight

    def update(self, values: dict):
        for key, value in values.items():
            self.add(key, value)

    def means(self) -> dict:
        """The means over every rank's microbatches (a collective under torchrun). Device values are read here,
        all at once: one host sync for the whole step."""
        keys = [(part, key) for part in (self.sums, self.weights) for key in part if torch.is_tensor(part[key])]
        if keys:
            device = keys[0][0][keys[0][1]].device  # (the critic's values may sit on another device)
            values = torch.stack([part[key].detach().float().to(device) for part, key in keys]).tolist()
            for (part, key), value in zip(keys, values):
                part[key] = value
        sums, weights = {}, {}
        for rank_sums, rank_weights in distributed.gather_objects((self.sums, self.weights)):
            for key in rank_sums:
                sums[key] = sums.get(key, 0.0) + rank_sums[key]
                weights[key] = weights.get(key, 0.0) + rank_weights[key]
        return {k: sums[k] / weights[k] for k in sums if weights[k] > 0}


def microbatch_tokens(args, device) -> int:
    """Tokens per microbatch on `device`, 0 for microbatches of --train_mini_batch_size rows: --microbatch_tokens,
    else CUDA_MICROBATCH_TOKENS on CUDA and rows elsewhere (what was measured best on CPU)."""
    if args.microbatch_tokens is not None:
        return args.microbatch_tokens
    return CUDA_MICROBATCH_TOKENS if torch.device(device).type == "cuda" else 0


def _update(args, m: Models, exp: Experience, groups: int, step: int, train: _Means, push, bad_steps: int,
            checkpoint) -> int:
    """Epochs x train batches of optimizer steps on one step's experience; the policy waits out the critic
    warm-up. Returns the count of consecutive skipped (non-finite) steps."""
    learn = step >= args.critic_warmup_steps or m.critic is None
    row_trace = exp.row_trace.tolist()
    if args.rollout_is != "none" and exp.sampler_log_probs[exp.mask.bool()].isnan().any():  # once, on the host
        raise UserError(f"--rollout_is {args.rollout_is} needs the sampler's log-prob of every sampled token, and "
                        f"these rollouts carry none; use --rollout_is none.")
    m.policy.train()
    for epoch in range(args.epochs_per_rollout_batch):
        # a fresh group order per epoch, so off-policy epochs do not repeat the same minibatches;
        # rollout / train batch size optimizer steps per epoch (fewer groups kept: smaller steps)
        order = torch.randperm(groups, generator=torch.Generator().manual_seed(derive_seed(args.seed, step, epoch)))
        for chunk in order.tensor_split(args.rollout_batch_size // args.train_batch_size):
            traces = {g * args.group_size + k for g in chunk.tolist() for k in range(args.group_size)}
            if not distributed.global_sum(len(traces)):
                continue  # no rank has a group for this step
            rows = [i for i, trace in enumerate(row_trace) if trace in traces]
            with m.autocast:
                ok = _optimizer_step(args, m, exp, rows, train, epoch, learn)
            if learn and ok:
                push.policy_changed()
            bad_steps = 0 if ok else bad_steps + 1
            if bad_steps >= MAX_BAD_STEPS:
                raise RuntimeError(f"{bad_steps} optimizer steps in a row had a non-finite loss or gradient; "
                                   f"lower --learning_rate or check the data. Last good checkpoint: {checkpoint}.")
    return bad_steps


def _optimizer_step(args, m: Models, exp: Experience, rows: list[int], train: _Means, epoch: int, learn: bool) -> bool:
    """The microbatches of the train batch `rows`, gradient clipping and the step (of the policy when
    `learn`, of the critic when there is one). False if the step was skipped.

    The loss weights are computed once, from the train batch's counts over every rank (see
    distributed.per_rank_counts), and every rank runs as many microbatches as the busiest one, the extra
    ones on a masked dummy row, so the sharded policy's collectives line up."""
    policy_weights, value_weights = exp.loss_weights(rows, args.loss_agg_mode, args.sampling_max_tokens)
    loss_options = dict(loss_type=args.loss_type, cliprange=args.cliprange, cliprange_high=args.cliprange_high,
                        kl_coef=0.0 if args.kl_in_reward else args.kl_coef,  # in the reward it shaped the advantages
                        kl_estimator=args.kl_estimator, entropy_coef=args.entropy_coef)
    device, sharded = next(m.policy.parameters()).device, distributed.launched()
    losses, budget, size = [], microbatch_tokens(args, device), args.train_mini_batch_size

    def split(some: list[int]) -> list[list[int]]:
        return exp.token_microbatches(some, budget) if budget else [some[i:i + size] for i in range(0, len(some), size)]
    # on CPU, where the train phase is FLOPs (on a GPU launches: a no-grad microbatch more would cost more than the
    # backward it saves; FSDP2: every rank runs backward)
    silent = set(silent_rows(args, exp, rows)) if learn and not sharded and device.type == "cpu" else set()
    loud = [i for i in rows if i not in silent]
    parts = distributed.evened(split(loud) + split([i for i in rows if i in silent]), sharded)
    # a prompt whose group spans microbatches runs once (FSDP: one whole-model call per microbatch instead)
    shared = None if sharded else SharedPrompts([[exp.rows[i].prompt_ids for i in part] for part in parts])
    for part in parts:
        if not part:  # this rank is out of rows: a dummy forward and backward that changes nothing
            (rollout_log_probs(m.policy, [[0]], [[0]], one_forward=True)["log_probs"].sum() * 0).backward()
            continue
        mb = exp.microbatch(part, device)
        # every number logged below stays on the device, weighted by its tokens: _Means reads them once a step
        tokens = mb.mask.sum()
        per_token = 1 / tokens.clamp(min=1)
        if m.critic is not None:  # PPO's value loss, token-mean over the train batch (clipped, eq. 9)
            values = rollout_values(m.critic, mb.prompts, mb.responses)
            value_loss, value_meta = compute_value_loss(values, mb.old_values, mb.returns, mb.mask, args.cliprange_value)
            (weighted_sum(value_loss, mb.mask, to_device(value_weights[part], values.device))
             * args.value_loss_coef).backward()
            train.add("value_loss", torch.where(mb.mask.bool(), value_loss.detach(), 0.0).sum() * per_token, tokens)
            train.add("value_clip_fraction", value_meta["clipped"].float().sum() * per_token, tokens)
        grad = learn and not silent.issuperset(part)
        with torch.set_grad_enabled(grad):  # during the critic warm-up the policy's forward only logs
            out = rollout_log_probs(m.policy, mb.prompts, mb.responses, return_token_entropy=True, one_forward=sharded,
                                    temperature=args.sampling_temperature, entropy_grad=bool(args.entropy_coef),
                                    shared=shared)
        log_probs = out["log_probs"]  # (B, T)
        # on-policy the old policy is the current one: the ratio is 1, only its gradient matters
        old = log_probs.detach() if mb.old_log_probs is None else mb.old_log_probs
        is_weights = _rollout_correction(args, old, mb, train, tokens)
        if learn and not grad and args.loss_type in CLIPPED_LOSSES:  # advantage 0: the clipped term is never smaller
            train.add("clip_fraction", 0.0, tokens)
        if grad:
            weights = to_device(policy_weights[part], device)
            loss, meta = policy_microbatch_train_step(log_probs, mb.mask, weights, mb.advantages, old,
                                                      ref_log_probs=mb.ref_log_probs, rollout_is_weights=is_weights,
                                                      token_entropy=out["token_entropy"], **loss_options)
            losses.append(loss)
            for key in ("clip_fraction", "kl"):
                if key in meta:
                    train.add(key, meta[key], tokens)
        if shared is not None:
            shared.done(mb.prompts)  # a prompt's last microbatch: its part of the gradient, sent through it
        train.add("entropy", (out["token_entropy"].detach() * mb.mask).sum() * per_token, tokens)
        if epoch == 0 and args.sampling_top_p == 1:  # the old policy is the learner's view of the sampler;
            # with top_p < 1 the sampler's log-probs are of the renormalised nucleus: not comparable
            difference, seen_tokens = sampler_mismatch(mb.sampler_log_probs, old, mb.mask, args.sampling_min_tokens)
            train.add("sampler_logprob_diff", difference / seen_tokens.clamp(min=1), seen_tokens)  # (none: weight 0)
    ok = True
    if m.critic is not None:
        ok = _clip_and_step(m.critic, m.critic_optimizer, args.max_grad_norm, train, "critic_grad_norm")
    if learn:
        ok = _clip_and_step(m.policy, m.optimizer, args.max_grad_norm, train, "grad_norm", losses) and ok
        if ok:
            train.add("loss", sum(losses))
    return ok


def silent_rows(args, exp: Experience, rows: list[int]) -> list[int]:
    """The rows of `rows` that add nothing to the policy's gradient: an advantage of 0 at every response token (a
    group whose answers all scored alike) with no entropy term in the loss and no reference model (whose KL is
    logged from the training forward, in the loss or in the reward). Their forward runs without
    autograd, for the logged entropy and mismatch only: the same gradient at a third of their cost. If every row is
    silent the first microbatch still runs backward, so that the optimizer steps on zero gradients as before (Adam's
    momentum moves the weights even then)."""
    if args.entropy_coef or args.kl_coef:
        return []
    advantages, mask = exp.advantages[rows], exp.mask[rows].bool()
    carries = ((advantages != 0) & mask).any(-1).tolist()  # (rows, 1) or (rows, T) against (rows, T); NaN carries
    found = [i for i, loud in zip(rows, carries) if not loud]
    return found if len(found) < len(rows) else found[1:]  # (see above: one row keeps the step's gradient)


def _rollout_correction(args, old: torch.Tensor, mb, train: _Means, tokens: torch.Tensor) -> torch.Tensor | None:
    """The rollout-correction weights of a microbatch (None with --rollout_is none), their metrics logged.
    The behaviour policy is the sampler, so its own log-prob of every sampled token is needed."""
    if args.rollout_is == "none":
        return None
    weights, metrics = compute_rollout_is_weights(old, mb.sampler_log_probs, mb.mask, args.rollout_is,
                                                  args.rollout_is_level, args.rollout_is_threshold,
                                                  mb.sequence_log_ratio, mb.sequence_tokens)
    for key, value in metrics.items():
        train.add(key, value, tokens)
    return weights


def _clip_and_step(model, optimizer, max_grad_norm: float, train: _Means, name: str, losses=()) -> bool:
    """Clip the gradient norm and step, or skip the step (and drop the gradient) when anything is non-finite
    (on any rank: every rank makes the same choice)."""
    grad_norm = distributed.grad_norm_and_clip(model, max_grad_norm)  # (on the device)
    numbers = torch.stack([grad_norm.float(), *(loss.float().to(grad_norm.device) for loss in losses)])
    if not distributed.global_min(bool(torch.isfinite(numbers).all())):  # the optimizer step's one host read
        tqdm.write(f"[train_rl] warning: non-finite loss or gradient ({name} {grad_norm.item()}); step skipped")
        optimizer.zero_grad(set_to_none=True)
        return False
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train.add(name, grad_norm)
    return True


def _log_line(m: dict, n_steps: int, critic_warmup_steps: int = 0) -> str:
    seconds = " ".join(f"{k[8:]} {v:.1f}s" for k, v in m.items() if k.startswith("seconds_"))
    part = lambda k: "absent" if m[k] is None or m[k] != m[k] else f"{m[k]:.2f}"  # noqa: E731 (a --reward_fn's: NaN)
    head = (f"step {m['step']}/{n_steps} | reward {m['reward']:.3f} | fmt {part('format_reward')} | "
            f"ans {part('answer_reward')} | len {m['response_tokens']:.0f} | "
            + (f"reward failures {m['reward_failures']:.0f} | " if m.get("reward_failures") else ""))
    if "loss" not in m:  # the policy's weights did not change: say why
        if m["step"] <= critic_warmup_steps:  # the critic trained, the policy waits
            why = f"critic warm-up, step {m['step']} of {critic_warmup_steps} (--critic_warmup_steps)"
        elif m.get("kept_traces", 1) == 0:
            why = f"no group kept in {m['sampling_rounds']:.0f} sampling round(s) (--max_sampling_rounds)"
        else:
            why = "every optimizer step was skipped (a non-finite loss or gradient)"
        value = f"value loss {m['value_loss']:.4f} | " if "value_loss" in m else ""
        return head + f"no policy update: {why} | {value}{seconds}"
    return head + (f"loss {m['loss']:.4f} | clip {m.get('clip_fraction', 0):.3f} | ent {m.get('entropy', float('nan')):.2f} | "
                   f"gnorm {m.get('grad_norm', float('nan')):.2f} | kl {m.get('kl', 0):.4f} | "
                   f"mismatch {m.get('sampler_logprob_diff', float('nan')):.1e} | is {m.get('rollout_is_weight_mean', 1):.3f} "
                   f"cut {m.get('rollout_is_clipped_fraction', 0):.3f} | {seconds}")


if __name__ == "__main__":
    cli(main, ARGS)
