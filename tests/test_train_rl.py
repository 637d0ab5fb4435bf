"""The RL script end to end on a tiny random model, crash and resume, device roles and data order."""

import json

import pytest
import torch

from alignment import models, train_rl
from alignment.args import RLArgs, parse


def parity_reward(text, ground_truth, *rest):
    """A reward the tiny random model can earn: half its answers are 'right', so groups have spread."""
    return {"reward": float(len(text) % 2), "format_reward": 1.0, "answer_reward": float(len(text) % 2)}


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    monkeypatch.setattr(train_rl.tir, "tir_reward_fn", parity_reward)


def tiny_args(model_dir, out, **overrides) -> RLArgs:
    base = dict(model=model_dir, n_steps=2, group_size=4, rollout_batch_size=8, train_batch_size=8,
                train_mini_batch_size=4, sampling_max_tokens=6, eval_every=0, save_every=1, rg_size=40,
                learning_rate=1e-3, output_dir=str(out))
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
    a = models.load_model(str(tmp_path / "whole" / "checkpoint"))
    b = models.load_model(str(tmp_path / "crashed" / "checkpoint"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_resume_refuses_changed_flags(tiny_model_dir, tmp_path, parity):
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1))
    with pytest.raises(ValueError, match="these differ: learning_rate"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, learning_rate=0.5,
                                resume=str(tmp_path / "run")))


def test_questions_for_step_is_a_seeded_pass_over_the_data():
    rows = [{"question": str(i)} for i in range(10)]
    first_epoch = [q["question"] for s in range(5) for q in train_rl.questions_for_step(rows, s, 2, seed=0)]
    assert sorted(first_epoch) == sorted(r["question"] for r in rows)  # every question once per epoch
    assert train_rl.questions_for_step(rows, 7, 2, 0) == train_rl.questions_for_step(rows, 7, 2, 0)
    assert train_rl.questions_for_step(rows, 0, 5, 0) != train_rl.questions_for_step(rows, 0, 5, 1)


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
                                                    "eval": eval_}


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


def test_delethink_mode_trains_on_chunk_rows(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, rollout_mode="delethink", loss_agg_mode="trace-length",
                     delethink_chunk_size=4, delethink_carryover=2, delethink_keep_head=1, delethink_max_turns=3)
    train_rl.main(args)
    [step] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert torch.isfinite(torch.tensor(step["loss"])) and step["grad_norm"] > 0
    rollouts = read_jsonl(tmp_path / "run" / "rollouts.jsonl")
    assert all(r["rows"] == r["stats"]["chunks"] for r in rollouts) and any(r["rows"] > 1 for r in rollouts)


def test_tir_mode_runs_through_train_rl(tiny_model_dir, tmp_path, parity):
    args = tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1, rollout_mode="tir", prompt="tir")
    train_rl.main(args)
    [step] = [m for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m]
    assert torch.isfinite(torch.tensor(step["loss"])) and "code_use_rate" in step
    for line in open(tmp_path / "run" / "metrics.jsonl"):  # strict JSON: no NaN for empty-subset rates
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl"))
