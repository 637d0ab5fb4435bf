"""The run bookkeeper shared by SFT and RL: run folder, config, metrics, checkpoints, resume rules."""

import json
import random
from pathlib import Path
from dataclasses import dataclass

import pytest
import torch

from alignment import models
from alignment.args import RunArgs
from alignment.errors import MissingFileError, UserError
from alignment.folders import PLOT_FILE
from alignment.run import STATE_FILE, Run
from tests.conftest import hold_lock


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
        "eval_before_train": True, "keep_freed_memory": False, "lr": 0.1,
        "n_steps": 3, "start_model": "start-model", "script": "Flags"}
    run.log({"step": 1, "loss": 0.5, "rate": float("nan")})
    run.log_rollouts(1, [{"prompt": "p", "response": "r"}])
    assert run.metrics() == [{"step": 1, "loss": 0.5, "rate": None}]
    assert read_jsonl(tmp_path / "run" / "rollouts.jsonl") == [{"step": 1, "prompt": "p", "response": "r"}]
    assert run.weights == "start-model" and run.start_step == 0 and run.restore(None, None) is None


def test_a_used_folder_is_refused_unless_resumed_or_overwritten(tmp_path):
    open_run(tmp_path / "run").log({"step": 1})  # stopped before its first checkpoint: --resume is no way on
    with pytest.raises(UserError, match=f"{tmp_path / 'run'} already holds a run that stopped before its first "
                                        r"checkpoint \(nothing in it can be resumed\): start over with --overwrite"):
        open_run(tmp_path / "run")
    (tmp_path / "run" / "checkpoint").mkdir()
    (tmp_path / "run" / "checkpoint" / STATE_FILE).write_bytes(b"")
    with pytest.raises(UserError, match=f"{tmp_path / 'run'} already holds a run: continue it with --resume"):
        open_run(tmp_path / "run")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("a user's file")
    with pytest.raises(UserError, match="holds files that are not a run"):
        open_run(tmp_path / "other")
    with pytest.raises(UserError, match=r"--overwrite deletes only run folders"):  # a user's files are never deleted
        open_run(tmp_path / "other", overwrite=True)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == ["notes.txt"]
    run = open_run(tmp_path / "run", overwrite=True)
    assert run.metrics() == [] and sorted(p.name for p in run.dir.iterdir()) == [".lock", "config.json"]
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

    (tmp_path / "empty").mkdir()
    (tmp_path / "evaluated").mkdir()  # an evaluate output folder (or a user's) once said `checkpoint has no ...`
    for name in ("summary.json", "results.jsonl"):
        (tmp_path / "evaluated" / name).write_text("{}\n")
    for folder in ("empty", "evaluated"):
        with pytest.raises(MissingFileError, match=f"--resume .*{folder}: the folder holds no run of alignment.Flags"):
            Run(Flags(resume=str(tmp_path / folder)), "unused", None)
        assert not (tmp_path / folder / ".lock").exists()  # refused before anything is written into it
    with pytest.raises(UserError, match=r"these differ: --lr 0.2 \(the run's: 0.1\)"):  # both values named
        Run(Flags(resume=str(tmp_path / "run"), lr=0.2), "unused", None, resumable={"n_steps"})
    config = tmp_path / "run" / "checkpoint" / "run_config.json"  # saved before `lr` existed: its default holds
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "lr"}))
    with pytest.raises(UserError, match="these differ: --lr"):
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
    resumed.refuse_finished(5, "--n_steps")  # 3 steps left to train
    finished = Run(Flags(resume=str(tmp_path / "run"), n_steps=2), "unused", None, resumable={"n_steps"})
    with pytest.raises(UserError, match=r"has finished: its checkpoint is at step 2 of 2, so --resume has nothing to "
                                        r"train; raise --n_steps \(now 2\) to train further"):
        finished.refuse_finished(2, "--n_steps")  # not a silent exit 0 that trained nothing (probe round 4)


def test_a_run_folder_is_locked_while_a_run_writes_it_and_released_when_its_process_ends(tmp_path):
    """Two runs started together on one folder: the second is refused while the first's process lives (an
    flock, held by another process here), and a killed holder blocks nothing."""
    folder = tmp_path / "run"
    holder = hold_lock(folder)
    with pytest.raises(UserError, match=f"{folder} is being written by another run \\(process {holder.pid}\\)"):
        open_run(folder)
    holder.kill()
    holder.wait()
    open_run(folder).log({"step": 1})  # the killed run's lock went with its process


