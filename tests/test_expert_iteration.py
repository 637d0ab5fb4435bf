"""Expert iteration end to end on a tiny random model with a scripted reward: it trains on exactly the correct
samples (none: no update), writes metrics and checkpoints, resumes exactly, and refuses bad flags."""

import json
import math

import pytest
import torch

from alignment import expert_iteration, models, plot, train_rl
from alignment.args import EIArgs, parse
from alignment.errors import UserError
from tests.test_train_rl import Spy


def tiny_args(model_dir, out, **overrides) -> EIArgs:
    base = dict(model=model_dir, n_ei_steps=2, questions_per_step=2, group_size=4, sampling_max_tokens=6,
                batch_size=2, microbatch_size=1, eval_every=0, rg_size=40, lr=1e-3, output_dir=str(out),
                precision="fp32")
    args = EIArgs(**{**base, **overrides})
    args.check()
    return args


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def scripted(correct):
    """A reward whose answers are right when `correct(text)` says so; the format is always right."""
    def reward(text, ground_truth, *rest):
        right = float(correct(text))
        return {"format_reward": 1.0, "answer_reward": right, "reward": right}
    return reward


def same_weights(a_dir, b_dir) -> bool:
    a, b = models.load_model(str(a_dir)), models.load_model(str(b_dir))
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_expert_examples_are_the_correct_samples_in_order():
    marks = [(1, 1), (1, 0), (0, 1), (1, 1), (0, 0), (1, 0)]  # (format, answer); 2 questions x 3 answers
    samples = [{"prompt": f"q{i // 3}", "response": f"a{i}", "format_reward": f, "answer_reward": a, "reward": f * a}
               for i, (f, a) in enumerate(marks)]
    examples, counts = expert_iteration.expert_examples(samples, group_size=3)
    assert examples == [{"prompt": "q0", "response": "a0"}, {"prompt": "q1", "response": "a3"}]
    assert counts == {"questions": 2, "samples": 6, "correct_samples": 2, "solved_fraction": 1.0}
    _, counts = expert_iteration.expert_examples(samples[:3] + [{**s, "answer_reward": 0} for s in samples[3:]], 3)
    assert counts["correct_samples"] == 1 and counts["solved_fraction"] == 0.5


def test_no_correct_answer_means_no_update(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (scripted(lambda text: False), ()))
    step = Spy(expert_iteration.train_step)
    monkeypatch.setattr(expert_iteration, "train_step", step)
    expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", n_ei_steps=1))
    assert step.calls == [] and same_weights(tiny_model_dir, tmp_path / "run" / "checkpoint")
    [m] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert m["correct_samples"] == 0 and m["sft_steps"] == 0 and m["solved_fraction"] == 0 and m["samples"] == 8


def test_it_fine_tunes_on_exactly_the_correct_samples(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (scripted(lambda text: len(text) % 2), ()))
    step = Spy(expert_iteration.train_step)
    monkeypatch.setattr(expert_iteration, "train_step", step)
    expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", n_ei_steps=1, sft_epochs=2, log_rollouts=8))
    samples = read_jsonl(tmp_path / "run" / "rollouts.jsonl")  # all 8 sampled answers
    correct = sorted((s["prompt"], s["response"]) for s in samples if len(s["response"]) % 2)
    assert len(samples) == 8 and 0 < len(correct) < 8  # a known, proper subset
    trained = sorted((e["prompt"], e["response"]) for call in step.calls for e in call["batch"])
    assert trained == sorted(correct * 2)  # each correct sample once per epoch, nothing else
    assert len(step.calls) == 2 * math.ceil(len(correct) / 2)
    [m] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert m["correct_samples"] == len(correct) and m["sft_steps"] == len(step.calls) and math.isfinite(m["sft_loss"])
    assert not same_weights(tiny_model_dir, tmp_path / "run" / "checkpoint")


