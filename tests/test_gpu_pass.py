"""bench/gpu_pass.py's CPU dry run: every stage of the GPU pass (the gpu tests, train_rl with --precision auto,
the 1.5B-shaped run at a tiny size, torchrun with one process on gloo and its resume, SFT, evaluation) runs
and passes its checks, so a change that would break the pass fails here instead of on a lent GPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"pytest", "rl", "qwen_shape", "fsdp", "fsdp_resume", "sft", "evaluate"}


@pytest.mark.slow  # about 5 minutes on 2 cores: seven processes, two of them under torchrun
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
    assert "skipped" in stages["pytest"]["summary"]  # no CUDA here: the gpu tests skip, cleanly
    assert "[gpu_pass] done" in (tmp_path / "out" / "log.txt").read_text()