def test_another_scripts_run_folder_is_not_resumed_and_resume_names_its_own_folder(tmp_path, tiny_model, tokenizer):
    from alignment.args import RLArgs, SFTArgs
    sft = Run(SFTArgs(output_dir=str(tmp_path / "sft")), "unused", "start", resumable=())
    assert json.loads((tmp_path / "sft" / "config.json").read_text())["script"] == "sft"
    sft.save(1, tiny_model, tokenizer, torch.optim.AdamW(tiny_model.parameters()))
    with pytest.raises(UserError, match="is a run of alignment.sft, not of alignment.train_rl: continue it with "
                                        "`uv run -m alignment.sft --resume"):
        Run(RLArgs(resume=str(tmp_path / "sft")), "unused", None)
    with pytest.raises(ValueError, match="names another: drop --output_dir"):
        RLArgs(resume=str(tmp_path / "sft"), output_dir=str(tmp_path / "elsewhere")).check_run()
    RLArgs(resume=str(tmp_path / "sft"), output_dir=str(tmp_path / "sft")).check_run()  # the same folder: fine
    with pytest.raises(MissingFileError, match="no such run folder"):
        Run(RLArgs(resume=str(tmp_path / "missing")), "unused", None)


def test_one_press_delivered_twice_is_one_and_no_message_claims_a_missing_checkpoint(tmp_path, monkeypatch):
    """`uv run` forwards the SIGINT that the process group already got: two within a second are one press
    (stop after the step); a real second press stops at once and says what is kept, the truth."""
    import signal
    import alignment.run as run_module
    clock = [100.0]
    monkeypatch.setattr(run_module.time, "monotonic", lambda: clock[0])
    run = open_run(tmp_path / "run")
    run._on_signal(signal.SIGINT, None)
    clock[0] += 0.2
    run._on_signal(signal.SIGINT, None)  # the duplicate: ignored
    assert run.signal == signal.SIGINT
    clock[0] += 3.0
    with pytest.raises(KeyboardInterrupt, match=f"before the first checkpoint: nothing in {tmp_path / 'run'} can be"):
        run._on_signal(signal.SIGINT, None)
    (run.checkpoint).mkdir()
    (run.checkpoint / "trainer_state.pt").write_bytes(b"")
    with pytest.raises(KeyboardInterrupt, match=f"the last checkpoint is kept: continue with --resume {tmp_path / 'run'}"):
        run._on_signal(signal.SIGINT, None)


def test_a_run_stopped_before_its_first_checkpoint_sends_the_user_to_overwrite_never_in_a_circle(tmp_path):
    """Stopped at once before step 1 saved: starting again names --overwrite (not --resume, which has nothing to
    go on from), and following that advice starts the run."""
    import signal
    run = open_run(tmp_path / "run")
    run.log({"step": 0, "eval_accuracy": 0.1})
    run._on_signal(signal.SIGINT, None)
    run.signal_time -= 5  # a real second press
    with pytest.raises(KeyboardInterrupt, match="nothing in .* can be resumed \\(start again with --overwrite\\)"):
        run._on_signal(signal.SIGINT, None)
    with pytest.raises(UserError) as refused:
        open_run(tmp_path / "run")
    assert "--resume" not in str(refused.value) and "--overwrite" in str(refused.value)
    with pytest.raises(MissingFileError, match="has no trainer_state.pt: the run in .* stopped before its first "
                                               "checkpoint, so nothing can be resumed; start it again with --overwrite"):
        open_run(tmp_path / "run", resume=str(tmp_path / "run"))  # the same advice, not "see --save_every"
    assert open_run(tmp_path / "run", overwrite=True).metrics() == []


