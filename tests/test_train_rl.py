"""The RL script end to end on a tiny random model, crash and resume, device roles and data order."""

import inspect
import json
import math
import re

import pytest
import torch

from alignment import experience, models, train_rl
from alignment.evaluate import CPU_DEFAULT_LIMIT
from alignment.args import DEFAULT_RL_TASK, EvalArgs, RLArgs, SFTArgs, parse
from alignment.errors import UserError, cli
from tests.conftest import parity_reward


def tiny_args(model_dir, out, **overrides) -> RLArgs:
    base = dict(model=model_dir, n_steps=2, group_size=4, rollout_batch_size=8, train_batch_size=8,
                train_mini_batch_size=4, sampling_max_tokens=6, eval_every=0, save_every=1, rg_size=40,
                learning_rate=1e-3, output_dir=str(out), precision="fp32")  # the same numbers on any CPU
    args = RLArgs(**{**base, **overrides})
    args.check()
    return args


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


@pytest.mark.parametrize("loss_type,extra", [("no_baseline", {}), ("reinforce_with_baseline", {}),
                                             ("grpo_clip", {"train_batch_size": 4, "epochs_per_rollout_batch": 2})])
def test_two_steps_change_the_policy(tiny_model_dir, tmp_path, parity, loss_type, extra):
    args = tiny_args(tiny_model_dir, tmp_path / "run", loss_type=loss_type, **extra)
    train_rl.main(args)
    steps = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(torch.isfinite(torch.tensor(m["loss"])) and m["grad_norm"] > 0 for m in steps)
    before, after = models.load_model(tiny_model_dir), models.load_model(str(tmp_path / "run" / "checkpoint"))
    changed = [n for (n, p), q in zip(before.named_parameters(), after.parameters()) if not torch.equal(p, q)]
    assert changed, "no parameter moved"
    assert len(read_jsonl(tmp_path / "run" / "rollouts.jsonl")) == 2 * args.log_rollouts
    if loss_type == "grpo_clip":  # second optimizer step of each epoch is off-policy: ratios move
        assert all("clip_fraction" in m for m in steps)


def test_periodic_evaluation_and_kl_reference(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, eval_every=1, eval_limit=2, eval_max_tokens=3,
                     kl_coef=0.1, loss_type="reinforce_with_baseline")
    train_rl.main(args)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "eval_count" in m] == [0, 1]
    assert "kl" in metrics[1] and metrics[1]["kl"] >= 0


def test_no_eval_before_train_skips_only_the_start_evaluation(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, eval_every=1, eval_limit=2, eval_max_tokens=3,
                     eval_before_train=False)
    train_rl.main(args)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "eval_count" in m] == [1, 2]


class Crash(Exception):
    pass


def test_resume_after_a_crash_replays_the_same_questions_and_weights(tiny_model_dir, tmp_path, parity, monkeypatch):
    whole = tiny_args(tiny_model_dir, tmp_path / "whole", n_steps=3)
    train_rl.main(whole)

    calls = {"n": 0}

    def crash_in_step_3(text, ground_truth):
        calls["n"] += 1
        if calls["n"] > 2 * whole.rollout_batch_size:  # scoring of the third step
            raise Crash()
        return parity_reward(text, ground_truth)

    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (crash_in_step_3, ()))
    crashed = tiny_args(tiny_model_dir, tmp_path / "crashed", n_steps=3)
    with pytest.raises(Crash):
        train_rl.main(crashed)
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "crashed", n_steps=3, resume=str(tmp_path / "crashed")))

    def prompts(run):
        return [(r["step"], r["prompt"]) for r in read_jsonl(tmp_path / run / "rollouts.jsonl")]
    assert prompts("crashed") == prompts("whole")
    assert [m["step"] for m in read_jsonl(tmp_path / "crashed" / "metrics.jsonl")] == [1, 2, 3]

    def generated(run):  # cumulative over the run, across the resume too
        return [m["generated_tokens"] for m in read_jsonl(tmp_path / run / "metrics.jsonl")]
    steps = read_jsonl(tmp_path / "whole" / "metrics.jsonl")
    per_step = [round(m["response_tokens"] * whole.rollout_batch_size) for m in steps]
    assert generated("crashed") == generated("whole") == [sum(per_step[:i + 1]) for i in range(3)]
    a = models.load_model(str(tmp_path / "whole" / "checkpoint"))
    b = models.load_model(str(tmp_path / "crashed" / "checkpoint"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_resume_refuses_changed_flags(tiny_model_dir, tmp_path, parity):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1))
    with pytest.raises(ValueError, match="these differ: --learning_rate"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, learning_rate=0.5,
                                resume=str(tmp_path / "run")))
    # the flag the user typed comes first; what it implied is named as such (it once led with the latter)
    args = parse(RLArgs, ["--resume", str(tmp_path / "run"), "--n_steps", "2", "--loss_type", "no_baseline"])
    with pytest.raises(ValueError, match=r"these differ: --loss_type no_baseline \(the run's: grpo_clip\) \(and, "
                                         r"implied by them, --advantage_estimator none \(the run's: grpo\)\)"):
        train_rl.main(args)


def test_questions_at_is_a_seeded_pass_over_the_data():
    rows = [{"question": str(i)} for i in range(10)]
    first_epoch = [q["question"] for s in range(5) for q in experience.questions_at(rows, 2 * s, 2, seed=0)]
    assert sorted(first_epoch) == sorted(r["question"] for r in rows)  # every question once per epoch
    assert experience.questions_at(rows, 14, 2, 0) == experience.questions_at(rows, 14, 2, 0)
    assert experience.questions_at(rows, 0, 5, 0) != experience.questions_at(rows, 0, 5, 1)
    assert experience.questions_at(rows, 3, 4, 0) == experience.questions_at(rows, 0, 7, 0)[3:]


