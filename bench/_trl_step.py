"""TRL's side of bench/rl_step.py: a few GRPOTrainer steps, one JSON line of timings per step on stdout.

Runs inside the benchmark's own TRL environment (never the project's), started by bench/rl_step.py with
one argument, a JSON object of settings. Imports only the project's grader (pure Python) so that both
sides score with the same reward function.
"""

import json
import sys
import time

import torch


def main(settings: dict):
    torch.set_num_threads(settings["threads"])
    sys.path.insert(0, settings["project_root"])
    if settings.get("keep_freed_memory"):  # the same allocator setting as our side's --keep_freed_memory
        from alignment import allocator
        allocator.keep_freed_memory()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from alignment.drgrpo_grader import r1_zero_reward_fn

    def reward(prompts, completions, answer, **_):
        return [r1_zero_reward_fn(text, truth)["reward"] for text, truth in zip(completions, answer)]

    max_tokens = settings["max_tokens"]
    config = GRPOConfig(
        output_dir=settings["output_dir"], use_cpu=not settings.get("cuda"), bf16=settings.get("bf16", False), fp16=False, report_to="none",
        save_strategy="no", eval_strategy="no", logging_steps=1, disable_tqdm=True, seed=settings["seed"],
        max_steps=settings["steps"], learning_rate=settings["learning_rate"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, adam_beta2=0.95, max_grad_norm=1.0,
        num_generations=settings["group_size"], max_completion_length=max_tokens,
        per_device_train_batch_size=settings["microbatch"],
        gradient_accumulation_steps=settings["group_size"] // settings["microbatch"],
        temperature=settings["temperature"], top_p=settings["top_p"], top_k=0,
        generation_kwargs={"min_new_tokens": max_tokens} if settings["force_length"] else None,
        beta=0.0, num_iterations=1, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        shuffle_dataset=False, log_completions=False, dataloader_num_workers=0)
    model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(settings["model"])
    rows = [{"prompt": settings["prompt"], "answer": settings["answer"]}] * max(settings["steps"], 1)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer)

    # Time generation alone and generation + scoring by wrapping the trainer's own methods; the step
    # itself is timed by a callback around each optimizer step.
    step = {"generate": 0.0, "generate_and_score": 0.0, "tokens": 0, "prompt_tokens": 0}
    generate_one_turn, generate_and_score = trainer._generate_single_turn, trainer._generate_and_score_completions

    def timed_generate(prompt_ids, *args, **kwargs):
        start = time.perf_counter()
        completion_ids, logprobs = generate_one_turn(prompt_ids, *args, **kwargs)
        step["generate"] += time.perf_counter() - start
        step["tokens"] += sum(len(c) for c in completion_ids)
        step["prompt_tokens"] = len(prompt_ids[0])
        return completion_ids, logprobs

    def timed_generate_and_score(*args, **kwargs):
        start = time.perf_counter()
        out = generate_and_score(*args, **kwargs)
        step["generate_and_score"] += time.perf_counter() - start
        return out

    trainer._generate_single_turn, trainer._generate_and_score_completions = timed_generate, timed_generate_and_score

    settle = torch.cuda.synchronize if settings.get("cuda") else (lambda: None)  # the clock after the GPU's queue

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            settle()
            step.update(generate=0.0, generate_and_score=0.0, tokens=0, start=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            settle()
            total = time.perf_counter() - step["start"]
            print(json.dumps({"total": total, "generate": step["generate"],
                              "score": step["generate_and_score"] - step["generate"],
                              "train": total - step["generate_and_score"], "tokens": step["tokens"],
                              "prompt_tokens": step["prompt_tokens"]}), flush=True)

    trainer.add_callback(StepTimer())
    trainer.train()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