def test_overwrite_deletes_only_what_a_run_wrote(tmp_path):
    """A model folder's config.json is not a run's; a run folder the user added files to is refused, not emptied."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    (model / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(UserError, match="holds files that are not a run"):
        open_run(model, overwrite=True)
    run = open_run(tmp_path / "run")
    run.log({"step": 1})
    (run.dir / "notes.txt").write_text("mine")
    (run.dir / "mydata").mkdir()
    with pytest.raises(UserError, match=r"holds files no run writes \(mydata, notes.txt\): --overwrite deletes only"):
        open_run(tmp_path / "run", overwrite=True)
    assert sorted(p.name for p in model.iterdir()) == ["config.json", "model.safetensors"]
    assert {"notes.txt", "mydata", "metrics.jsonl"} <= {p.name for p in run.dir.iterdir()}
    # what alignment.plot writes into a run folder by default is the toolkit's own, deleted with the run
    (run.dir / "notes.txt").unlink()
    (run.dir / "mydata").rmdir()
    (run.dir / PLOT_FILE).write_bytes(b"png")
    assert open_run(tmp_path / "run", overwrite=True).metrics() == []
    assert not (run.dir / PLOT_FILE).exists()


def test_overwrite_and_saves_keep_a_users_file_inside_checkpoint(tmp_path, tiny_model, tokenizer):
    """Issue 91: `--overwrite` deleted a note the user put in checkpoint/ (the refusal looked at the top level only),
    and so did every later save (the folder is replaced whole). The refusal names the nested file; a save carries it
    over; a checkpoint written before the manifest is read by the names a save writes."""
    from alignment import folders
    run = open_run(tmp_path / "run")
    run.save(1, tiny_model, tokenizer, torch.optim.AdamW(tiny_model.parameters()))
    (run.checkpoint / "NOTES.txt").write_text("mine")
    (run.checkpoint / "optimizer" / "mine.txt").write_text("mine too")
    with pytest.raises(UserError, match=r"holds files no run writes \(checkpoint/NOTES.txt, "
                                        r"checkpoint/optimizer/mine.txt\): --overwrite deletes only"):
        open_run(tmp_path / "run", overwrite=True)
    run.save(2, tiny_model, tokenizer, torch.optim.AdamW(tiny_model.parameters()))  # replaces checkpoint/ whole
    assert (run.checkpoint / "NOTES.txt").read_text() == "mine"
    assert (run.checkpoint / "optimizer" / "mine.txt").read_text() == "mine too"
    assert folders.foreign_in_checkpoint(run.checkpoint) == ["NOTES.txt", "optimizer/mine.txt"]
    (run.checkpoint / folders.MANIFEST).unlink()  # as saved before 2026-12-07: the save's own names still count
    assert folders.foreign_in_checkpoint(run.checkpoint) == ["NOTES.txt"]
    for name in ("NOTES.txt", "optimizer/mine.txt"):
        (run.checkpoint / name).unlink()
    assert open_run(tmp_path / "run", overwrite=True).metrics() == []
    assert not run.checkpoint.exists()


def test_a_users_lone_config_json_is_kept(tmp_path):
    """Issue 77's probe: a folder holding only the user's config.json was taken for a run that failed before its
    first step, and the file was replaced without --overwrite. A run's own lone config.json still is one."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text('{"mine": 1}')
    for overwrite in (False, True):
        with pytest.raises(UserError, match="holds files that are not a run"):
            open_run(tmp_path / "mine", overwrite=overwrite)
    assert json.loads((tmp_path / "mine" / "config.json").read_text()) == {"mine": 1}
    open_run(tmp_path / "run")  # a run that failed before its first step: nothing to lose, started again
    assert open_run(tmp_path / "run").dir == tmp_path / "run"


def test_a_resume_after_a_save_cut_short_takes_the_saved_flags(tmp_path):
    """A crash between a save's two renames leaves checkpoint.old and checkpoint.tmp: the first --resume read no
    flags (no checkpoint/) and refused nine the user never typed; it must read the finished save's."""
    from alignment.args import RLArgs, parse
    saved = {**RLArgs().__dict__, "group_size": 2, "rollout_batch_size": 4, "train_batch_size": 4,
             "train_mini_batch_size": 2, "n_steps": 5}
    for name, group_size in (("checkpoint.old", 8), ("checkpoint.tmp", 2)):  # .tmp: the newer, finished save
        (tmp_path / "run" / name).mkdir(parents=True)
        (tmp_path / "run" / name / "run_config.json").write_text(json.dumps({**saved, "group_size": group_size}))
    args = parse(RLArgs, ["--resume", str(tmp_path / "run")])
    assert (args.group_size, args.train_mini_batch_size, args.n_steps) == (2, 2, 5)
    assert not (tmp_path / "run" / "checkpoint").exists()  # parsing moves nothing; Run finishes the save
    assert models.finish_interrupted_save(tmp_path / "run" / "checkpoint").exists()
    assert json.loads((tmp_path / "run" / "checkpoint" / "run_config.json").read_text())["group_size"] == 2


def test_a_flag_the_saved_run_predates_is_named_as_such(tmp_path, tiny_model, tokenizer):
    run = open_run(tmp_path / "run")
    run.save(1, tiny_model, tokenizer, None)
    config = tmp_path / "run" / "checkpoint" / "run_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "lr"}))
    with pytest.raises(UserError, match=r"--lr 0.2 \(the run's: 0.1, the default: the run was saved before the flag "
                                        r"existed\)"):
        Run(Flags(resume=str(tmp_path / "run"), lr=0.2), "unused", None, resumable={"n_steps"})


def test_a_used_folder_of_another_script_names_that_scripts_resume(tmp_path):
    run = open_run(tmp_path / "run")
    run.log({"step": 1})
    (run.checkpoint).mkdir()
    (run.checkpoint / STATE_FILE).write_bytes(b"")
    config = json.loads((run.dir / "config.json").read_text())
    (run.dir / "config.json").write_text(json.dumps({**config, "script": "sft"}))
    with pytest.raises(UserError, match=f"already holds a run of alignment.sft: continue it with `uv run -m "
                                        f"alignment.sft --resume {run.dir}`"):
        open_run(tmp_path / "run")