def gpus(n):
    return [f"cuda:{i}" for i in range(n)] + ["cpu"]


@pytest.mark.parametrize("n,policy,sample,reference,eval_", [
    (0, ["cpu"], "cpu", "cpu", "cpu"),
    (1, ["cuda:0"], "cuda:0", "cuda:0", "cuda:0"),
    (2, ["cuda:0"], "cuda:1", "cuda:1", "cuda:1"),
    (4, ["cuda:0"], "cuda:1", "cuda:2", "cuda:3"),
    (8, [f"cuda:{i}" for i in range(5)], "cuda:5", "cuda:6", "cuda:7"),
])
def test_device_roles(n, policy, sample, reference, eval_):
    assert models.assign_device_roles(gpus(n)) == {"policy": policy, "sample": sample, "reference": reference,
                                                    "eval": eval_, "critic": reference}
    if n >= 4:  # a critic given its own GPU takes it from the policy
        roles = models.assign_device_roles(gpus(n), critic=policy[-1])
        assert roles["critic"] == policy[-1] and roles["policy"] == (policy[:-1] or [policy[-1]])


def test_explicit_roles_and_missing_devices():
    roles = models.assign_device_roles(gpus(4), sample="cuda:0")
    assert roles["sample"] == "cuda:0" and roles["policy"] == ["cuda:1"]
    with pytest.raises(ValueError, match="--eval_device 'cuda:9' does not exist here; available: cuda:0, cuda:1"):
        models.assign_device_roles(gpus(2), eval="cuda:9")


@pytest.mark.parametrize("layers,devices", [(30, ["cuda:0"]), (30, ["cuda:0", "cuda:1"]), (28, gpus(5)[:5]),
                                            (7, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"])])
def test_partition_layers_in_even_contiguous_blocks(layers, devices):
    device_map = models.partition_layers(layers, devices)
    assert device_map["model.embed_tokens"] == device_map["lm_head"] == device_map["model.norm"] == devices[0]
    placed = [device_map[f"model.layers.{i}"] for i in range(layers)]
    blocks = [d for i, d in enumerate(placed) if i == 0 or placed[i - 1] != d]
    assert blocks == (devices[1:] or devices)  # contiguous, in order, every remaining device used
    sizes = [placed.count(d) for d in blocks]
    assert max(sizes) - min(sizes) <= 1


def test_flag_checks_say_what_to_change(capsys):
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--loss_type", "no_baseline", "--epochs_per_rollout_batch", "2"])
    assert "must stay on-policy" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--rollout_batch_size", "30", "--group_size", "4"])
    assert "multiple of --group_size" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--rollout_mode", "delethink"])
    assert "trace-length" in capsys.readouterr().err


def test_plot_draws_the_run(tiny_model_dir, tmp_path, parity):
    from alignment import plot
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1))
    out = plot.plot(tmp_path / "run")
    assert out.exists() and out.stat().st_size > 10_000 and out.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(FileNotFoundError, match="metrics.jsonl does not exist"):
        plot.plot(tmp_path / "nothing")
    both = plot.plot([tmp_path / "run", tmp_path / "run"], tmp_path / "both.png")
    assert both.stat().st_size > 10_000


def test_delethink_mode_trains_on_chunk_rows(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, rollout_mode="delethink", loss_agg_mode="trace-length",
                     delethink_chunk_size=4, delethink_carryover=2, delethink_keep_head=1, delethink_max_turns=3)
    train_rl.main(args)
    [step] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert torch.isfinite(torch.tensor(step["loss"])) and step["grad_norm"] > 0
    rollouts = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert all(r["rows"] == r["stats"]["chunks"] for r in rollouts) and any(r["rows"] > 1 for r in rollouts)
    # the cost counters the Delethink demo reads: a trace's query-key pairs over all its rows are more than those
    # of its longest row alone once some trace has several rows (x(x+1)/2 is convex: a mean of sums >= that of
    # the mean longest row), and no row is longer than the longest prompt + one chunk
    from transformers import AutoTokenizer
    longest_prompt = max(len(AutoTokenizer.from_pretrained(tiny_model_dir)(r["prompt"]).input_ids) for r in rollouts)
    assert step["context_tokens"] <= longest_prompt + 4
    assert step["attention_pairs"] > step["context_tokens"] * (step["context_tokens"] + 1) / 2


def test_tir_mode_runs_through_train_rl(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, rollout_mode="tir", prompt="tir")
    train_rl.main(args)
    [step] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert torch.isfinite(torch.tensor(step["loss"])) and "code_use_rate" in step
    for line in open(tmp_path / "run" / "metrics.jsonl"):  # strict JSON: no NaN for empty-subset rates
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))


# ---- the RL loop's correctness ----------------------------------------------------------------------

def test_trained_models_keep_fp32_master_weights_on_gpu(monkeypatch):
    import contextlib
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available" when autocast is built on a CPU machine
        dtype, autocast = models.train_precision("cuda:0")
        assert dtype == torch.float32 and autocast.device == "cuda" and autocast.fast_dtype == torch.bfloat16
        assert models.train_precision("cuda:1", bf16_weights=True)[0] == torch.bfloat16
        loaded = []
        monkeypatch.setattr(models, "load_model", lambda name, device, dtype=None, device_map=None: loaded.append(dtype))
        monkeypatch.setattr(models, "check_output_head", lambda model: None)  # no model was loaded to check
        models.load_policy_model("any", ["cuda:0"])  # the policy's default is the training dtype, not bf16
        assert loaded == [torch.float32]
    dtype, autocast = models.train_precision("cpu", "fp32", bf16_weights=True)
    assert dtype == torch.float32 and isinstance(autocast, contextlib.nullcontext)


