"""Expert iteration: sample answers with the current model, keep the correct ones, fine-tune on them, repeat.

    uv run -m alignment.expert_iteration       # CPU default: 5 EI steps on train_rl's task, ~17 min on 2 idle cores (estimated)
    uv run -m alignment.expert_iteration --dataset gsm8k --questions_per_step 512 --group_size 8 \
        --sft_epochs 2 --sampling_max_tokens 1024 --n_ei_steps 5     # closer to the reference, on a GPU
    uv run -m alignment.expert_iteration --resume checkpoints/ei/<run>   # same flags + --resume after a crash

One EI step (CS336 assignment 5, Algorithm 2): draw `--questions_per_step` questions (D_b) from the
training stream; sample `--group_size` (G) answers to each with the current model at
`--sampling_temperature` (`experience.collect_rollouts`, the sampler and seeds train_rl uses); grade them
with train_rl's reward function; keep the answers whose format reward and answer reward are both 1 (with
r1_zero that is reward 1); fine-tune on those {prompt, answer} pairs for `--sft_epochs` epochs with the SFT
step of `alignment.sft` (`train_step`: minus the summed log-prob of the answer tokens and EOS, averaged
over the batch). Evaluation, the run folder, checkpoints and resume are `alignment.run.Run`'s, as in sft.py
and train_rl.py; `alignment.plot` draws the run.

Where it departs from the reference: each step's fine-tuning starts a fresh AdamW with its own warmup and
cosine decay (the reference calls its SFT procedure on each step's data and leaves this open), so a
checkpoint between steps holds no optimizer state; answers are re-tokenised from their text, as SFT data
is, rather than trained on the sampled token ids; the CPU defaults are far smaller (64 questions x 4 answers
of up to 128 tokens per step instead of 512-2048 questions and 1024 tokens); and it runs in one process.
A step with no correct answer leaves the model as it was.
"""

import math
import random
import time

from alignment.args import EIArgs, parse

if __name__ == "__main__":  # the flags before torch loads: --help and a bad flag answer in 0.1 s, not 9
    ARGS = parse(EIArgs)

import torch
from tqdm.auto import tqdm

from alignment import allocator, distributed, models, user_reward
from alignment.errors import UserError, cli
from alignment.evaluate import check_context, evaluate, summary_line
from alignment.experience import collect_rollouts
from alignment.run import Run
from alignment.samplers import make_sampler, pick_backend
from alignment.sampling import SamplingParams, WeightPush, derive_seed
from alignment.sft import batch_indices, lr_factor, train_step
from alignment.train_rl import check_eval_reward, check_reward, load_questions, make_scorer, start_model

RESUMABLE_CHANGES = {"n_ei_steps"}  # flags a resumed run may change, besides the run folder's own (run.py)


def is_correct(sample: dict) -> bool:
    """An expert answer: the grader gives it full format and answer reward (a --reward_fn's: full marks on each part
    it reports, or reward 1 when it reports neither)."""
    parts = [sample.get(key) for key in ("format_reward", "answer_reward")]
    present = [part for part in parts if part is not None and part == part]  # (NaN != NaN: absent)
    return all(part == 1 for part in present) if present else sample["reward"] == 1


def expert_examples(samples: list[dict], group_size: int) -> tuple[list[dict], dict]:
    """The {prompt, response} pairs to fine-tune on (the correct samples, in order) and the step's counts:
    questions, samples, correct samples, and the share of questions with at least one correct answer.
    `samples` come in consecutive groups of `group_size` answers to one question."""
    correct = [is_correct(s) for s in samples]
    groups = [correct[i:i + group_size] for i in range(0, len(correct), group_size)]
    examples = [{"prompt": s["prompt"], "response": s["response"]} for s, ok in zip(samples, correct) if ok]
    return examples, {"questions": len(groups), "samples": len(samples), "correct_samples": len(examples),
                      "solved_fraction": sum(map(any, groups)) / max(len(groups), 1)}


