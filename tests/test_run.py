"""The run bookkeeper shared by SFT and RL: run folder, config, metrics, checkpoints, resume rules."""

import json
import random
from dataclasses import dataclass

import pytest
import torch

from alignment import models
from alignment.args import RunArgs
from alignment.errors import MissingFileError, UserError
from alignment.run import Run


@dataclass
class Flags(RunArgs):
    lr: float = 0.1  # a flag a resumed run may not change
    n_steps: int = 3  # one it may (declared resumable below)


def open_run(folder, **flags) -> Run:
    return Run(Flags(output_dir=str(folder), **flags), "unused", "start-model", resumable={"n_steps"})


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_a_new_run_writes_its_config_and_metrics_as_strict_json(tmp_path):
    run = open_run(tmp_path / "run")
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {
        "output_dir": str(tmp_path / "run"), "resume": None, "overwrite": False, "logger": "none",
        "eval_before_train": True, "lr": 0.1,
        "n_steps": 3, "start_model": "start-model"}
    run.log({"step": 1, "loss": 0.5, "rate": float("nan")})
    run.log_rollouts(1, [{"prompt": "p", "response": "r"}])
    assert run.metrics() == [{"step": 1, "loss": 0.5, "rate": None}]
    assert read_jsonl(tmp_path / "run" / "rollouts.jsonl") == [{"step": 1, "prompt": "p", "response": "r"}]
    assert run.weights == "start-model" and run.start_step == 0 and run.restore(None, None) is None


def test_a_used_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    open_run(tmp_path / "run").log({"step": 1})
    with pytest.raises(UserError, match=f"{tmp_path / 'run'} already holds a run: continue it with --resume"):
        open_run(tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("a user's file")
    with pytest.raises(UserError, match="already holds a run"):
        open_run(tmp_path / "other")
    run = open_run(tmp_path / "run", overwrite=True)
    assert run.metrics() == [] and sorted(p.name for p in run.dir.iterdir()) == ["config.json"]
    with pytest.raises(ValueError, match="pass one of them"):
        Flags(resume="x", overwrite=True).check_run()


def test_resume_restores_state_and_refuses_changed_flags(tmp_path, tiny_model, tokenizer):
    run = open_run(tmp_path / "run")
    optimizer = torch.optim.AdamW(tiny_model.parameters(), lr=1e-3)
    tiny_model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    optimizer.step()
    for step in (1, 2):
        run.log({"step": step, "loss": float(step)})
    torch.manual_seed(7)
    random.seed(7)
    run.save(2, tiny_model, tokenizer, optimizer, {"drawn": 40})
    expected = torch.rand(1).item(), random.random()
    run.log({"step": 3, "loss": 3.0})  # written after the checkpoint, then the run crashed

    with pytest.raises(MissingFileError, match="has no trainer_state.pt"):
        Run(Flags(resume=str(tmp_path / "empty")), "unused", None)
    with pytest.raises(UserError, match="these differ: lr"):
        Run(Flags(resume=str(tmp_path / "run"), lr=0.2), "unused", None, resumable={"n_steps"})
    config = tmp_path / "run" / "checkpoint" / "run_config.json"  # saved before `lr` existed: its default holds
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "lr"}))
    with pytest.raises(UserError, match="these differ: lr"):
        Run(Flags(resume=str(tmp_path / "run"), lr=0.2), "unused", None, resumable={"n_steps"})
    resumed = Run(Flags(resume=str(tmp_path / "run"), n_steps=5), "unused", None, resumable={"n_steps"})
    assert resumed.dir == tmp_path / "run" and resumed.start_step == 2 and resumed.start_model == "start-model"
    assert [m["step"] for m in resumed.metrics()] == [1, 2]  # step 3 is trained again
    assert resumed.weights == str(tmp_path / "run" / "checkpoint")
    fresh = models.load_model(resumed.weights)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    state = resumed.restore(fresh, fresh_optimizer)
    assert state["drawn"] == 40 and (torch.rand(1).item(), random.random()) == expected
    moments = [s["exp_avg"] for s in fresh_optimizer.state_dict()["state"].values()]
    assert moments and all(torch.equal(a, b["exp_avg"]) for a, b in zip(moments, optimizer.state_dict()["state"].values()))
    assert models.resolve_model(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint")