class Spy:
    """Wraps a function, recording each call's arguments by name (defaults filled in) and its "result"."""

    def __init__(self, fn):
        self.fn, self.calls, self.signature = fn, [], inspect.signature(fn)

    def __call__(self, *args, **kwargs):
        result = self.fn(*args, **kwargs)
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        self.calls.append({**bound.arguments, "result": result})
        return result


def plain_log_probs(model, prompt, response, temperature):
    """log_softmax(logits / T) of one plain forward over prompt + response, at the response tokens."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_every_log_prob_the_loss_sees_is_of_the_sampled_temperature(tiny_model_dir, tmp_path, parity, monkeypatch):
    log_probs, step = Spy(train_rl.rollout_log_probs), Spy(train_rl.policy_microbatch_train_step)
    monkeypatch.setattr(train_rl, "rollout_log_probs", log_probs)
    monkeypatch.setattr(train_rl, "policy_microbatch_train_step", step)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, sampling_temperature=0.7, kl_coef=0.1))
    start = models.load_model(tiny_model_dir)  # on-policy step 1: policy = old = reference = the start
    policy_calls = [c for c in log_probs.calls if c["return_token_entropy"]]
    assert len(policy_calls) == len(step.calls) == 2
    for scored, loss in zip(policy_calls, step.calls):
        seen = {"policy": loss["policy_log_probs"], "old": loss["old_log_probs"], "reference": loss["ref_log_probs"]}
        for row, (prompt, response) in enumerate(zip(scored["prompts"], scored["responses"])):
            expected = plain_log_probs(start, prompt, response, 0.7)
            for name, tensor in seen.items():
                torch.testing.assert_close(tensor[row, :len(response)].detach(), expected, atol=1e-4, rtol=0,
                                           msg=f"{name} log-probs are not log_softmax(logits / 0.7)")


def test_resume_keeps_the_kl_reference_at_the_starting_model(tiny_model_dir, tmp_path, parity, monkeypatch):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, kl_coef=0.1))
    spy = Spy(train_rl.build_experience)
    monkeypatch.setattr(train_rl, "build_experience", spy)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, kl_coef=0.1, resume=str(tmp_path / "run")))
    reference = spy.calls[0]["reference"]
    start, resumed_from = models.load_model(tiny_model_dir), models.load_model(str(tmp_path / "run" / "checkpoint"))
    assert any(not torch.equal(p, q) for p, q in zip(start.parameters(), resumed_from.parameters()))
    for (name, p), q in zip(start.named_parameters(), reference.parameters()):
        assert torch.equal(p, q), f"the reference moved off the starting model at {name}"


def plus_minus_one_by_sample(pattern):
    """A ToRL-style +1/-1 reward that is right for sample k of a group when pattern(call, k) says so."""
    calls = {"n": 0}

    def reward(row, truth):
        calls["n"] += 1
        right = pattern(calls["n"], row.trace_id % 4)
        return {"format_reward": 1.0, "answer_reward": float(right), "reward": 1.0 if right else -1.0}
    return reward


def test_dynamic_sampling_filters_on_accuracy_and_refills_the_batch(tiny_model_dir, tmp_path, monkeypatch):
    # Round 1 of each step: every answer wrong (reward -1, no signal). Later rounds: accuracy 0.5 per
    # group (mean reward 0, which a filter on raw rewards with low = 0.2 would drop).
    pattern = lambda call, k: (call - 1) % 16 >= 8 and k < 2  # noqa: E731  8 traces per round, 2 rounds a step
    monkeypatch.setattr(train_rl, "make_scorer", lambda args, rows=(): plus_minus_one_by_sample(pattern))
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, filter_low=0.2, filter_high=0.8)
    train_rl.main(args)
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["sampling_rounds"] == 2 and m["questions_sampled"] == 4 and m["kept_traces"] == 8
        assert m["grad_norm"] > 0
    prompts = [r["prompt"] for r in read_jsonl(tmp_path / "run" / "rollouts.jsonl")]
    assert len(prompts) == 2 * args.log_rollouts


def test_a_step_whose_filters_keep_no_group_says_it_made_no_update(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(train_rl, "make_scorer", lambda args, rows=(): plus_minus_one_by_sample(lambda call, k: False))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, filter_low=0.2, max_sampling_rounds=2))
    [m] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert m["kept_traces"] == 0 and m["sampling_rounds"] == 2 and "loss" not in m and "grad_norm" not in m
    out = capsys.readouterr().out
    assert "no policy update: no group kept in 2 sampling round(s)" in out and "nan" not in out


def test_trace_length_normaliser_and_logged_means_count_only_trained_tokens(tiny_model_dir, tmp_path, parity, monkeypatch):
    standard = experience.ROLLOUT_MODES["standard"]

    def with_forced_tokens(*args, **kwargs):  # every row's second token is forced (loss mask 0), as tool output
        rows = standard(*args, **kwargs)
        for row in rows:
            row.loss_mask = [0 if i == 1 else 1 for i in range(len(row.response_ids))]
        return rows
    monkeypatch.setitem(experience.ROLLOUT_MODES, "standard", with_forced_tokens)
    step = Spy(train_rl.policy_microbatch_train_step)
    monkeypatch.setattr(train_rl, "policy_microbatch_train_step", step)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, loss_agg_mode="trace-length", kl_coef=0.1,
                            train_mini_batch_size=2))
    kl_sum = tokens = 0
    for call in step.calls:  # one row per trace: the trace's length is its row's sampled tokens; 8 traces
        mask, (_, meta) = call["response_mask"], call["result"]
        torch.testing.assert_close(call["row_weights"], 1 / (mask.sum(-1).double() * 8))
        kl_sum, tokens = kl_sum + float(meta["kl"]) * mask.sum().item(), tokens + mask.sum().item()
    [logged] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert logged["kl"] == pytest.approx(kl_sum / tokens)  # weighted by tokens, not by microbatch


def test_off_policy_epochs_shuffle_the_minibatches(tiny_model_dir, tmp_path, parity, monkeypatch):
    spy = Spy(train_rl._optimizer_step)
    monkeypatch.setattr(train_rl, "_optimizer_step", spy)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, rollout_batch_size=16, train_batch_size=4,
                            epochs_per_rollout_batch=2))
    batches = [tuple(call["rows"]) for call in spy.calls]  # one row per trace here
    assert len(batches) == 8
    first, second = batches[:4], batches[4:]
    assert sorted(sum(first, ())) == sorted(sum(second, ())) == list(range(16))  # each epoch sees every trace
    assert first != second


def test_sampling_min_tokens_reaches_the_rollout_sampler(tiny_model_dir, tmp_path, parity, monkeypatch):
    seen = []
    standard = experience.ROLLOUT_MODES["standard"]

    def recording(sampler, tokenizer, prompt_ids, params, args):
        seen.append((params.min_tokens, params.max_tokens))
        return standard(sampler, tokenizer, prompt_ids, params, args)

    monkeypatch.setitem(experience.ROLLOUT_MODES, "standard", recording)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, sampling_min_tokens=5))
    assert seen == [(5, 6)]
    with pytest.raises(ValueError, match="--sampling_min_tokens 7 must be between 0 and --sampling_max_tokens"):
        tiny_args(tiny_model_dir, tmp_path / "bad", sampling_min_tokens=7)


def test_evaluation_questions_are_left_out_of_training(tiny_model_dir, tmp_path, capsys, monkeypatch):
    # sums of three one-digit numbers: about a thousand distinct questions, so the two splits share many (of two
    # one-digit numbers, a hundred: evaluate's 2,000 test rows hold all of them, and nothing is left to train on)
    task = DEFAULT_RL_TASK.replace("max_digits=2", "max_digits=1").replace("min_terms=2,max_terms=2", "min_terms=3,max_terms=3")
    args = tiny_args(tiny_model_dir, tmp_path / "run", dataset=task, eval_limit=50, rg_size=500)
    train, held_out, _ = train_rl.load_questions(args)
    asked = {row["question"] for row in held_out} | train_rl.data.test_twins(task)  # (rg questions: no case or spacing)
    assert len(held_out) == 50 and 0 < len(train) < 500 and not asked & {row["question"] for row in train}
    out = capsys.readouterr().out  # with --eval_every 0 (tiny_args), the line says why they are still held out
    first = int(re.search(r"(\d+) of 500 training questions are among the 50 evaluation questions", out).group(1))
    more = int(re.search(r"(\d+) more training questions are copies .* of questions in the test split of rg:", out).group(1))
    assert first > 0 and more > 0 and first + more == 500 - len(train)
    assert "--eval_limit 50); they are left out of training (no evaluation in this run, --eval_every 0" in out
    with pytest.raises(UserError, match="every training question of .* is also an evaluation question"):
        train_rl.load_questions(tiny_args(tiny_model_dir, tmp_path / "two", rg_size=500, eval_limit=50,
                                          dataset=DEFAULT_RL_TASK.replace("max_digits=2", "max_digits=1")))
    # a step never draws one question twice (the endless stream would, counting it as two)
    monkeypatch.setattr(train_rl.data, "test_twins", lambda *a, **k: set())  # (that one row may be a test question)
    with pytest.raises(UserError, match=r"--rollout_batch_size 8 / --group_size 4 draws 2 questions a step, but .* "
                                        r"has 1 to train on \(after the held-out ones\): lower it, or raise --rg_size"):
        train_rl.load_questions(tiny_args(tiny_model_dir, tmp_path / "one", rg_size=1, eval_limit=1,
                                          rollout_batch_size=8, group_size=4, train_batch_size=8))
    monkeypatch.setattr(train_rl.data, "load_dataset", lambda name, split, *a, **k: [{"question": "1 + 1", "answer": "2"}])
    with pytest.raises(UserError, match="every training question of .* is also an evaluation question"):
        train_rl.load_questions(args)


def test_no_seed_trains_on_what_a_later_evaluate_scores():
    """Issue 77: train_rl held out its own seed's test rows (`seed + i`) while evaluate scores seed 0's, so
    `--seed 1` and `--seed 2` trained on 1 and 2 of evaluate's default questions. The test split is now one set."""
    scored = {row["question"] for row in train_rl.data.load_dataset(DEFAULT_RL_TASK, "test")[:CPU_DEFAULT_LIMIT]}
    for seed in range(3):
        train, held_out, _ = train_rl.load_questions(RLArgs(seed=seed), log=lambda line: None)
        assert {row["question"] for row in held_out} <= scored
        assert not scored & {row["question"] for row in train}