def fine_tune(model, tokenizer, examples: list[dict], args: EIArgs, step: int, device: str, autocast) -> dict:
    """SFT on `examples` for `args.sft_epochs` epochs: a fresh AdamW, linear warmup then cosine decay, batches
    of `args.batch_size` in a seeded order (a short last batch is kept). Returns the mean SFT loss per
    answer token of the first and the last optimizer step, and how many steps ran (none without examples)."""
    if not examples:
        return {"sft_steps": 0}
    steps_per_epoch = math.ceil(len(examples) / args.batch_size)
    total_steps = steps_per_epoch * args.sft_epochs
    warmup_steps = max(1, round(args.warmup_ratio * total_steps))
    optimizer = models.adamw(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, warmup_steps, total_steps))
    order_seed = derive_seed(args.seed, step, "sft")  # this EI step's own data order
    model.train()
    records = []
    for sft_step in range(total_steps):
        batch = [examples[i] for i in batch_indices(sft_step, len(examples), args.batch_size, order_seed, drop_last=False)]
        records.append(train_step(model, tokenizer, optimizer, scheduler, batch, args, device, autocast))
    return {"sft_steps": total_steps, "sft_loss_first": records[0]["loss"], "sft_loss": records[-1]["loss"],
            "sft_grad_norm": sum(r["grad_norm"] for r in records) / total_steps}


