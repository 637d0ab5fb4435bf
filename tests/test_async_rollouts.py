"""One-step-off rollouts (--async_steps 1) on a tiny random model: which weights sampled each batch, the
ratios the loss sees, resume, and the combinations that are refused."""

import math

import pytest
import torch

from alignment import models, train_rl
from alignment.errors import UserError
from tests.conftest import parity_reward
from tests.test_train_rl import Crash, read_jsonl, tiny_args


@pytest.fixture
def own_sampler(monkeypatch):
    """The seed's layout on one CPU: the HF sampler holds its own copy of the weights on a second device
    ("cpu:1", which torch runs on the CPU), as it would on a GPU of its own."""
    real = models.assign_device_roles
    monkeypatch.setattr(train_rl.models, "assign_device_roles", lambda *a, **k: {**real(*a, **k), "sample": "cpu:1"})


def snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


def test_each_batch_is_sampled_by_the_weights_of_the_step_before(tiny_model_dir, tmp_path, parity, own_sampler,
                                                                  monkeypatch):
    sampled, at_start, is_inputs, recorded = {}, {}, [], {}
    real_collect, real_build, real_is = train_rl.collect_rollouts, train_rl.build_experience, train_rl.compute_rollout_is_weights

    def collect(args, step, drawn, rows, sampler, tokenizer, score, *rest):
        sampled[step] = snapshot(sampler.model)
        batch, drawn = real_collect(args, step, drawn, rows, sampler, tokenizer, score, *rest)
        recorded[step] = [row.sampler_logprobs for trace in batch.traces for row in trace]
        return batch, drawn

    def build(args, batch, policy, *rest):
        at_start[len(at_start)] = snapshot(policy)
        return real_build(args, batch, policy, *rest)

    def weights(old, sampler_log_probs, mask, *rest):
        is_inputs.append((old.clone(), sampler_log_probs.clone(), mask.clone()))
        return real_is(old, sampler_log_probs, mask, *rest)

    monkeypatch.setattr(train_rl, "collect_rollouts", collect)
    monkeypatch.setattr(train_rl, "build_experience", build)
    monkeypatch.setattr(train_rl, "silent_rows", lambda *a: [])  # one microbatch a step, its rows in order
    monkeypatch.setattr(train_rl, "compute_rollout_is_weights", weights)
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=3, async_steps=1, train_mini_batch_size=8))

    metrics = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert [m["policy_lag"] for m in metrics] == [0, 1, 1]
    assert sorted(sampled) == [0, 1, 2]
    assert same(sampled[0], at_start[0])
    for step in (1, 2):  # sampled by version step-1, trained on by version step
        assert same(sampled[step], at_start[step - 1]) and not same(sampled[step], at_start[step])

    # the behaviour log-probs in each step's correction are the ones the sampler recorded for that batch
    for step, (old, behaviour, mask) in enumerate(is_inputs):
        rows = [[x for x, m in zip(row, keep) if m] for row, keep in zip(behaviour.tolist(), mask.tolist())]
        assert rows == [pytest.approx(r, abs=0) for r in recorded[step]]
        gap = ((old - behaviour) * mask).abs().sum() / mask.sum()
        if step == 0:  # same weights: only float noise between the two forwards
            assert gap < 1e-4
        else:  # a policy version apart: the ratio the correction sees is real
            assert gap > 1e-3
    assert all(math.isfinite(m["rollout_is_weight_mean"]) for m in metrics)
    assert metrics[1]["rollout_is_weight_mean"] != pytest.approx(1.0, abs=1e-6)


def test_synchronous_steps_have_no_lag(tiny_model_dir, tmp_path, parity):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2))
    assert [m["policy_lag"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [0, 0]


def test_resume_trains_on_the_batch_that_was_in_flight(tiny_model_dir, tmp_path, parity, own_sampler, monkeypatch):
    whole = tiny_args(tiny_model_dir, tmp_path / "whole", n_steps=4, async_steps=1)
    train_rl.main(whole)

    calls = {"n": 0}

    def crash_in_step_3(text, ground_truth):  # step 3's batch is scored in the background during step 2
        calls["n"] += 1
        if calls["n"] > 2 * whole.rollout_batch_size:
            raise Crash()
        return parity_reward(text, ground_truth)

    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (crash_in_step_3, ()))
    with pytest.raises(Crash):  # raised in the loop when it waits for the batch
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "crashed", n_steps=4, async_steps=1))
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "crashed", n_steps=4, async_steps=1,
                            resume=str(tmp_path / "crashed")))

    def rollouts(run):
        return [(r["step"], r["prompt"], r["response"]) for r in read_jsonl(tmp_path / run / "rollouts.jsonl")]
    assert rollouts("crashed") == rollouts("whole")
    lags = [m["policy_lag"] for m in read_jsonl(tmp_path / "crashed" / "metrics.jsonl")]
    assert lags == [0, 1, 1, 1]
    a = models.load_model(str(tmp_path / "whole" / "checkpoint"))
    b = models.load_model(str(tmp_path / "crashed" / "checkpoint"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_dynamic_sampling_and_evaluation_run_one_step_ahead(tiny_model_dir, tmp_path, parity, own_sampler):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, async_steps=1, filter_low=0.0,
                            eval_every=1, eval_limit=2, eval_max_tokens=3))
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "eval_count" in m] == [0, 1, 2]
    assert [m["policy_lag"] for m in metrics if "loss" in m] == [0, 1]
    assert all(m["sampling_rounds"] >= 1 for m in metrics if "loss" in m)


def test_combinations_that_cannot_run_one_step_ahead_are_refused(tiny_model_dir, tmp_path, parity):
    with pytest.raises(UserError, match="the sampler needs weights of its own"):  # HF sharing the policy
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "shared", async_steps=1))
    with pytest.raises(ValueError, match="needs rollout correction"):
        tiny_args(tiny_model_dir, tmp_path / "none", async_steps=1, rollout_is="none")
    with pytest.raises(ValueError, match="--async_steps 2 is not one of 0, 1"):
        tiny_args(tiny_model_dir, tmp_path / "two", async_steps=2)
    with pytest.raises(UserError, match="not supported under torchrun"):
        train_rl._refuse_under_torchrun(tiny_args(tiny_model_dir, tmp_path / "dist", async_steps=1), "cpu")