def test_weights_are_pushed_once_per_policy_version():
    loads = []
    sampler = type("Sampler", (), {"load_weights": lambda self, state: loads.append(1)})()
    policy = torch.nn.Linear(2, 2)
    push = train_rl.WeightPush(policy)
    assert push(sampler) == 0.0 and loads == []  # loaded from the same weights
    push.policy_changed()
    push(sampler), push(sampler)  # the step's push, then evaluation right after it
    assert loads == [1]
    shared = type("Shared", (), {"model": policy, "load_weights": lambda self, state: loads.append(2)})()
    push.policy_changed()
    push(shared)
    assert loads == [1]


@pytest.mark.parametrize("argv,message", [
    (["--model", "nobody/no-such-model"], "could not be fetched from the Hugging Face hub"),
    (["--dataset", "no_such_set"], "unknown dataset 'no_such_set'"),
    (["--resume", "{tmp}/empty"], "empty: the folder holds no run of alignment.train_rl"),
    (["--dataset", "gsm8k", "--data_dir", "{tmp}/data"], "is not valid JSON"),
])
def test_user_errors_end_in_one_line(tiny_model_dir, tmp_path, monkeypatch, capsys, argv, message):
    import huggingface_hub.constants
    from alignment.errors import cli
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # no 60 s of retries
    (tmp_path / "empty").mkdir()
    (tmp_path / "data" / "gsm8k").mkdir(parents=True)
    for split in ("train", "test"):
        (tmp_path / "data" / "gsm8k" / f"{split}.jsonl").write_text('{"question": "1+1?", "answer": "#### 2"}\n{oops\n')
    argv = [a.format(tmp=tmp_path) for a in argv]
    if "--model" not in argv:
        argv += ["--model", tiny_model_dir]
    out = argv[argv.index("--resume") + 1] if "--resume" in argv else str(tmp_path / "run")  # a resume writes where it ran
    args = parse(RLArgs, argv + ["--output_dir", out, "--eval_every", "0"])
    with pytest.raises(SystemExit) as exit_:
        cli(train_rl.main, args)
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert exit_.value.code == 2 and "Traceback" not in err and last.startswith("error: ") and message in last, err