def test_resume_takes_the_flags_left_out_from_the_run_itself(tmp_path):
    """`--resume DIR` alone continues the run with the flags it was started with (its run_config.json), as the
    stop message says; flags given on the command line are kept (the step count; a changed one is refused later)."""
    from alignment.args import RLArgs, parse
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    saved = {**RLArgs().__dict__, "group_size": 2, "rollout_batch_size": 4, "train_batch_size": 4,
             "train_mini_batch_size": 2, "eval_before_train": False, "output_dir": "/elsewhere/run", "n_steps": 5}
    (tmp_path / "run" / "checkpoint" / "run_config.json").write_text(json.dumps(saved))
    args = parse(RLArgs, ["--resume", str(tmp_path / "run"), "--n-steps", "9"])
    assert (args.group_size, args.rollout_batch_size, args.train_mini_batch_size) == (2, 4, 2)
    assert args.n_steps == 9 and args.eval_before_train is False
    assert args.output_dir == str(tmp_path / "run")  # the folder moved: config.json records where it is now
    args = parse(RLArgs, ["--resume", str(tmp_path / "run"), "--eval_before_train"])
    assert args.eval_before_train is True and args.n_steps == 5


def test_resume_refuses_an_explicit_output_dir_elsewhere_and_another_scripts_flags(tmp_path):
    """`sft --resume R --output_dir <sft's default>` was accepted (the default could not be told from a given
    value), and `expert_iteration --resume <an sft run>` failed on a flag of sft's it took (probe round 2)."""
    from alignment.args import EIArgs, SFTArgs, parse
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "config.json").write_text(json.dumps({"script": "sft"}))
    (tmp_path / "run" / "checkpoint" / "run_config.json").write_text(json.dumps({**SFTArgs().__dict__, "save_every": 0}))
    with pytest.raises(SystemExit):
        parse(SFTArgs, ["--resume", str(tmp_path / "run"), "--output_dir", SFTArgs().output_dir])
    assert parse(EIArgs, ["--resume", str(tmp_path / "run")]).save_every == EIArgs().save_every  # Run says whose


def test_what_rank_0_makes_while_the_other_ranks_look_is_not_a_run(tmp_path):
    """Under torchrun rank 0 creates the folder, its lock and writable_folder's probe file while the other
    ranks check whether the folder already holds a run: none of those may read as a run (a race that failed
    rank 1 of a 2-process run now and then)."""
    from alignment.folders import LOCK_FILE, WRITE_PROBE
    from alignment.run import _holds_a_run
    for name in (LOCK_FILE, WRITE_PROBE):
        (tmp_path / name).write_text("")
    (tmp_path / "config.json").write_text(json.dumps({"output_dir": str(tmp_path), "start_model": "m", "script": "sft"}))
    assert not _holds_a_run(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    assert _holds_a_run(tmp_path)


def test_a_run_folder_that_holds_its_start_model_is_refused_before_anything_is_written(tmp_path, tiny_model, tokenizer):
    """`--model X --output_dir X --overwrite` deleted the model it was about to load (probe round 2)."""
    model_dir = tmp_path / "model"
    tiny_model.save_pretrained(model_dir)
    before = sorted(p.name for p in model_dir.iterdir())
    for out in (model_dir, tmp_path):  # the model's folder, and a folder above it
        with pytest.raises(UserError, match="would write \\(or with --overwrite delete\\) the model it starts from"):
            Run(Flags(output_dir=str(out), overwrite=True), "unused", str(model_dir))
    assert sorted(p.name for p in model_dir.iterdir()) == before


def test_a_lock_that_is_not_a_file_ends_in_one_line(tmp_path):
    (tmp_path / "run" / ".lock").mkdir(parents=True)
    with pytest.raises(UserError, match="cannot open the run lock"):
        open_run(tmp_path / "run")


def test_resume_of_the_checkpoint_folder_itself_names_the_run_folder_and_writes_nothing(tmp_path, tiny_model, tokenizer):
    run = open_run(tmp_path / "run")
    run.save(1, tiny_model, tokenizer, torch.optim.AdamW(tiny_model.parameters()))
    before = sorted(p.name for p in run.checkpoint.iterdir())
    with pytest.raises(UserError, match=f"is a run's checkpoint folder: pass the run folder that holds it \\(--resume "
                                        f"{tmp_path / 'run'}\\)"):
        Run(Flags(resume=str(run.checkpoint)), "unused", None)
    assert sorted(p.name for p in run.checkpoint.iterdir()) == before  # no stray .lock
