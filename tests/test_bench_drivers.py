"""The bench drivers' own rules (bench/steps_demo.py's stage runner, which tir_demo.py and delethink_demo.py use;
gpu_pass.py's prepare and run; rl_step.py's flags), each checked with tiny stand-in stages (`python -c ...`) rather
than a trained model: a user's file is never deleted, a signal reaches the stage, a damaged record or a bad flag is
one line, a failed stage says its own error."""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import delethink_demo  # noqa: E402
import gpu_pass  # noqa: E402
import steps_demo  # noqa: E402
import tir_demo  # noqa: E402
from steps_demo import Stage  # noqa: E402


def fake_stage(out: Path, name: str, code: str, trains: bool = False) -> Stage:
    """A stage whose command is `python -c code --output_dir <out>/<name>` (the code reads its folder from argv)."""
    prelude = "import pathlib, signal, sys, time; folder = pathlib.Path(sys.argv[sys.argv.index('--output_dir') + 1]); "
    return Stage(name, ["-c", prelude + code, "--output_dir", str(out / name)], trains=trains)


# ----------------------------------------------------------------------------- a user's files (issue 77, 1)

def test_overwrite_never_deletes_a_users_file_in_a_folder_named_like_a_stage(tmp_path):
    """A user's summary.json beside their thesis.tex in <out>/eval-start-trained/ was deleted by --overwrite, and
    evaluate then wrote into the folder: a folder this driver has no record of making is refused, in one line."""
    out = tmp_path / "demo"
    folder = out / "eval-start-trained"
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text('{"mine": 1}')
    (folder / "thesis.tex").write_text("\\section{mine}")
    stage = Stage("eval-start-trained", steps_demo.eval_command("smollm2-135m", "gsm8k", folder, 2))
    for overwrite in (False, True):
        with pytest.raises(SystemExit, match="eval-start-trained holds files this driver has no record of making"):
            steps_demo.check_plan([stage], out, overwrite)
    assert (folder / "summary.json").read_text() == '{"mine": 1}' and (folder / "thesis.tex").exists()


def test_a_stage_folder_the_driver_made_is_redone_only_while_it_holds_nothing_else(tmp_path):
    out = tmp_path / "demo"
    stage = fake_stage(out, "eval-x", "(folder / 'summary.json').write_text('{\"new\": 1}')")
    folder = stage.folder
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text('{"old": 1}')
    (folder / "results.jsonl").write_text("{}\n")
    older = {"command": stage.command[:-2] + ["--limit", "1", "--output_dir", str(folder)], "reads": {}}
    (out / "stages.json").write_text(json.dumps({"eval-x": older}))  # this driver made it, with other flags
    (folder / "notes.txt").write_text("mine")  # then the user put a file there
    for attempt in (lambda: steps_demo.check_plan([stage], out, True), lambda: steps_demo.run_stage(stage, out)):
        with pytest.raises(SystemExit, match=r"eval-x holds files no run of the stage writes \(notes.txt\)"):
            attempt()
        assert (folder / "summary.json").read_text() == '{"old": 1}' and (folder / "notes.txt").read_text() == "mine"
    (folder / "notes.txt").unlink()
    steps_demo.check_plan([stage], out, True)
    assert steps_demo.run_stage(stage, out) >= 0  # redone: evaluate's old files deleted, the new ones written
    assert (folder / "summary.json").read_text() == '{"new": 1}' and not (folder / "results.jsonl").exists()
    assert json.loads((out / "stages.json").read_text())["eval-x"]["command"] == stage.command


# ----------------------------------------------------------------------------- signals (2)

CHILD = ("signal.signal(signal.SIGTERM, {handler}); "
         "(folder.parent / 'child.pid').write_text(str(__import__('os').getpid())); time.sleep(120)")
STOPS = "lambda *a: ((folder.parent / 'stopped').write_text('saved'), sys.exit(143))"