# ---- more estimators through the loop --------------------------------------------------------------

@pytest.mark.parametrize("overrides", [
    {"advantage_estimator": "rloo"},
    {"advantage_estimator": "reinforce_pp", "loss_type": "reinforce_with_baseline"},
    {"advantage_estimator": "reinforce_pp_baseline", "kl_coef": 0.05, "kl_in_reward": True, "kl_estimator": "k1"},
    {"advantage_estimator": "gae", "gamma": 0.99, "lam": 0.95},
    {"loss_type": "gspo", "train_batch_size": 4, "epochs_per_rollout_batch": 2},
    {"loss_type": "grpo_no_clip", "train_batch_size": 4, "epochs_per_rollout_batch": 2},  # off-policy: has a ratio
    {"entropy_coef": 0.01, "kl_coef": 0.05, "kl_estimator": "k2"},
])
def test_two_steps_with_each_estimator(tiny_model_dir, tmp_path, parity, overrides):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", **overrides))
    steps = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in steps] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["grad_norm"] > 0 for m in steps)
    if overrides.get("advantage_estimator") == "gae":
        assert all(math.isfinite(m["value_loss"]) and m["critic_grad_norm"] > 0 for m in steps)
        assert "explained_variance" in steps[0] and steps[0]["value_mean"] == 0.0  # the head starts at zero
        assert steps[1]["value_mean"] != 0.0
    if overrides.get("kl_in_reward"):
        assert all(m["kl_in_reward"] >= -1e-6 or overrides["kl_estimator"] == "k1" for m in steps)


def test_critic_warmup_trains_only_the_critic_and_resume_brings_the_critic_back(tiny_model_dir, tmp_path, parity,
                                                                               capsys):
    args = dict(advantage_estimator="gae", critic_warmup_steps=1, critic_learning_rate=1e-3)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, **args))
    step1, step2 = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert "grad_norm" not in step1 and step1["critic_grad_norm"] > 0  # warm-up: the policy did not move
    assert step2["grad_norm"] > 0 and step2["critic_grad_norm"] > 0
    out = capsys.readouterr().out
    assert "no policy update: critic warm-up, step 1 of 1 (--critic_warmup_steps) | value loss" in out
    assert "no group kept" not in out  # the step's true reason, not the filters' (it once said so)
    critic = models.load_critic(str(tmp_path / "run" / "checkpoint" / "critic"))
    assert critic.score.weight.abs().sum() > 0  # the trained head was saved and comes back
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["critic_optimizer"]["state"]
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=3, resume=str(tmp_path / "run"), **args))
    step3 = read_jsonl(tmp_path / "run" / "metrics.jsonl")[-1]
    assert step3["step"] == 3 and step3["grad_norm"] > 0 and step3["value_mean"] != 0.0


def test_a_critic_warmup_as_long_as_the_run_is_refused(capsys):
    for warmup in ("5", "6"):  # the policy would never train
        with pytest.raises(SystemExit):
            parse(RLArgs, ["--advantage_estimator", "gae", "--critic_warmup_steps", warmup, "--n_steps", "5"])
        assert "the policy would never train" in capsys.readouterr().err
    parse(RLArgs, ["--advantage_estimator", "gae", "--critic_warmup_steps", "4", "--n_steps", "5"])


def test_estimator_flag_checks(capsys):
    for argv, message in [(["--advantage_estimator", "gae", "--rollout_mode", "delethink", "--loss_agg_mode",
                            "trace-length"], "one row per trace"),
                          (["--loss_type", "gspo", "--advantage_estimator", "reinforce_pp"], "one advantage per trace"),
                          (["--kl_in_reward"], "--kl_in_reward has no effect with --kl_coef 0"),
                          (["--loss_type", "no_baseline", "--advantage_estimator", "rloo"], "trains on the raw reward"),
                          (["--kl_coef", "0.1", "--kl_estimator", "k1"], "zero-mean gradient"),
                          (["--kl_coef", "0.1", "--kl_in_reward", "--use_std_normalization"], "tiny std"),
                          (["--loss_type", "gspo", "--loss_agg_mode", "token-mean"], "per-row mean"),
                          (["--advantage_estimator", "ppo"], "is not one of grpo")]:
        with pytest.raises(SystemExit):
            parse(RLArgs, argv)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("cls", [RLArgs, EvalArgs, SFTArgs])
def test_help_prints_every_flag_as_written(cls, capsys):
    # argparse %-formats help text: a bare "%" in a help line used to dump the argument's dict instead
    with pytest.raises(SystemExit):
        parse(cls, ["--help"])
    out = capsys.readouterr().out
    assert "option_strings" not in out and "--output_dir" in out
    if cls is RLArgs:
        assert "gets 20% right" in " ".join(out.split())