def test_two_steps_write_metrics_evaluations_a_checkpoint_and_a_plot(tiny_model_dir, tmp_path, parity):
    expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", eval_every=1, eval_limit=2, eval_max_tokens=3))
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    steps = [m for m in metrics if "samples" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert [m["step"] for m in metrics if "eval_count" in m] == [0, 1, 2]
    for key in ("questions", "correct_samples", "solved_fraction", "generated_tokens", "sft_loss", "seconds"):
        assert all(key in m for m in steps), key
    tokens = [round(m["response_tokens"] * m["samples"]) for m in steps]
    assert [m["generated_tokens"] for m in steps] == [tokens[0], tokens[0] + tokens[1]]  # cumulative
    assert (tmp_path / "run" / "checkpoint" / "trainer_state.pt").exists()
    assert not same_weights(tiny_model_dir, tmp_path / "run")
    assert plot.plot(tmp_path / "run").stat().st_size > 10_000
    evals = [m for m in metrics if "eval_count" in m]  # eval records carry the token count: plots against tokens
    assert [m["generated_tokens"] for m in evals] == [0, steps[0]["generated_tokens"], steps[1]["generated_tokens"]]
    assert plot.plot(tmp_path / "run", tmp_path / "tokens.png", x="generated_tokens").stat().st_size > 10_000


class Crash(Exception):
    pass


def test_resume_continues_exactly(tiny_model_dir, tmp_path, parity, monkeypatch):
    expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "whole", n_ei_steps=3))
    real_save = models.save_checkpoint

    def save_then_crash(*args, **kwargs):
        real_save(*args, **kwargs)
        raise Crash

    monkeypatch.setattr(models, "save_checkpoint", save_then_crash)
    with pytest.raises(Crash):  # right after the checkpoint of step 1
        expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "resumed", n_ei_steps=3))
    monkeypatch.setattr(models, "save_checkpoint", real_save)
    result = expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "resumed", n_ei_steps=3,
                                             resume=str(tmp_path / "resumed")))
    assert result["start_step"] == 1
    whole, resumed = (read_jsonl(tmp_path / run / "metrics.jsonl") for run in ("whole", "resumed"))
    for key in ("step", "generated_tokens", "correct_samples", "sft_loss"):
        assert [m[key] for m in resumed] == [m[key] for m in whole], key
    rollouts = [[(r["step"], r["response"]) for r in read_jsonl(tmp_path / run / "rollouts.jsonl")]
                for run in ("whole", "resumed")]
    assert rollouts[0] == rollouts[1]
    assert same_weights(tmp_path / "whole" / "checkpoint", tmp_path / "resumed" / "checkpoint")
    with pytest.raises(ValueError, match="these differ: --lr"):
        expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "resumed", n_ei_steps=4, lr=0.5,
                                        resume=str(tmp_path / "resumed")))


@pytest.mark.parametrize("argv,message", [
    (["--prompt", "tir"], "--prompt 'tir' is not one of r1_zero, question_only"),
    (["--batch_size", "6", "--microbatch_size", "4"], "multiple of --microbatch_size"),
    (["--questions_per_step", "0"], "--questions_per_step must be greater than 0"),
    (["--sft_epochs", "-1"], "--sft_epochs must be greater than 0"),
    (["--sampling_min_tokens", "200"], "--sampling_min_tokens 200 must be between 0"),
    (["--loss_type", "grpo_clip"], "--loss_type is a flag of alignment.train_rl"),
])
def test_bad_flags_end_in_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        parse(EIArgs, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and message in err, err


def test_a_bad_dataset_fails_before_any_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the data was checked")
    monkeypatch.setattr(models, "load_tokenizer", no_model)
    with pytest.raises(UserError, match="unknown dataset 'no_such_set'"):
        expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", dataset="no_such_set"))


def test_a_signal_stops_after_the_step_with_a_checkpoint(tiny_model_dir, tmp_path, parity, monkeypatch):
    import os
    import signal
    real = expert_iteration.fine_tune

    def interrupted(*args, **kwargs):  # Ctrl-C while step 1 fine-tunes
        os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    monkeypatch.setattr(expert_iteration, "fine_tune", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        expert_iteration.main(tiny_args(tiny_model_dir, tmp_path / "run", n_ei_steps=3, save_every=10))
    assert exit_info.value.code == 128 + signal.SIGINT
    assert torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 1
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1]


def test_a_step_never_draws_more_questions_than_the_task_has(tiny_model_dir, tmp_path):
    # before: 50 questions a step from 20 were drawn 2-3 times each and logged as "solved 0.00 of 50"
    args = tiny_args(tiny_model_dir, tmp_path / "ei", rg_size=20, questions_per_step=50, eval_limit=4)
    with pytest.raises(UserError, match=r"--questions_per_step 50 draws 50 questions a step, but .* has \d+ to "
                                        r"train on \(after the held-out ones\): lower it, or raise --rg_size"):
        train_rl.load_questions(args, log=lambda line: None, script="expert_iteration")


def test_a_rate_a_user_reward_does_not_return_is_said_absent_as_train_rl_says_it():
    """Issue 91: expert_iteration's step line printed `fmt nan` for a --reward_fn without format_reward, where
    train_rl prints `fmt absent`."""
    from alignment.expert_iteration import _rate
    from alignment.train_rl import _log_line
    assert _rate(math.nan) == "absent" and _rate(None) == "absent" and _rate(0.5) == "0.50"
    line = _log_line({"step": 1, "reward": 0.5, "format_reward": math.nan, "answer_reward": 0.5, "response_tokens": 9,
                      "loss": 0.1}, 2)
    assert "fmt absent" in line