@pytest.mark.parametrize("handler, wait, ended", [
    (STOPS, 60, "which ended (exit status 143)"),  # train_rl: it stops after its step, with a checkpoint
    ("signal.SIG_IGN", 1, "which did not end within 1 s and was killed"),  # a stage that does not stop
])
def test_sigterm_to_a_driver_reaches_its_stage_and_the_driver_waits_for_it(tmp_path, handler, wait, ended):
    """`kill -TERM <driver>` during a stage once exited 143 silently, the stage running on with parent 1."""
    out = tmp_path / "demo"
    out.mkdir()
    stage = fake_stage(out, "rl-seed0", CHILD.format(handler=handler), trains=True)
    driver = subprocess.Popen([sys.executable, "-c", f"""
import sys; sys.path.insert(0, {str(ROOT / 'bench')!r})
from pathlib import Path
import steps_demo
steps_demo.STOP_WAIT_SECONDS = {wait}
steps_demo.run_stage(steps_demo.Stage(*{tuple(stage)!r}), Path({str(out)!r}))
"""], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pid_file, child = out / "child.pid", None
    try:
        deadline = time.monotonic() + 600  # two Python starts (torch imported once): minutes on two loaded cores
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline and driver.poll() is None:
            time.sleep(0.1)
        assert pid_file.exists(), driver.communicate(timeout=60) if driver.poll() is not None else "no stage after 600 s"
        child = int(pid_file.read_text())  # written once its SIGTERM handler is set
        driver.send_signal(signal.SIGTERM)
        stdout, stderr = driver.communicate(timeout=60)
        assert driver.returncode == 143, (stdout, stderr)
        assert f"stopped by SIGTERM, passed on to the rl-seed0 stage, {ended}" in stderr, stderr
        assert "run the same command again to continue" in stderr and "Traceback" not in stderr
        assert (out / "stopped").exists() == (handler == STOPS)
        assert steps_demo.times(out)["rl-seed0"] > 0  # a stopped stage's time counts (its resumption adds to it)
        with pytest.raises(ProcessLookupError):
            os.kill(child, 0)  # no orphan: the driver waited for it (and reaped it)
    finally:
        driver.kill()
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass


# ----------------------------------------------------------------------------- damaged records (4)

@pytest.mark.parametrize("name, text", [
    ("stages.json", ""),  # empty
    ("stages.json", '{"sft-seed0": {"command": ["-m", "alignm'),  # cut short
    ("stages.json", "not json"),
    ("stages.json", '{"sft-seed0": {"command": "-m"}}'),  # JSON, not a record
    ("times.json", '{"sft-seed0": 1.5, "rl'),
])
def test_a_damaged_driver_record_is_one_line_naming_it(tmp_path, name, text):
    out = tmp_path / "demo"
    out.mkdir()
    (out / name).write_text(text)
    stage = fake_stage(out, "eval-x", "pass")
    attempts = [lambda: steps_demo.run_stage(stage, out)]
    if name == "stages.json":  # what the plan reads
        attempts.append(lambda: steps_demo.check_plan([stage], out, True))
    for attempt in attempts:
        with pytest.raises(SystemExit, match=re.escape(f"{out / name} is not the JSON record this driver writes")):
            attempt()
    assert (out / name).read_text() == text and not (out / "eval-x").exists()


def test_a_damaged_report_record_says_what_it_records(tmp_path):
    """written.json records reports, not folders (a probe round, 2026-12-02: its message spoke of folders)."""
    (tmp_path / "written.json").write_text("{")
    with pytest.raises(SystemExit, match="cannot tell which reports it wrote"):
        steps_demo.check_own(tmp_path / "samples.md")


def test_the_driver_writes_its_records_whole(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    assert steps_demo.run_stage(fake_stage(out, "eval-x", "pass"), out) >= 0
    assert sorted(p.name for p in out.iterdir()) == ["eval-x.log", "stages.json", "times.json"]  # no .part left
    assert set(steps_demo.records(out)) == set(steps_demo.times(out)) == {"eval-x"}


# ----------------------------------------------------------------------------- a failed stage's own line (9)

def test_a_failed_stage_says_its_own_error_line_and_its_log(tmp_path):
    out = tmp_path / "demo"
    out.mkdir()
    (out / "stages.json").write_text("{}")
    (out / "eval-x.log").write_text("error: an older attempt's line\n")
    stage = fake_stage(out, "eval-x", "print('loading', flush=True); "
                                      "sys.exit('error: --limit 5 is more than the split holds: give 3 or fewer.')")
    with pytest.raises(SystemExit) as stopped:
        steps_demo.run_stage(stage, out)
    assert str(stopped.value).endswith(f"error: the eval-x stage failed (exit status 1): --limit 5 is more than the "
                                       f"split holds: give 3 or fewer. (its output: {out / 'eval-x.log'})")
    refused = fake_stage(out, "eval-y", "sys.stderr.write('error: no such dataset\\n'); sys.exit(2)")
    with pytest.raises(SystemExit, match=r"eval-y stage failed \(exit status 2\): no such dataset \(its output"):
        steps_demo.run_stage(refused, out)
    assert set(steps_demo.records(out)) == set(steps_demo.times(out)) == {"eval-x"}  # a refused stage (status 2)
    # leaves no record of its command, nor a time; a failed one keeps its time
    crashed = fake_stage(out, "eval-z", "raise RuntimeError('a bug')")
    with pytest.raises(SystemExit, match="eval-z stage failed \\(exit status 1\\): RuntimeError: a bug"):
        steps_demo.run_stage(crashed, out)


# ----------------------------------------------------------------------------- flags (7, 8)

@pytest.mark.parametrize("driver, argv", [
    (tir_demo, ["--max_tokens", "0"]),  # once taken as unset: the recipe's 192
    (tir_demo, ["--max_tokens", "-4"]),
    (tir_demo, ["--rl_steps", "0"]),
    (steps_demo, ["--limit", "0"]),
    (steps_demo, ["--sft_examples", "0"]),
    (delethink_demo, ["--budget", "0"]),
    (delethink_demo, ["--rl_steps", "-1"]),
])
def test_the_drivers_refuse_a_number_below_one(driver, argv, capsys, tmp_path):
    with pytest.raises(SystemExit) as refused:
        driver.parse_args([*argv, "--out", str(tmp_path / "demo")])
    assert refused.value.code == 2
    assert f"argument {argv[0]}: {argv[1]}: give a whole number from 1" in capsys.readouterr().err


def test_tir_demos_max_tokens_sets_every_budget_and_its_default_is_the_recipes(tmp_path):
    def budgets(*argv):
        args = tir_demo.parse_args([*argv, "--seeds", "0", "--arms", "text", "--out", str(tmp_path / "demo")])
        stages = {s.name: s.command for s in tir_demo.plan(args, args.out)}
        rl, evaluation = stages["rl-text-seed0"], stages["eval-rl-text-seed0-trained"]
        return rl[rl.index("--sampling_max_tokens") + 1], evaluation[evaluation.index("--max_tokens") + 1]
    assert budgets() == (tir_demo.SAMPLE_TOKENS, tir_demo.EVAL_TOKENS)
    assert budgets("--max_tokens", "24") == ("24", "24")


@pytest.mark.parametrize("argv", [["--rl_flags", "--compile_layers"], ["--rl_flags=--compile_layers"]])
def test_rl_flags_takes_a_value_that_starts_with_dashes(argv, tmp_path):
    """`--rl_flags --compile_layers` once ended in argparse's "expected one argument"."""
    args = steps_demo.parse_args([*argv, "--seeds", "0", "--out", str(tmp_path / "demo")])
    assert args.rl_flags == "--compile_layers"
    rl = next(s for s in steps_demo.plan(args, args.out) if s.name == "rl-seed0")
    assert rl.command[-1] == "--compile_layers"
    spaced = steps_demo.parse_args(["--rl_flags", "--kl_coef 0.05", "--out", str(tmp_path / "demo")])
    assert spaced.rl_flags == "--kl_coef 0.05"


@pytest.mark.parametrize("flag", ["--overwrite", "--learning_rate=1e-4"])
def test_rl_flags_may_not_set_what_the_driver_sets(flag, capsys, tmp_path):
    with pytest.raises(SystemExit):
        steps_demo.parse_args(["--rl_flags", flag, "--out", str(tmp_path / "demo")])
    assert f"--rl_flags may not set {flag.split('=')[0]}: the driver sets it" in capsys.readouterr().err


# ----------------------------------------------------------------------------- bench/rl_step.py (5, 7)

@pytest.mark.parametrize("argv, message", [
    (["--trl_python", "/nonexistent/python"], "error: --trl_python /nonexistent/python does not run"),
    (["--trl_python", sys.executable], "cannot import trl (ModuleNotFoundError"),  # the project's own: no TRL
    (["--rounds", "0"], "argument --rounds: 0: give a whole number from 1"),
])
def test_rl_step_refuses_a_bad_flag_before_any_run(argv, message, tmp_path):
    if "cannot import" in message and subprocess.run([sys.executable, "-c", "import trl"]).returncode == 0:
        pytest.skip("this Python imports TRL")
    done = subprocess.run([sys.executable, "bench/rl_step.py", *argv, "--work", str(tmp_path / "work")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "work").exists()  # nothing of either side ran


def gsm8k_rows(folder: Path, count: int) -> Path:
    (folder / "gsm8k").mkdir(parents=True, exist_ok=True)
    for split in ("train", "test"):
        (folder / "gsm8k" / f"{split}.jsonl").write_text("".join(
            json.dumps({"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}) + "\n"
            for i in range(count)))
    return folder


def fake_trl_python(folder: Path, run: str) -> str:
    """A stand-in for a Python that imports TRL: it says TRL's version, and runs `run` (shell) as the TRL side."""
    fake = folder / "trl_python"
    fake.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then echo 1.16.0; exit 0; fi\n{run}\n')
    fake.chmod(0o755)
    return str(fake)


def rl_step(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "bench/rl_step.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, **kwargs)


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None for p in folder.rglob("*")}


def test_rl_step_writes_only_into_a_folder_it_made(tiny_model_dir, tmp_path):
    """--work DIR holding a copy of GSM8K in DIR/data and DIR/ours-0/my_results.txt: the bench cut the copy to one
    line and deleted the results (`--work /work/shared` would have destroyed the shared data); --json replaced any
    file; a missing --model was a traceback."""
    data_dir = gsm8k_rows(tmp_path / "data", 5)
    work = tmp_path / "work"
    gsm8k_rows(work / "data", 7)
    (work / "ours-0").mkdir()
    (work / "ours-0" / "my_results.txt").write_text("mine")
    before = snapshot(work)
    base = ["--steps", "2", "--rounds", "1", "--max_tokens", "2", "--group_size", "2", "--microbatch", "2",
            "--data_dir", str(data_dir), "--trl_python", fake_trl_python(tmp_path, "exit 1")]
    done = rl_step([*base, "--model", tiny_model_dir, "--work", str(work)])
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
    assert f"error: --work {work} holds files this bench did not write" in done.stderr.strip().splitlines()[-1]
    assert snapshot(work) == before
    (tmp_path / "mine.json").write_text('{"my": "numbers"}')
    done = rl_step([*base, "--model", tiny_model_dir, "--work", str(tmp_path / "new"), "--json",
                    str(tmp_path / "mine.json")])
    assert "error: --json " in done.stderr and "exists and is not a record of this bench" in done.stderr, done.stderr
    assert (tmp_path / "mine.json").read_text() == '{"my": "numbers"}' and not (tmp_path / "new").exists()
    done = rl_step([*base, "--model", "/nonexistent", "--work", str(tmp_path / "new")])
    assert done.returncode != 0 and "Traceback" not in done.stderr and "error: " in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "new").exists()


def test_rl_step_reuses_only_what_it_wrote_in_its_own_folder(tmp_path):
    import rl_step
    work = tmp_path / "work"
    assert rl_step.check_work(work) == {} and rl_step.check_work(tmp_path / "work") == {}
    work.mkdir()
    record = rl_step.check_work(work)
    rl_step.write_work_file(work, record, "data/gsm8k/train.jsonl", '{"question": "q"}\n')
    (work / "ours-0").mkdir()
    for name in ("config.json", "metrics.jsonl", ".lock"):
        (work / "ours-0" / name).write_text("{}")
    assert rl_step.check_work(work)["files"] == record["files"]  # its own: used again
    (work / "data" / "gsm8k" / "train.jsonl").write_text("a user's copy of GSM8K\n" * 3)
    with pytest.raises(SystemExit, match=r"holds files this bench did not write \(data/gsm8k/train.jsonl \(changed "
                                         r"since this bench wrote it\)\)"):
        rl_step.check_work(work)
    rl_step.write_work_file(work, record, "data/gsm8k/train.jsonl", '{"question": "q"}\n')
    (work / "ours-0" / "my_results.txt").write_text("mine")
    (work / "data" / "gsm8k" / "test.jsonl").write_text("mine")
    with pytest.raises(SystemExit, match=r"\(data/gsm8k/test.jsonl, ours-0/my_results.txt\): move them out"):
        rl_step.check_work(work)
    (work / "ours-0" / "my_results.txt").unlink()
    (work / "data" / "gsm8k" / "test.jsonl").unlink()
    (work / rl_step.RECORD).write_text("{")  # a damaged record: nothing in the folder is known for the bench's
    with pytest.raises(SystemExit, match="no record .rl_step.json of its own there"):
        rl_step.check_work(work)
    (work / rl_step.RECORD).unlink()
    with pytest.raises(SystemExit, match="no record .rl_step.json of its own there"):
        rl_step.check_work(work)
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": 1}')
    with pytest.raises(SystemExit, match="exists and is not a record of this bench: name another file, or add "
                                         "--overwrite"):
        rl_step.check_json(str(mine), False)
    rl_step.check_json(str(mine), True)
    mine.write_text(json.dumps({"medians": {}, "floors": {}, "ratio_trl_over_ours": {}, "device": "cpu"}))
    rl_step.check_json(str(mine), False)  # the bench's own record: replaced
    with pytest.raises(SystemExit, match="its folder .*nodir does not exist"):  # once a traceback after the bench
        rl_step.check_json(str(tmp_path / "nodir" / "x.json"), True)


def test_rl_step_says_in_one_line_that_a_ctrl_c_during_the_trl_side_interrupted_it(tiny_model_dir, tmp_path):
    """It ended in a KeyboardInterrupt traceback. The TRL side here is a stand-in Python that waits."""
    fake = fake_trl_python(tmp_path, "exec sleep 120")
    work = tmp_path / "work"
    bench = subprocess.Popen(
        [sys.executable, "bench/rl_step.py", "--steps", "2", "--rounds", "1", "--max_tokens", "2", "--group_size", "2",
         "--microbatch", "2", "--data_dir", str(gsm8k_rows(tmp_path / "data", 3)), "--trl_python", fake,
         "--model", tiny_model_dir, "--work", str(work)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal, also in a background job
    try:
        for line in bench.stdout:
            if line.startswith("[bench] round 1 ours:"):
                break
        time.sleep(1)
        os.killpg(bench.pid, signal.SIGINT)  # Ctrl-C: the whole foreground group
        err = bench.communicate(timeout=60)[1]
    finally:
        bench.kill()
    assert bench.returncode != 0 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == ("[bench] interrupted (Ctrl-C): the side in progress was stopped; no table "
                                            "and no --json written.")
    assert sorted(p.name for p in work.iterdir()) == [".rl_step.json", "data", "ours-0"]  # no trl-0


# ----------------------------------------------------------------------------- bench/gpu_pass.py prepare (3)

@pytest.fixture
def good_pass(tmp_path):
    """A good .gpu_pass/ from an earlier prepare."""
    prepared = tmp_path / ".gpu_pass"
    (prepared / "whl").mkdir(parents=True)
    (prepared / "whl" / "good-1.0-py3-none-any.whl").write_text("a wheel")
    return prepared


def test_prepare_checks_everything_before_it_touches_the_last_good_folder(good_pass, tmp_path, monkeypatch):
    """With no Python 3.12 it once deleted the 16 MB folder and left an empty whl/; with a missing --data_dir it
    downloaded, then died half-made (a FileNotFoundError traceback)."""
    def no_download(*a, **k):
        raise AssertionError("nothing is fetched before the checks pass")
    monkeypatch.setattr(gpu_pass.subprocess, "run", no_download)
    scratch = tmp_path / "scratch"
    monkeypatch.setattr(gpu_pass, "find_python312", lambda: "")
    with pytest.raises(SystemExit, match="none was found"):
        gpu_pass.prepare(argparse.Namespace(data_dir=None), good_pass, scratch)
    monkeypatch.setattr(gpu_pass, "find_python312", lambda: sys.executable)
    with pytest.raises(SystemExit, match=re.escape(f"no GSM8K rows at {tmp_path / 'missing'}")):
        gpu_pass.prepare(argparse.Namespace(data_dir=str(tmp_path / "missing")), good_pass, scratch)
    assert [p.name for p in good_pass.rglob("*")] == ["whl", "good-1.0-py3-none-any.whl"]
    assert not scratch.exists() or not any(scratch.iterdir())


def test_prepare_builds_aside_and_replaces_the_folder_only_when_done(good_pass, data_dir, tmp_path, monkeypatch):
    from alignment import models
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_text("weights")  # the weights stay behind
    monkeypatch.setattr(models, "resolve_model", lambda name: str(model))
    monkeypatch.setattr(gpu_pass, "find_python312", lambda: sys.executable)
    scratch = tmp_path / "scratch"
    monkeypatch.setattr(gpu_pass.subprocess, "run", lambda command, **k: subprocess.CompletedProcess(command, 1))
    with pytest.raises(SystemExit, match="`pip download` failed .*the last .gpu_pass/ is left as it was"):
        gpu_pass.prepare(argparse.Namespace(data_dir=str(data_dir)), good_pass, scratch)
    assert [p.name for p in good_pass.rglob("*")] == ["whl", "good-1.0-py3-none-any.whl"]
    assert not any(scratch.iterdir())  # the half-made folder removed

    def fetched(command, **k):  # pip download / pip wheel: one wheel each into the folder named after -d / -w
        folder = Path(command[command.index("-d" if "-d" in command else "-w") + 1])
        (folder / f"{command[3]}-1.0-py3-none-any.whl").write_text("a wheel")
        return subprocess.CompletedProcess(command, 0)
    monkeypatch.setattr(gpu_pass.subprocess, "run", fetched)
    gpu_pass.prepare(argparse.Namespace(data_dir=str(data_dir)), good_pass, scratch)
    assert sorted(p.name for p in (good_pass / "whl").iterdir()) == ["download-1.0-py3-none-any.whl",
                                                                    "wheel-1.0-py3-none-any.whl"]
    assert [p.name for p in (good_pass / "smollm2-135m").iterdir()] == ["config.json"]
    assert len((good_pass / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()) == 200
    assert not any(scratch.iterdir())


# ----------------------------------------------------------------------------- bench/gpu_pass.py run (6)

def test_the_pass_removes_its_temporary_work_folder_and_keeps_a_named_one(tmp_path, monkeypatch):
    for key in ("PYTHONUNBUFFERED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM", "PYTHONPATH",
                "ALIGNMENT_DATA_DIR", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "TORCHELASTIC_RUN_ID"):  # run() sets these
        monkeypatch.setenv(key, os.environ[key]) if key in os.environ else monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(gpu_pass, "environment", lambda device: {})
    def build_models(args, work, say):
        work.mkdir(parents=True, exist_ok=True)
        (work / "model.bin").write_text("random weights")
    monkeypatch.setattr(gpu_pass, "build_models", build_models)
    monkeypatch.setattr(gpu_pass, "stage_plan", lambda args, work: [("sft", [sys.executable, "-c", "pass"], 60)])
    monkeypatch.setitem(gpu_pass.CHECKS, "sft", lambda work, output, env: {"made": (work / "model.bin").exists()})
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    monkeypatch.setattr(gpu_pass.tempfile, "tempdir", str(temporary))

    def run(out, work=None):
        return gpu_pass.run(argparse.Namespace(out=str(tmp_path / out), device="cpu", tiny=True, work=work,
                                               budget=100, only=None))
    assert run("out") == 0
    assert json.loads((tmp_path / "out" / "results.json").read_text())["stages"]["sft"]["made"] is True
    assert not any(temporary.iterdir())  # the pass's own temporary folder is gone
    assert run("out2", work=str(tmp_path / "work")) == 0 and (tmp_path / "work" / "model.bin").exists()


def test_a_run_saved_before_a_flag_existed_is_still_the_stages_own(tmp_path):
    """A long stage resumed in a later session (bench/gsm8k_card.py's SFT) must not be run again because the script
    grew a flag meanwhile: a key absent from the saved config.json matches when the stage leaves it at its default,
    as a resume does (alignment/run.py); a saved value that differs still does not."""
    folder = tmp_path / "sft-x"
    folder.mkdir()
    stage = Stage("sft-x", ["-m", "alignment.sft", "--lr", "1e-4", "--output_dir", str(folder)], trains=True)
    from alignment.args import SFTArgs, parse, to_dict
    saved = json.loads(json.dumps(to_dict(parse(SFTArgs, stage.command[2:])), default=str))
    (folder / "config.json").write_text(json.dumps(saved))
    assert stage.holds_its_own()
    del saved["weight_decay"]  # a flag the run predates, at its default in the stage's command
    (folder / "config.json").write_text(json.dumps(saved))
    assert stage.holds_its_own()
    asks_another = Stage("sft-x", stage.command[:-2] + ["--weight_decay", "0.1", "--output_dir", str(folder)],
                         trains=True)
    assert not asks_another.holds_its_own()  # not at its default: the run did not have it
    (folder / "config.json").write_text(json.dumps({**saved, "lr": 2e-4}))
    assert not stage.holds_its_own()


def test_a_drivers_report_never_replaces_a_users_file(tmp_path):
    """steps_demo, tir_demo and delethink_demo wrote their table and samples.md over a user's file of that name in
    --out (gsm8k_card's card was guarded, theirs not: a probe round, 2026-12-02)."""
    import inspect
    (tmp_path / "samples.md").write_text("MY OWN NOTES - do not lose\n")
    with pytest.raises(SystemExit, match="is not the file this driver last wrote"):
        steps_demo.write_own(tmp_path / "samples.md", "### seed 0\n")
    assert (tmp_path / "samples.md").read_text() == "MY OWN NOTES - do not lose\n"
    (tmp_path / "samples.md").unlink()
    steps_demo.write_own(tmp_path / "samples.md", "### seed 0\n")
    steps_demo.write_own(tmp_path / "samples.md", "### seed 0, again\n")  # its own: replaced
    assert (tmp_path / "samples.md").read_text() == "### seed 0, again\n"
    for driver in (steps_demo, tir_demo, delethink_demo):  # every report goes through it
        source = inspect.getsource(driver)
        assert ".md\").write_text(" not in source and "savefig(out" not in source and \
            source.count("write_own(out / ") == 2 + (driver is delethink_demo), driver.__name__  # (its plot too)


def test_a_users_report_is_refused_before_the_first_stage_runs(tmp_path, monkeypatch):
    """The refusal came only after every stage had run (hours, for a whole demo: a probe round, 2026-12-02)."""
    import inspect
    import gsm8k_card
    ran = []
    monkeypatch.setattr(steps_demo, "run_stage", lambda stage, out: ran.append(stage.name) or 0.0)
    stage = Stage("sft-seed0", ["-m", "alignment.sft", "--output_dir", str(tmp_path / "sft-seed0")], trains=True)
    (tmp_path / "samples.md").write_text("MY OWN NOTES\n")
    with pytest.raises(SystemExit, match="samples.md is not the file this driver last wrote"):
        steps_demo.run_all([stage], tmp_path, False, reports=("steps_demo.md", "samples.md"))
    assert not ran
    (tmp_path / "samples.md").unlink()
    (tmp_path / "samples.md").mkdir()  # a folder of that name: one line, not IsADirectoryError (round 8)
    with pytest.raises(SystemExit, match="samples.md is not the file this driver last wrote"):
        steps_demo.run_all([stage], tmp_path, False, reports=("steps_demo.md", "samples.md"))
    (tmp_path / "samples.md").rmdir()
    assert steps_demo.run_all([stage], tmp_path, False, reports=("steps_demo.md", "samples.md")) == {"sft-seed0": 0.0}
    for driver, names in ((steps_demo, "steps_demo.md"), (tir_demo, "tir_demo.md"),
                          (delethink_demo, "delethink_demo.md"), (gsm8k_card, "gsm8k_card.md")):
        assert re.search(rf"run_all\(.*reports=\(\"{names}\"", inspect.getsource(driver.main), re.S), driver.__name__


def test_a_stage_run_alone_resumes_over_an_input_made_by_an_earlier_call(tmp_path):
    """`gsm8k_card.py --stages rl` after a stop: the RL stage's record reads the SFT stage, which this call's plan
    lacks; the plan compared it with nothing and refused the RL folder as "made with other flags" (2026-12-02)."""
    from alignment.args import SCRIPTS, parse, to_dict
    sft = Stage("sft-seed0", ["-m", "alignment.sft", "--lr", "1e-4", "--output_dir", str(tmp_path / "sft-seed0")],
                trains=True)
    rl = Stage("rl-seed0", ["-m", "alignment.train_rl", "--model", str(tmp_path / "sft-seed0"), "--n_steps", "9",
                            "--output_dir", str(tmp_path / "rl-seed0")], reads=("sft-seed0",), trains=True)
    (tmp_path / "rl-seed0" / "checkpoint").mkdir(parents=True)
    (tmp_path / "rl-seed0" / "checkpoint" / "trainer_state.pt").write_bytes(b"")  # stopped at a step: resumes
    config = json.loads(json.dumps(to_dict(parse(SCRIPTS["train_rl"], rl.command[2:])), default=str))
    (tmp_path / "rl-seed0" / "config.json").write_text(json.dumps(config))
    known = {"sft-seed0": steps_demo.record(sft, {})}
    steps_demo.write_record(tmp_path / steps_demo.STAGES_FILE, {**known, "rl-seed0": steps_demo.record(rl, known)})
    steps_demo.check_plan([rl], tmp_path, False)  # (it exited here)
    other = Stage(sft.name, sft.command[:3] + ["2e-4"] + sft.command[4:], trains=True)  # the SFT made again since
    steps_demo.write_record(tmp_path / steps_demo.STAGES_FILE, {"sft-seed0": steps_demo.record(other, {}),
                                                                "rl-seed0": steps_demo.record(rl, known)})
    with pytest.raises(SystemExit, match="holds a rl-seed0 result made with other flags"):
        steps_demo.check_plan([rl], tmp_path, False)


def test_ablations_says_a_bad_flag_in_one_line():
    """It printed argparse's usage block above the error, where the other drivers print one line (a probe round,
    2026-12-02)."""
    done = subprocess.run([sys.executable, "bench/ablations.py", "--only", "nope"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "usage:" not in done.stderr
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "[ablations] error: unknown variant" in done.stderr


def test_tir_serve_refuses_a_bad_in_flight_in_one_line_before_anything_loads():
    """--in_flight takes room, all or a positive number; 0 would admit no trace and serve nothing."""
    done = subprocess.run([sys.executable, "bench/tir_serve.py", "--in_flight", "0", "--model", "/nonexistent"],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 2 and "usage:" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines() == ["[tir_serve] error: --in_flight '0': give 'room', 'all' or a positive "
                                                "number of traces. (see --help)"], done.stderr


def test_a_forked_stage_is_the_script_as_python_runs_it(tmp_path):
    """A stage of `-m alignment.<script>` runs in a fork of the driver (no second 9 s import): its output goes to
    the stage's log, its exit status and a signal's death come back as a subprocess's would, and the driver's own
    SIGTERM handler is not the stage's."""
    log_path = tmp_path / "stage.log"
    with open(log_path, "w") as log:
        refused = steps_demo.start_stage(["-m", "alignment.calculator", "--bogus"], log)
        assert isinstance(refused, steps_demo.ForkedStage) and refused.wait(timeout=60) == 2
    assert "unrecognized arguments: --bogus" in log_path.read_text()
    previous = signal.signal(signal.SIGTERM, lambda *a: None)  # the driver's handler, as run_command sets one
    try:
        with open(log_path, "w") as log:
            shown = steps_demo.start_stage(["-m", "alignment.calculator", "--show", "0"], log)
            assert shown.wait(timeout=60) == 0
            running = steps_demo.start_stage(["-m", "alignment.calculator", "--check"], log)  # minutes of sandbox
            time.sleep(1.0)
            running.send_signal(signal.SIGTERM)
            assert running.wait(timeout=30) == -signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert "| model:" in log_path.read_text()