def test_no_baseline_means_the_advantage_is_the_raw_reward():
    args = parse(RLArgs, ["--loss_type", "no_baseline"])
    assert args.advantage_estimator == "none"  # implied, not refused
    rewards, mask = torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.ones(5, 3)
    row_trace = torch.tensor([0, 1, 2, 3, 3])  # trace 3 spans two rows
    advantages, returns = experience.compute_advantages(args, rewards, mask, row_trace, None, None)
    torch.testing.assert_close(advantages, rewards[row_trace][:, None])
    assert returns is None
    # with the KL in the reward: each trace's reward minus its summed penalty, on every row of the trace
    args = parse(RLArgs, ["--loss_type", "no_baseline", "--kl_coef", "0.5", "--kl_in_reward", "--kl_estimator", "k1"])
    token_kl = torch.arange(15.0).reshape(5, 3) / 10
    advantages, _ = experience.compute_advantages(args, rewards, mask, row_trace, token_kl, None)
    penalty = torch.zeros(4).index_add(0, row_trace, token_kl.sum(-1)) * 0.5
    torch.testing.assert_close(advantages, (rewards - penalty)[row_trace][:, None])
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--loss_type", "no_baseline", "--advantage_estimator", "rloo"])


def test_an_experience_gives_each_microbatch_its_slice_and_each_train_batch_its_weights():
    from alignment.rollout import Rollout
    rows = [Rollout([1, 2], [5] * n, [1] * (n - 1) + [0], trace_id=t, group_id=0, text="", finish_reason="stop",
                    sampler_logprobs=[-0.5] * n) for t, n in ((0, 2), (1, 4), (1, 3))]
    width = 4
    mask = torch.zeros(3, width)
    for i, row in enumerate(rows):
        mask[i, :len(row.loss_mask)] = torch.tensor(row.loss_mask, dtype=torch.float32)
    per_token = torch.arange(12.0).reshape(3, 4)
    exp = experience.Experience(rows, torch.tensor([0, 1, 1]), mask, per_token, torch.full((3, width), -0.5),
                                old_log_probs=-per_token, metrics={})
    mb = exp.microbatch([0, 2], "cpu")
    assert mb.prompts == [[1, 2], [1, 2]] and [len(r) for r in mb.responses] == [2, 3]
    assert mb.mask.shape == (2, 3) and mb.ref_log_probs is None and mb.returns is None
    torch.testing.assert_close(mb.advantages, per_token[[0, 2], :3])
    torch.testing.assert_close(mb.old_log_probs, -per_token[[0, 2], :3])
    # trace-length: row 0's trace has 1 sampled token, rows 1-2 share a trace of 3 + 2 = 5; 2 traces
    policy, value = exp.loss_weights([0, 1, 2], "trace-length", max_response_length=8)
    torch.testing.assert_close(policy, torch.tensor([1 / 2, 1 / 10, 1 / 10], dtype=torch.float64))
    torch.testing.assert_close(value, torch.full((3,), 1 / 6, dtype=torch.float64))  # token-mean: 6 tokens
    policy, _ = exp.loss_weights([1, 2], "seq-mean-token-mean", max_response_length=8)
    torch.testing.assert_close(policy, torch.tensor([0, 1 / 6, 1 / 4], dtype=torch.float64))  # outside the batch: 0


def test_rollout_correction_weights_reach_the_gradient(tiny_model_dir, tmp_path, parity, monkeypatch):
    standard = experience.ROLLOUT_MODES["standard"]

    def sampler_off_by(shift):  # the sampler reports log-probs `shift` away from the learner's
        def rollouts(*args, **kwargs):
            rows = standard(*args, **kwargs)
            for row in rows:
                row.sampler_logprobs = [x + shift for x in row.sampler_logprobs]
            return rows
        return rollouts

    def first_step(name, **flags):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / name, n_steps=1, **flags))
        return read_jsonl(tmp_path / name / "metrics.jsonl")[0]

    monkeypatch.setitem(experience.ROLLOUT_MODES, "standard", sampler_off_by(-math.log(4)))  # ratio 4 everywhere
    plain = first_step("plain", rollout_is="none")
    truncated = first_step("truncated")  # the default: truncate at 2, per token
    masked = first_step("masked", rollout_is="mask")
    assert "rollout_is_weight_mean" not in plain
    assert truncated["rollout_is_weight_mean"] == pytest.approx(2.0) and truncated["rollout_is_clipped_fraction"] == 1
    assert truncated["grad_norm"] == pytest.approx(2 * plain["grad_norm"], rel=1e-4)  # on-policy: -A * w * grad logp
    assert masked["rollout_is_weight_mean"] == 0 and masked["grad_norm"] == 0
    monkeypatch.setitem(experience.ROLLOUT_MODES, "standard", sampler_off_by(math.log(1.5)))  # ratio 1/1.5: inside
    assert first_step("inside", rollout_is="mask")["rollout_is_clipped_fraction"] == 0

    def without_log_probs(*args, **kwargs):
        rows = standard(*args, **kwargs)
        for row in rows:
            row.sampler_logprobs = None
        return rows
    monkeypatch.setitem(experience.ROLLOUT_MODES, "standard", without_log_probs)
    with pytest.raises(UserError, match="needs the sampler's log-prob of every sampled token"):
        first_step("missing")
    assert "loss" in first_step("missing-off", rollout_is="none")


