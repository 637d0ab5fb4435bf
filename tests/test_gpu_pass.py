"""bench/gpu_pass.py's CPU dry run: every stage of the GPU pass (the gpu tests, train_rl with --precision auto,
the 1.5B-shaped run at a tiny size, torchrun with one process on gloo and its resume, SFT, evaluation, the
decode rate, bench/rl_step.py against TRL) runs and passes its checks, so a change that would break the pass fails here instead of on a lent GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"pytest", "rl", "qwen_shape", "qwen_compiled", "fsdp", "fsdp_resume", "sft", "evaluate", "sampler", "trl"}


@pytest.mark.slow  # about 7 minutes on 2 cores: ten processes, two of them under torchrun
def test_the_gpu_pass_runs_every_stage_on_the_cpu(data_dir, tmp_path):
    done = subprocess.run([sys.executable, "bench/gpu_pass.py", "run", "--device", "cpu", "--tiny", "--budget", "1200",
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          cwd=ROOT, capture_output=True, text=True, timeout=1500)
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    failed = {name: r.get("error") for name, r in results["stages"].items() if not r["ok"]}
    assert done.returncode == 0 and not failed, (failed, done.stdout[-3000:])
    assert set(results["stages"]) == STAGES
    stages = results["stages"]
    assert stages["rl"]["master_weights"] == "fp32" and stages["rl"]["eval_steps"] == [0, 5]
    assert stages["fsdp"]["backend"] == "gloo" and stages["fsdp_resume"]["steps"] == [1, 2, 3]
    assert stages["qwen_shape"]["train_mfu"] > 0 and stages["qwen_shape"]["generated_tokens_per_s"] > 0
    assert stages["qwen_compiled"]["train_mfu"] > 0 and stages["qwen_compiled"]["s_train_first"] > 0
    assert stages["trl"]["ours"]["tokens"] == stages["trl"]["trl"]["tokens"] == 4 * 8  # the same work on both sides
    assert "skipped" in stages["pytest"]["summary"]  # no CUDA here: the gpu tests skip, cleanly
    assert "[gpu_pass] done" in (tmp_path / "out" / "log.txt").read_text()


def _gpu_pass(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "bench/gpu_pass.py", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("argv, message", [
    (["--devcie", "cpu"], "unrecognized arguments: --devcie"),  # once ignored: the pass ran on --device cuda
    (["--dev", "cpu"], "unrecognized arguments: --dev"),  # no abbreviations either
    (["--budget", "-5"], "no stage would start"),
    (["--budget", "nan"], "no stage would start"),
    (["--only", "rl,bogus"], "no stage called 'bogus'"),  # once: "every stage ok" having run none
    # a rerun of one stage: what it reads lived in the last pass's temporary folder, gone with it
    (["--only", "evaluate"], "--only evaluate needs the sft stage too"),
    (["--only", "rl,fsdp_resume"], "needs the fsdp stage too (it reads what fsdp makes in the pass's own work folder): "
                                   "--only fsdp,rl,fsdp_resume"),
])
def test_the_pass_refuses_a_bad_flag_before_it_writes_anything(argv, message, tmp_path):
    done = _gpu_pass("run", "--out", str(tmp_path / "out"), *argv)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "out").exists()


def test_the_pass_never_overwrites_an_earlier_pass(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "log.txt").write_text("an earlier pass\n")
    done = _gpu_pass("run", "--device", "cpu", "--tiny", "--out", str(tmp_path / "out"))
    assert done.returncode != 0 and "holds an earlier pass's log.txt" in done.stderr, done.stderr
    assert (tmp_path / "out" / "log.txt").read_text() == "an earlier pass\n"
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "mine.txt").write_text("kept")  # an earlier pass's models and runs: refused up front
    done = _gpu_pass("run", "--device", "cpu", "--tiny", "--out", str(tmp_path / "out2"), "--work", str(tmp_path / "work"))
    assert done.returncode == 2 and "is not empty (an earlier pass's models and runs" in done.stderr, done.stderr
    assert not (tmp_path / "out2").exists()
    import torch
    if torch.cuda.is_available():
        return
    done = _gpu_pass("run", "--out", str(tmp_path / "new"))  # no CUDA here: said before any file is written
    assert done.returncode != 0 and "torch sees no CUDA device" in done.stderr, done.stderr
    assert not (tmp_path / "new").exists()


def test_the_allocator_record_has_one_entry_per_train_phase(monkeypatch):
    """The rl and qwen stages record, for each step's train phase (experience, then update), its seconds and the
    CUDA allocator's device allocations and frees during it; here with the CUDA calls stood in for."""
    import importlib.util
    import types

    import torch
    spec = importlib.util.spec_from_file_location("gpu_pass", ROOT / "bench" / "gpu_pass.py")
    gpu_pass = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_pass)
    allocator = {"num_device_alloc": 0, "num_device_free": 0}
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: dict(allocator))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 3 * 2**30)

    def build_experience(*args):
        allocator["num_device_alloc"] += 2
        return "experience"

    def _update(*args):
        allocator["num_device_free"] += 1
        return 0
    train_rl = types.SimpleNamespace(build_experience=build_experience, _update=_update)
    phases = gpu_pass._allocator_per_train_phase(train_rl)
    for _ in range(3):  # the loop calls them through the module, as train_rl's step does
        assert train_rl.build_experience() == "experience" and train_rl._update() == 0
    assert [(p["device_allocs"], p["device_frees"], p["reserved_gib"]) for p in phases] == [(2, 1, 3.0)] * 3
    assert all(p["s"] >= 0 for p in phases)