@user_reward.closes_workers
def main(args: EIArgs) -> dict:
    args.check()
    allocator.apply(args.keep_freed_memory)  # each step reusing the last one's memory: faster, more resident
    if distributed.launched():
        raise UserError("expert iteration runs in one process: start it with `uv run -m alignment.expert_iteration`, "
                        "not torchrun.")
    run = Run(args, f"checkpoints/ei/ei-{time.strftime('%Y%m%d-%H%M%S')}", start_model(args), RESUMABLE_CHANGES)
    run.refuse_finished(args.n_ei_steps, "--n_ei_steps")
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    # Data first: a bad dataset fails before a minute of model loading.
    train_rows, eval_rows, eval_name = load_questions(args, run.say, "expert_iteration")

    # The policy on the device SFT would use; the sampler shares it (HF) or holds a copy pushed after each step.
    roles = models.assign_device_roles(models.available_devices())
    device = roles["policy"][0]
    dtype, autocast = models.train_precision(device, args.precision)
    tokenizer = models.load_tokenizer(run.weights)
    backend = pick_backend(args.backend, device)
    check_context(args.vllm_max_model_len if backend == "vllm" else None, tokenizer, train_rows + eval_rows,
                  args.prompt, args.chat_template, max(args.sampling_max_tokens, args.eval_max_tokens), run.weights,
                  prompt_file=args.prompt_file)
    score = make_scorer(args, train_rows + eval_rows)  # a bad --reward_fn is refused before the weights load
    user_reward.recall_returned(score, run.metrics() if run.start_step else [])  # (a resume reads as a run never stopped)
    model = models.load_policy_model(run.weights, roles["policy"], dtype)
    if device.startswith("cuda"):
        model.gradient_checkpointing_enable()
    sampler = make_sampler(backend, model, tokenizer, models.resolve_model(run.weights), device,
                           batch_size=args.sample_batch_size, seed=args.seed, decoding=args.hf_decoding,
                           **args.vllm_options())
    push = WeightPush(model)
    state = run.restore(model, None) or {}  # each step's fine-tuning starts a fresh optimizer: none to restore
    generated_tokens = state.get("generated_tokens", 0)  # cumulative: compares EI with RL at equal sampling work
    run.say(f"[expert_iteration] {args.n_ei_steps} steps of {args.questions_per_step} questions x {args.group_size} "
            f"answers on {args.dataset} from {run.weights}, {args.sft_epochs} SFT epoch(s) per step at lr {args.lr:g}; "
            f"policy on {', '.join(roles['policy'])}; sampler {backend}; precision "
            f"{models.resolve_precision(args.precision, device)} ({args.precision}); run folder {run.dir}")

    def run_eval(step: int):  # greedy, on the held-out questions, as train_rl evaluates
        push(sampler)
        model.eval()
        with autocast:
            summary, _ = evaluate(sampler, tokenizer, eval_rows, args.prompt,
                                  SamplingParams(temperature=0.0, max_tokens=args.eval_max_tokens), args.chat_template,
                                  progress=True, score=score, prompt_file=args.prompt_file)
        run.log({"step": step, "generated_tokens": generated_tokens, **{f"eval_{k}": v for k, v in summary.items()}})
        run.say(f"eval  {step}/{args.n_ei_steps} | {eval_name} x{summary['count']} | {summary_line(summary)}")
        check_eval_reward(args, run, score, summary, step, "expert_iteration")

    if args.eval_every and args.eval_before_train and run.start_step == 0:
        run_eval(0)
    bar = tqdm(range(run.start_step, args.n_ei_steps), desc="ei", unit="step", initial=run.start_step,
               total=args.n_ei_steps)
    with run.stop_on_signal():  # the first Ctrl-C or SIGTERM ends the run after this step, saved
        for step in bar:
            # 1. Sample G answers to each of the step's questions with the current model, and grade them.
            start = time.perf_counter()
            push(sampler)
            model.eval()
            with autocast:
                batch, _ = collect_rollouts(args, step, step * args.questions_per_step, train_rows, sampler,
                                            tokenizer, score)
            check_reward(args, run, score, batch, step, "expert_iteration")
            generated_tokens += int(batch.metrics["sampled_tokens"])
            sampled = time.perf_counter()

            # 2. Keep the correct answers and fine-tune on them.
            examples, counts = expert_examples(batch.samples, args.group_size)
            sft = fine_tune(model, tokenizer, examples, args, step, device, autocast)
            if sft["sft_steps"]:
                push.policy_changed()
            done = time.perf_counter()

            # 3. Log, evaluate, checkpoint.
            metrics = {"step": step + 1, **counts, "generated_tokens": generated_tokens,
                       "reward": batch.metrics["reward"], "format_reward": batch.metrics["format_reward"],
                       "answer_reward": batch.metrics["answer_reward"], "response_tokens": batch.metrics["response_tokens"],
                       **({"reward_failures": batch.metrics["reward_failures"]} if args.reward_fn else {}), **sft, "seconds_sample": sampled - start, "seconds_sft": done - sampled, "seconds": done - start}
            run.log(metrics)
            run.log_rollouts(step + 1, batch.samples[:args.log_rollouts])
            run.say(f"step {step + 1}/{args.n_ei_steps} | {counts['correct_samples']}/{counts['samples']} correct | "
                    f"solved {counts['solved_fraction']:.2f} of {counts['questions']} | fmt "
                    f"{_rate(metrics['format_reward'])} | len {metrics['response_tokens']:.0f} | sft "
                    f"{sft.get('sft_loss_first', math.nan):.3f} -> {sft.get('sft_loss', math.nan):.3f} in "
                    f"{sft['sft_steps']} steps | tokens {generated_tokens} | sample {sampled - start:.0f}s sft "
                    f"{done - sampled:.0f}s" + (f" | reward failures {metrics['reward_failures']:.0f}"
                                                 if metrics.get("reward_failures") else ""))
            if args.eval_every and ((step + 1) % args.eval_every == 0 or step + 1 == args.n_ei_steps):
                run_eval(step + 1)
            stop = run.stop_requested()  # Ctrl-C or SIGTERM: checkpoint this step, then end
            if stop or (step + 1) % args.save_every == 0 or step + 1 == args.n_ei_steps:
                run.save(step + 1, model, tokenizer, None, {"generated_tokens": generated_tokens})
            if stop:
                run.stopped(step + 1)
    bar.close()
    return {"run_dir": str(run.dir), "start_step": run.start_step, "last_metrics": run.metrics()[-1:]}


def _rate(value) -> str:
    """A rate for the step line; a --reward_fn that returns no format_reward leaves it absent (NaN), said as
    train_rl says it, not as `nan`."""
    return "absent" if value is None or value != value else f"{value:.2f}"


if __name__ == "__main__":
    cli(main, ARGS)