def test_a_bf16_run_keeps_fp32_master_weights_and_optimizer_state(tiny_model_dir, tmp_path, parity, monkeypatch):
    seen = []
    real_step = train_rl.policy_microbatch_train_step

    def recording(policy_log_probs, *args, **kwargs):
        seen.append(torch.is_autocast_enabled("cpu"))
        assert policy_log_probs.dtype == torch.float32  # log-softmax, loss and KL stay fp32
        return real_step(policy_log_probs, *args, **kwargs)
    monkeypatch.setattr(train_rl, "policy_microbatch_train_step", recording)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, precision="bf16", kl_coef=0.1,
                            kl_estimator="k2"))
    assert seen and all(seen)  # the forward and loss ran under bf16 autocast
    [step] = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert math.isfinite(step["loss"]) and step["grad_norm"] > 0 and 0 < step["rollout_is_weight_mean"] <= 2
    from safetensors import safe_open
    with safe_open(tmp_path / "run" / "checkpoint" / "model.safetensors", "pt") as saved:
        assert {saved.get_tensor(name).dtype for name in saved.keys()} == {torch.float32}  # as trained
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1
    import torch.distributed.checkpoint as dcp
    metadata = dcp.FileSystemReader(str(tmp_path / "run" / "checkpoint" / "optimizer")).read_metadata()
    dtypes = {m.properties.dtype for m in metadata.state_dict_metadata.values() if hasattr(m, "properties")}
    assert dtypes == {torch.float32}  # AdamW's moments in fp32 too


def test_a_stop_during_the_refill_gives_the_step_up_and_the_resumed_run_takes_the_same_steps(tiny_model_dir, tmp_path,
                                                                                            monkeypatch, capsys):
    """Dynamic sampling's extra rounds each print a line; a SIGTERM between rounds ends the step before any update
    (not after up to --max_sampling_rounds more rounds), saving the last finished step, and the resumed run ends
    with the weights of the uninterrupted one."""
    import signal
    # a group is right half the time where its question's answer is even, else never (filtered out): whether a
    # step needs a second round depends only on the questions drawn, the same after a resume
    right = lambda row, question: int(question["answer"]) % 2 == 0 and row.trace_id % 4 < 2  # noqa: E731
    scores = {"n": 0, "stop_at": None}

    def reward(row, truth):
        scores["n"] += 1
        if scores["n"] == scores["stop_at"]:
            signal.raise_signal(signal.SIGTERM)  # as `kill` would, while a round is scored
        ok = right(row, truth)
        return {"format_reward": 1.0, "answer_reward": float(ok), "reward": 1.0 if ok else -1.0}
    monkeypatch.setattr(train_rl, "make_scorer", lambda args, rows=(): reward)
    flags = dict(n_steps=3, filter_low=0.2, max_sampling_rounds=4, save_every=10)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "whole", **flags))
    rounds = [m["sampling_rounds"] for m in read_jsonl(tmp_path / "whole" / "metrics.jsonl")]
    out = capsys.readouterr().out
    assert "after sampling round 1; round 2 of at most 4 (--max_sampling_rounds) samples 2 more questions" in out
    later = next(s for s in range(1, 3) if rounds[s] > 1)  # a step after the first that refills
    scores["n"], scores["stop_at"] = 0, 8 * sum(rounds[:later]) + 1  # in that step's first round (8 traces a round)
    with pytest.raises(SystemExit) as stopped:
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "cut", **flags))
    assert stopped.value.code == 143
    out = capsys.readouterr().out
    assert f"stopped in step {later + 1}'s sampling round 1: the step is given up, before any update" in out
    assert [m["step"] for m in read_jsonl(tmp_path / "cut" / "metrics.jsonl")] == list(range(1, later + 1))
    scores["stop_at"] = None
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "cut", **flags, resume=str(tmp_path / "cut")))
    whole, cut = (models.load_model(str(tmp_path / r / "checkpoint")) for r in ("whole", "cut"))
    for (name, p), q in zip(whole.named_parameters(), cut.parameters()):
        assert torch.equal(p, q), f"the resumed run ended elsewhere at {name}"
    assert "--max_sampling_rounds 33 is not from 1 to 32" in str(pytest.raises(ValueError, tiny_args, tiny_model_dir,
                                                                              tmp_path / "x", max_sampling_rounds=33).value)


def test_a_group_spanning_microbatches_runs_its_prompt_once_and_takes_the_same_steps(tiny_model_dir, tmp_path,
                                                                                       parity, monkeypatch):
    """Microbatches of 2 rows, groups of 4: each prompt is in two microbatches and runs once per optimizer step
    (tokens.SharedPrompts); the losses, gradient norms and the policy after two steps are those of running it in
    each microbatch."""
    real, made = train_rl.SharedPrompts, []

    def sharing(share):
        def make(prompts_per_microbatch):
            made.append(real(prompts_per_microbatch if share else []))
            return made[-1]
        return make
    results = []
    for share in (False, True):
        monkeypatch.setattr(train_rl, "SharedPrompts", sharing(share))
        out = tmp_path / f"run-{share}"
        train_rl.main(tiny_args(tiny_model_dir, out, train_mini_batch_size=2))
        steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
        results.append((steps, models.load_model(str(out / "checkpoint"))))
    assert len(made[-1].prompts) == 2  # the last step's two groups, each in two microbatches
    (plain_steps, plain_model), (shared_steps, shared_model) = results
    assert len(plain_steps) == len(shared_steps) == 2
    for a, b in zip(plain_steps, shared_steps):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-7)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)
    # AdamW's first steps move each weight by about +-lr (1e-3 here) whatever the gradient's size, so a wrong
    # shared-prompt gradient moves many weights apart by ~1e-3; a weight whose gradient is near 0 turns fp32
    # rounding into up to ~1e-5 (one weight of 8,192 at 1.4e-5 on an AVX2 CPU, 2026-11-28): a tenth of a step
    for (name, p), q in zip(plain_model.named_parameters(), shared_model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-4, rtol=1e-5, msg=name)


def _saved_step(run_dir) -> int:
    return torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)["step"]


def test_a_full_disk_during_a_save_is_one_line_and_the_last_checkpoint_stays(tiny_model_dir, tmp_path, monkeypatch,
                                                                             capsys):
    import errno
    real_save, saves = models.torch.save, []

    def filling(obj, path, *rest, **kwargs):
        if saves:  # the second checkpoint: the disk fills while its optimizer state (DCP) is written
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, path, *rest, **kwargs)
        if str(path).endswith("trainer_state.pt"):  # the first checkpoint's last file
            saves.append(path)
    monkeypatch.setattr(models.torch, "save", filling)
    with pytest.raises(SystemExit) as stop:
        cli(train_rl.main, tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2))
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 1 and "Traceback" not in err and line.startswith("error: no space left on the device")
    assert _saved_step(tmp_path / "run") == 1 and not (tmp_path / "run" / "checkpoint.tmp").exists()


@pytest.mark.parametrize("after", ["log", "log_rollouts", "save"])  # the next write: a line, or the checkpoint
def test_a_run_folder_deleted_mid_run_is_one_line(after, tiny_model_dir, tmp_path, monkeypatch, capsys):
    import shutil
    from alignment.run import Run
    real = getattr(Run, after)

    def write_then_delete(self, *args, **kwargs):
        real(self, *args, **kwargs)
        shutil.rmtree(self.dir)  # someone removes the folder while the run writes it
    monkeypatch.setattr(Run, after, write_then_delete)
    with pytest.raises(SystemExit) as stop:
        cli(train_rl.main, tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2))
    err = capsys.readouterr().err
    [line] = [line for line in err.splitlines() if line.startswith("error:")]
    assert stop.value.code == 1 and "Traceback" not in err and "no longer exists" in line, err
    assert not (tmp_path / "run").exists()  # nothing made it again, half empty (the next steps once did)


def test_a_file_name_too_long_for_the_file_system_is_one_line(tiny_model_dir, tmp_path, capsys):
    from alignment import evaluate
    from alignment.args import EvalArgs
    long_name = tmp_path / ("x" * 300)
    with pytest.raises(SystemExit):
        cli(train_rl.main, tiny_args(tiny_model_dir, long_name, n_steps=1))
    with pytest.raises(SystemExit):
        cli(evaluate.main, EvalArgs(model=tiny_model_dir, dataset="rg:chain_sum", limit=2, output_dir=str(long_name)))
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 2 and "Traceback" not in err, err
    assert all("longer than the file system allows" in line for line in lines), lines


def test_a_resume_says_when_a_cut_off_line_leaves_a_gap_in_the_steps(tiny_model_dir, tmp_path, parity, capsys):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2))
    metrics = tmp_path / "run" / "metrics.jsonl"
    text = metrics.read_text()
    metrics.write_text(text[:len(text) - len(text.splitlines()[-1]) // 2 - 1])  # step 2's line, cut mid-write
    capsys.readouterr()
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=3, resume=str(tmp_path / "run")))
    assert "has no record after step 1, and the checkpoint is at step 2: the record of step 2 was lost" in \
        capsys.readouterr().out
    assert [m["step"] for m in read_jsonl(metrics)] == [1, 3]
    for kept in (6, 1):  # `{"ste` (too little left to name its step); the whole line gone
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / f"run{kept}", n_steps=2))
        metrics = tmp_path / f"run{kept}" / "metrics.jsonl"
        text = metrics.read_text()
        metrics.write_text(text[:text.rindex("\n", 0, -1) + kept])
        capsys.readouterr()
        train_rl.main(tiny_args(tiny_model_dir, metrics.parent, n_steps=3, resume=str(metrics.parent)))
        assert "the record of step 2 was lost" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["mixed", "then_silent"])
def test_rows_with_no_advantage_run_without_autograd_and_the_steps_are_the_same(tiny_model_dir, tmp_path, monkeypatch,
                                                                               case):
    """A group whose answers all scored alike has advantage 0 everywhere: its rows add nothing to the gradient, so
    their forward runs without autograd (logging only). Against every row through backward: the same losses,
    gradient norms, entropy, clip fraction and policy; a step with no signal at all still steps Adam (momentum)."""
    from tests.conftest import parity_reward
    real, seen = train_rl.silent_rows, []
    calls = []

    def reward(text, ground_truth, *rest):  # then_silent: step 1's 8 answers by parity, every later one 0
        calls.append(1)
        return parity_reward(text, ground_truth) if case == "mixed" or len(calls) <= 8 else \
            {"reward": 0.0, "format_reward": 1.0, "answer_reward": 0.0}
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (reward, ()))
    results = []
    for skip in (False, True):
        calls.clear()
        monkeypatch.setattr(train_rl, "silent_rows", (lambda *a: seen.append(real(*a)) or seen[-1]) if skip else
                            (lambda *a: []))
        out = tmp_path / f"run-{skip}"
        train_rl.main(tiny_args(tiny_model_dir, out, group_size=2, loss_type="grpo_clip", train_batch_size=4,
                                epochs_per_rollout_batch=2, train_mini_batch_size=2))
        steps = [m for m in read_jsonl(out / "metrics.jsonl") if "loss" in m]
        results.append((steps, models.load_model(str(out / "checkpoint"))))
    assert any(seen) and (case == "then_silent" or not all(len(s) == 3 for s in seen)), seen  # (3 of 4: all silent)
    (plain_steps, plain_model), (quiet_steps, quiet_model) = results
    assert len(plain_steps) == len(quiet_steps) == 2
    for a, b in zip(plain_steps, quiet_steps):
        for key in ("loss", "grad_norm", "entropy", "clip_fraction", "zero_std_groups"):
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    if case == "then_silent":
        assert plain_steps[1]["zero_std_groups"] == 1 and plain_steps[1]["grad_norm"] == 0
    for (name, p), q in zip(plain_model.named_parameters(), quiet_model.parameters()):  # (tolerance: see above)
        torch.testing.assert_close(q, p, atol=1e-4, rtol=1e-5, msg=name)
