"""Bad input, class by class, as a new user meets it: each ends in one sentence (`error: ...`, exit status 2)
before any long work, and an interrupted run keeps what it did."""

import dataclasses
import json
import os
import signal
from pathlib import Path

import pytest
import torch

from alignment import evaluate, models, plot, sft, train_rl
from alignment.args import AT_LEAST_ZERO, AT_MOST_ONE, POSITIVE, SCRIPTS, EIArgs, EvalArgs, RLArgs, SFTArgs, parse
from alignment.errors import UserError
from alignment.folders import read_jsonl
from alignment.run import Run
from tests.conftest import hold_lock, parity_reward
from tests.test_sft import tiny_args as tiny_sft_args
from tests.test_train_rl import tiny_args


def one_error_line(capsys, cls, argv) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse(cls, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err and err.startswith("error: "), err
    return err


def numeric_fields(cls):
    return [f for f in dataclasses.fields(cls) if any(t in str(f.type) for t in ("int", "float"))]


@pytest.mark.parametrize("cls", list(SCRIPTS.values()))
def test_every_number_has_a_range_and_one_outside_it_is_refused_by_name(cls, capsys):
    for f in numeric_fields(cls):
        assert f.name in POSITIVE | AT_LEAST_ZERO, f"--{f.name} has no declared range in alignment/args.py"
        bad = "0" if f.name in POSITIVE else "-1"
        assert f"--{f.name} " in one_error_line(capsys, cls, [f"--{f.name}", bad])
        if f.name in AT_MOST_ONE:
            assert "at most 1" in one_error_line(capsys, cls, [f"--{f.name}", "1.5"])
        if "float" in str(f.type):
            assert "finite" in one_error_line(capsys, cls, [f"--{f.name}", "nan"])


def test_unknown_flags_and_stray_words_say_what_was_meant(capsys):
    assert "did you mean --n_steps?" in one_error_line(capsys, RLArgs, ["--n_stepz", "3"])
    assert "--lr is a flag of alignment.sft and alignment.expert_iteration, not of this script; its own is " \
        "--learning_rate." in one_error_line(capsys, RLArgs, ["--lr", "1e-3"])
    assert "--lora_rank is a flag of alignment.sft and alignment.train_rl, not" in one_error_line(  # every owner
        capsys, EvalArgs, ["--lora_rank", "4"])
    assert "--loss_type is a flag of alignment.train_rl" in one_error_line(capsys, SFTArgs, ["--loss_type", "gspo"])
    assert "every option is a --flag" in one_error_line(capsys, EvalArgs, ["gsm8k"])
    assert "invalid int value" in one_error_line(capsys, RLArgs, ["--n_steps", "many"])
    assert "--save_every must be at least 1" in one_error_line(capsys, RLArgs, ["--save_every", "0"])


@pytest.mark.parametrize("module, argv, said", [
    ("plot", ["--bogus"], "the following arguments are required: run_dirs"),
    ("plot", ["run", "--x", "bogus"], "argument --x: invalid choice"),
    ("calculator", ["--bogus"], "unrecognized arguments: --bogus"), ("data", [], "required: command")])
def test_the_other_command_lines_complain_in_one_line_too(module, argv, said):
    """plot, calculator and data printed argparse's usage block above their error (a probe round, 2026-12-02)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-m", f"alignment.{module}", *argv], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parents[1])
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith("error: ")
    assert said in done.stderr and "usage:" not in done.stderr


def test_an_output_path_that_cannot_be_written_fails_before_the_work(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the output folder was checked")
    monkeypatch.setattr(models, "load_tokenizer", no_model)
    with pytest.raises(UserError, match="cannot write to"):
        evaluate.main(EvalArgs(model=tiny_model_dir, limit=2, max_tokens=2, output_dir=str(blocker / "eval")))
    with pytest.raises(UserError, match="cannot write to"):
        train_rl.main(tiny_args(tiny_model_dir, blocker / "rl"))
    with pytest.raises(UserError, match="cannot write to"):
        sft.main(tiny_sft_args(tiny_model_dir, blocker / "sft"))


def test_a_run_that_failed_before_its_first_step_does_not_block_the_next(tmp_path):
    args = RLArgs(output_dir=str(tmp_path / "run"))
    Run(args, "unused", "start-model")  # wrote config.json, then (say) the data failed to load
    Run(args, "unused", "start-model")  # the same command again: nothing there to lose
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(UserError, match="already holds a run"):
        Run(args, "unused", "start-model")


def test_damaged_files_end_in_one_sentence(tiny_model_dir, tmp_path, parity):
    import shutil
    for name in ("config.json", "model.safetensors"):
        damaged = tmp_path / f"model-{name}"
        shutil.copytree(tiny_model_dir, damaged)
        path = damaged / name
        path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])
        with pytest.raises(UserError, match="looks damaged or incomplete"):
            models.load_model(str(damaged))

    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=1))
    state = tmp_path / "run" / "checkpoint" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(UserError, match="trainer_state.pt is damaged"):
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "run", n_steps=2, resume=str(tmp_path / "run")))

    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 2, "rew')  # a crash cut the last line off mid-write
    assert len(read_jsonl(metrics)) == len(whole.splitlines())
    plot.plot(tmp_path / "run", tmp_path / "curves.png")
    metrics.write_text('{"step": 1, "rew\n' + whole)
    with pytest.raises(UserError, match="line 1 of .* is not JSON"):
        plot.plot(tmp_path / "run", tmp_path / "curves.png")


def send_at_call(signum, calls_before):
    """A reward function that sends this process `signum` at its call number `calls_before` + 1."""
    calls = {"n": 0}

    def reward(text, ground_truth):
        calls["n"] += 1
        if calls["n"] == calls_before + 1:
            os.kill(os.getpid(), signum)
        return parity_reward(text, ground_truth)
    return reward


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_rl_after_its_step_with_a_checkpoint_and_resume_goes_on(tiny_model_dir, tmp_path, parity,
                                                                             monkeypatch, signum):
    whole = tiny_args(tiny_model_dir, tmp_path / "whole", n_steps=3, save_every=10)
    train_rl.main(whole)
    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (send_at_call(signum, whole.rollout_batch_size), ()))
    # what the handlers were (SIG_IGN for SIGINT where the shell started the tests with `nohup ... &`)
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(SystemExit) as exit_info:  # the signal arrives while step 2 is scored
        train_rl.main(tiny_args(tiny_model_dir, tmp_path / "stopped", n_steps=3, save_every=10))
    assert exit_info.value.code == 128 + signum
    assert [m["step"] for m in read_jsonl(tmp_path / "stopped" / "metrics.jsonl")] == [1, 2]
    assert torch.load(tmp_path / "stopped" / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 2
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are put back

    monkeypatch.setitem(train_rl.PROMPT_SETTINGS, "r1_zero", (parity_reward, ()))
    train_rl.main(tiny_args(tiny_model_dir, tmp_path / "stopped", n_steps=3, save_every=10,
                            resume=str(tmp_path / "stopped")))
    a = models.load_model(str(tmp_path / "whole" / "checkpoint"))
    b = models.load_model(str(tmp_path / "stopped" / "checkpoint"))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, msg=name)


def test_a_signal_stops_sft_after_its_step_with_a_checkpoint(tiny_model_dir, data_dir, tmp_path, monkeypatch):
    real = sft.accumulate_gradients
    calls = {"n": 0}

    def interrupted_in_step_2(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args, **kwargs)
    monkeypatch.setattr(sft, "accumulate_gradients", interrupted_in_step_2)
    with pytest.raises(SystemExit) as exit_info:
        sft.main(tiny_sft_args(tiny_model_dir, tmp_path / "sft", epochs=2))  # 4 steps
    assert exit_info.value.code == 128 + signal.SIGINT
    assert torch.load(tmp_path / "sft" / "checkpoint" / "trainer_state.pt", weights_only=False)["step"] == 2


def test_evaluate_says_why_the_format_reward_is_zero(tiny_model_dir, data_dir, tmp_path, capsys):
    summary = evaluate.main(EvalArgs(model=tiny_model_dir, limit=2, max_tokens=3, output_dir=str(tmp_path / "eval"),
                                     precision="fp32"))
    assert summary["avg_format_rewards"] == 0
    assert "needs SFT first" in capsys.readouterr().out


@pytest.mark.parametrize("cls", list(SCRIPTS.values()))
def test_help_lists_every_flag_once_in_its_section_with_its_default_and_choices(cls, capsys, monkeypatch):
    from alignment.args import GROUPS
    monkeypatch.setenv("COLUMNS", "400")  # one line per flag
    with pytest.raises(SystemExit):
        parse(cls, ["--help"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    headers = [i for i, line in enumerate(lines) if line and not line.startswith(" ") and line.endswith(":")]
    titles = [lines[i][:-1] for i in headers]
    known = [t for t in titles if t in GROUPS]
    assert known == [t for t in GROUPS if t in known] and len(known) >= 4, titles  # sections in GROUPS' order
    entries = {}  # line number of a flag -> its whole entry (a long metavar pushes the help to the next line)
    for i, line in enumerate(lines):
        if line.startswith("  -"):
            entries[i] = line
        elif line.startswith("    ") and entries:
            entries[max(entries)] += " " + line.strip()
    for f in dataclasses.fields(cls):
        found = [(i, e) for i, e in entries.items() if e.split()[0] == f"--{f.name}"]
        assert len(found) == 1, (f.name, found)
        where, line = found[0]
        section = titles[max(k for k, i in enumerate(headers) if i < where)]
        named = [t for t, names in GROUPS.items() if f.name in names]
        assert section == (f.metadata.get("group") or (named[0] if named else section))
        assert line.count("(default:") <= 1
        if f.default not in (None, False):
            assert "(default:" in line, line
        if f.metadata.get("choices"):
            assert "{" + ",".join(map(str, f.metadata["choices"])) + "}" in line


def test_choices_are_checked_by_name_and_hyphens_mean_underscores(capsys):
    assert "--loss_type 'ppo' is not one of" in one_error_line(capsys, RLArgs, ["--loss_type", "ppo"])
    assert "--async_steps 2 is not one of 0, 1" in one_error_line(capsys, RLArgs, ["--async_steps", "2"])
    args = parse(RLArgs, ["--sampling-max-tokens=7", "--rollout-mode", "tir", "--prompt", "tir", "--no-mask-observations",
                          "--rollout-is", "none", "--dataset", "rg:a-b"])
    assert args.sampling_max_tokens == 7 and not args.mask_observations and args.dataset == "rg:a-b"
    assert "did you mean --rollout_is?" in one_error_line(capsys, RLArgs, ["--rollout_i", "mask"])  # no abbreviations


def test_a_second_ctrl_c_ends_in_one_line_without_a_traceback(capsys):
    from alignment.errors import cli

    def interrupted(args):  # outside a run (loading a model, say): nothing was saved, and no line says so
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as exit_info:
        cli(interrupted, None)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 130 and err == "stopped." and "Traceback" not in err

    def in_a_run(args):  # a run says what it kept (run.py's Run._lost)
        raise KeyboardInterrupt("stopped at once: the step in progress is lost; the last checkpoint is kept: "
                                "continue with --resume runs/x")
    with pytest.raises(SystemExit) as exit_info:
        cli(in_a_run, None)
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("--resume runs/x") and exit_info.value.code == 130


def test_a_second_sigterm_exits_143_as_a_shell_expects(capsys, tmp_path):
    """Two SIGTERMs (a scheduler's, a `kill`) stop at once with 128 + 15, not Ctrl-C's 130."""
    from alignment.errors import cli

    def in_a_run(args):
        run = Run(RLArgs(output_dir=str(tmp_path / "run")), "rl", "m")
        run._on_signal(signal.SIGTERM, None)
        run.signal_time -= 5  # a second one, seconds later
        run._on_signal(signal.SIGTERM, None)
    with pytest.raises(SystemExit) as exit_info:
        cli(in_a_run, None)
    assert exit_info.value.code == 143 and "nothing in" in capsys.readouterr().err


def test_flags_that_another_flag_makes_moot_are_refused_by_the_value_given(capsys, tmp_path):
    from alignment import train_rl
    from alignment.errors import UserError
    assert "--lora_alpha 16 shape LoRA adapters, but --lora_rank 0" in one_error_line(capsys, RLArgs, ["--lora_alpha", "16"])
    assert "drop them" in one_error_line(capsys, SFTArgs, ["--lora_dropout", "0.1", "--lora_target_modules", "q_proj"])
    assert "--rollout_is_threshold must be above 1, not 0.0" in one_error_line(capsys, RLArgs, ["--rollout_is_threshold", "0"])
    assert "--rollout_is_threshold must be above 1, not 0.5" in one_error_line(capsys, RLArgs, ["--rollout_is_threshold", "0.5"])
    assert "none (implied by --loss_type no_baseline)" in one_error_line(
        capsys, RLArgs, ["--loss_type", "no_baseline", "--group_size_max", "8"])
    for cls in (RLArgs, EIArgs):  # evaluation flags a run without evaluation never reads (probe round 4)
        for flags in (["--eval_max_tokens", "64"], ["--no_eval_before_train"]):  # named as typed
            assert f"{' '.join(flags)} has no effect with --eval_every 0 (no evaluation): drop it" in one_error_line(
                capsys, cls, ["--eval_every", "0", *flags])
    # not --eval_limit: its questions are still held out of training, and the start line says why
    assert parse(RLArgs, ["--eval_every", "0", "--eval_limit", "50"]).eval_limit == 50
    args = RLArgs(bf16_weights=True, output_dir=str(tmp_path / "run"), precision="fp32")
    with pytest.raises(UserError, match="--bf16_weights keeps bf16 parameters on a GPU"):
        train_rl.main(args)


@pytest.mark.slow  # starts `uv run -m alignment.train_rl` as a user does, then signals its process group
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_process_group_under_uv_run_is_one_press(tiny_model_dir, tmp_path, signum):
    """`timeout`, `kill -- -PGID` and Slurm signal the whole group, and `uv run` forwards the signal to its
    child too: the run gets it twice within a moment. It must stop after its step, with a checkpoint, and
    say so; then `--resume` goes on from it."""
    import shutil
    import subprocess
    import time
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not on PATH")
    run_dir = tmp_path / "run"
    flags = ["--model", tiny_model_dir, "--n_steps", "200", "--group_size", "2", "--rollout_batch_size", "4",
             "--train_batch_size", "4", "--train_mini_batch_size", "2", "--sampling_max_tokens", "4", "--eval_every",
             "0", "--save_every", "1000", "--rg_size", "40", "--precision", "fp32", "--output_dir", str(run_dir)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([uv, "run", "--no-sync", "-m", "alignment.train_rl", *flags], cwd=Path(__file__).parents[1],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.time() + 300
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text().count("\n") >= 2:
        assert process.poll() is None and time.time() < deadline, process.stdout.read()[-3000:]
        time.sleep(0.5)
    os.killpg(process.pid, signum)  # the group gets it, and uv forwards it again
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 128 + signum, output[-3000:]
    assert "stopped at once" not in output and "checkpoint saved: continue with --resume " + str(run_dir) in output
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=False)
    steps = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert state["step"] == steps[-1] >= 2
    done = subprocess.run([uv, "run", "--no-sync", "-m", "alignment.train_rl", *flags[:2], "--n_steps", str(steps[-1] + 1),
                           *flags[4:], "--resume", str(run_dir)], cwd=Path(__file__).parents[1], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")][-1] == steps[-1] + 1


@pytest.mark.parametrize("script", ["train_rl", "sft", "expert_iteration", "evaluate"])
def test_a_vllm_context_too_short_for_the_prompts_is_refused_before_weights_load(script, tiny_model_dir, tmp_path,
                                                                                 data_dir, monkeypatch):
    from alignment import expert_iteration
    from tests.test_expert_iteration import tiny_args as tiny_ei_args
    module = {"train_rl": train_rl, "sft": sft, "expert_iteration": expert_iteration, "evaluate": evaluate}[script]
    monkeypatch.setattr(module, "pick_backend", lambda backend, device: "vllm")  # no engine is ever started
    for name in ("load_model", "load_policy", "load_policy_model"):
        monkeypatch.setattr(models, name, lambda *a, **k: pytest.fail("weights would load"))
    monkeypatch.setattr(module, "make_sampler", lambda *a, **k: pytest.fail("the engine would start"))
    args = {"train_rl": lambda: tiny_args(tiny_model_dir, tmp_path / "run", backend="vllm", vllm_max_model_len=40),
            "sft": lambda: tiny_sft_args(tiny_model_dir, tmp_path / "run", backend="vllm", vllm_max_model_len=40),
            "expert_iteration": lambda: tiny_ei_args(tiny_model_dir, tmp_path / "run", backend="vllm",
                                                     vllm_max_model_len=40),
            "evaluate": lambda: EvalArgs(model=tiny_model_dir, limit=2, output_dir=str(tmp_path / "run"),
                                         backend="vllm", vllm_max_model_len=40, data_dir=data_dir)}[script]()
    with pytest.raises(UserError, match="--vllm_max_model_len 40 cannot hold the longest prompt"):
        module.main(args)


def interruptible():
    """In the child: Ctrl-C as in a terminal, even where the tests run in a background job (nohup, `cmd &`), whose
    children inherit SIGINT ignored (and a script then rightly leaves it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_ctrl_c_while_a_script_starts_ends_in_one_line(tmp_path, signum):
    """`python -m alignment.<script>` interrupted (Ctrl-C, or a `kill`: probe round 5 saw a silent exit) while it
    still imports torch or generates its data: one line, no traceback, 128 + the signal."""
    import subprocess
    import sys
    code = ("import sys; sys.argv = ['-m']; import alignment, os, signal, time; sys.argv = ['x']; "
            f"os.kill(os.getpid(), {int(signum)}); time.sleep(10)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[1], preexec_fn=interruptible)
    assert done.returncode == 128 + signum and "Traceback" not in done.stderr
    assert done.stderr.strip() == "interrupted outside a training step: the work in progress is not saved " \
                                  "(checkpoints and results saved before are kept)."


def test_an_interrupt_delivered_twice_while_a_script_starts_ends_in_one_line(tmp_path):
    """uv forwards the SIGINT that the process group also got: two arrive, the second while the interpreter
    shuts down (waiting for a thread here, as a loading script does): still one line, no traceback."""
    import subprocess
    import sys
    import time
    code = ("import sys; sys.argv = ['-m']; import alignment, threading, time; sys.argv = ['x']; "
            "threading.Thread(target=time.sleep, args=(2,)).start(); print('ready', flush=True); time.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[1], preexec_fn=interruptible)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGINT)
    time.sleep(0.3)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130 and "Traceback" not in stderr and stderr.count("interrupted") == 1, stderr


def test_a_seed_torch_cannot_take_is_refused_when_parsed(capsys):
    for seed in (str(2**63), "-1"):
        with pytest.raises(SystemExit):
            parse(RLArgs, ["--seed", seed])
        err = capsys.readouterr().err
        assert "--seed must be 0 or more" in err and f"not {seed}" in err


def test_a_train_batch_the_default_mini_batch_does_not_divide_names_the_default(capsys):
    """"--train_batch_size 4 must be a multiple of --train_mini_batch_size 8" named a flag never given (round 9)."""
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--train_batch_size", "4", "--rollout_batch_size", "8", "--group_size", "4"])
    assert "--train_mini_batch_size 8 (its default): pass a --train_mini_batch_size that divides it" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse(RLArgs, ["--train_batch_size", "4", "--rollout_batch_size", "8", "--group_size", "4",
                       "--train_mini_batch_size", "3"])
    assert "--train_mini_batch_size 3." in capsys.readouterr().err


def test_evaluate_refuses_a_training_runs_folder_and_one_another_evaluate_holds(tiny_model_dir, tmp_path, data_dir):
    run_dir = tmp_path / "rl"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"script": "train_rl", "output_dir": str(run_dir), "start_model": "m"}))
    with pytest.raises(UserError, match="is a training run's folder"):
        evaluate.main(EvalArgs(model=tiny_model_dir, limit=1, max_tokens=2, output_dir=str(run_dir), data_dir=data_dir))
    mine = tmp_path / "mine"  # a user's own files are not called a training run, and are never written over
    mine.mkdir()
    (mine / "config.json").write_text('{"mine": 1}')
    (mine / "thesis.tex").write_text("")
    with pytest.raises(UserError, match=r"holds files evaluate did not write \(config.json, thesis.tex\)"):
        evaluate.main(EvalArgs(model=tiny_model_dir, limit=1, max_tokens=2, output_dir=str(mine), data_dir=data_dir))
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "thesis.tex"]
    failed = tmp_path / "failed"  # refused after its folder was locked: no empty folder is left behind
    with pytest.raises(UserError, match="cannot hold the longest prompt"):
        evaluate.main(EvalArgs(model=tiny_model_dir, limit=1, max_tokens=100_000, output_dir=str(failed),
                               data_dir=data_dir))
    assert not failed.exists()
    out = tmp_path / "eval"
    holder = hold_lock(out)
    try:
        with pytest.raises(UserError, match=f"{out} is being written by another run"):
            evaluate.main(EvalArgs(model=tiny_model_dir, limit=1, max_tokens=2, output_dir=str(out), data_dir=data_dir))
    finally:
        holder.kill()
        holder.wait()
    assert not (out / "results.jsonl").exists()


def test_a_test_only_dataset_for_training_names_what_to_do(tiny_model_dir, tmp_path, data_dir):
    args = tiny_args(tiny_model_dir, tmp_path / "run", dataset="aime24", data_dir=data_dir)
    with pytest.raises(UserError, match="aime24 has only a test split: evaluate on it .* train on gsm8k or an rg:"):
        train_rl.main(args)


@pytest.mark.parametrize("script", ["evaluate", "train_rl"])
def test_answers_longer_than_the_models_context_are_refused_before_weights_load(script, tiny_model_dir, tmp_path,
                                                                                  data_dir, monkeypatch):
    """HF generated on for minutes and vLLM cut answers short without a word (probe round 2): the tiny model's
    context is 2048 tokens."""
    for name in ("load_model", "load_policy", "load_policy_model"):
        monkeypatch.setattr(models, name, lambda *a, **k: pytest.fail("weights would load"))
    args = (EvalArgs(model=tiny_model_dir, limit=2, max_tokens=3000, output_dir=str(tmp_path / "e"), data_dir=data_dir)
            if script == "evaluate" else tiny_args(tiny_model_dir, tmp_path / "run", eval_max_tokens=3000))
    with pytest.raises(UserError, match=r"the model's context \(2048 tokens, its max_position_embeddings\) cannot "
                                        r"hold the longest prompt \(\d+ tokens\) and an answer of up to 3000"):
        {"evaluate": evaluate, "train_rl": train_rl}[script].main(args)


def test_a_prompt_longer_than_the_context_names_its_question_instead_of_an_answer_length_of_0(tiny_model_dir,
                                                                                                 tokenizer):
    """A 90,102-token prompt once got `lower the answer length to at most 0`."""
    rows = [{"question": "What is 1 + 1?", "answer": "2"}, {"question": "Long story. " + "word " * 3000, "answer": "1"}]
    with pytest.raises(UserError) as refused:
        evaluate.check_context(None, tokenizer, rows, "r1_zero", False, 1, tiny_model_dir)
    message = str(refused.value)
    assert "shorten or drop the question starting 'Long story. word word" in message, message
    assert "its prompt alone fills the 2048 tokens" in message and "at most 0" not in message
    with pytest.raises(UserError, match=r"raise it to at least \d+, or shorten or drop the question starting 'Long"):
        evaluate.check_context(4000, tokenizer, rows, "r1_zero", False, 2000, tiny_model_dir)


@pytest.mark.parametrize("cls, argv, moot", [
    (EvalArgs, ["--temperature", "0", "--top_p", "0.5"], "--top_p 0.5 has no effect with --temperature 0"),
    (EvalArgs, ["--tool_timeout", "3"], "--tool_timeout 3.0 has no effect outside --rollout_mode tir"),
    (EvalArgs, ["--delethink_chunk_size", "100"], "--delethink_chunk_size 100 has no effect outside --rollout_mode delethink"),
    (RLArgs, ["--gamma", "0.9"], "--gamma 0.9 has no effect outside gae and reinforce_pp"),
    (RLArgs, ["--critic_learning_rate", "1e-4"], "--critic_learning_rate 0.0001 has no effect outside --advantage_estimator gae"),
    (RLArgs, ["--kl_coef", "0", "--kl_estimator", "k2"], "--kl_estimator k2 has no effect with --kl_coef 0"),
    (SFTArgs, ["--eval_limit", "0", "--eval_max_tokens", "64"], "--eval_max_tokens 64 has no effect with --eval_limit 0"),
    (SFTArgs, ["--train_file", "x.jsonl", "--dataset", "rg:chain_sum"], "--dataset rg:chain_sum has no effect with --train_file"),
    (SFTArgs, ["--rg_size", "100"], "--rg_size 100 has no effect with --dataset gsm8k"),
    (SFTArgs, ["--worked_style", "rewrite"], "--worked_style rewrite has no effect with --dataset gsm8k"),
    # delethink's chunks bound a trace: a length flag there was silently ignored
    (RLArgs, ["--rollout_mode", "delethink", "--sampling_max_tokens", "64"],
     "--sampling_max_tokens 64 has no effect in --rollout_mode delethink, whose chunks bound a trace: up to 24576 "
     "thinking tokens (5 chunks: 8192 tokens, then 4096 after a carryover of 4096)"),
    (RLArgs, ["--rollout_mode", "delethink", "--eval_max_tokens", "64"], "--eval_max_tokens 64 has no effect in --rollout_mode delethink"),
    (EvalArgs, ["--rollout_mode", "delethink", "--max_tokens", "64"], "--max_tokens 64 has no effect in --rollout_mode delethink"),
    (RLArgs, ["--dataset", "gsm8k", "--rg_size", "100"], "--rg_size 100 has no effect with --dataset gsm8k (not an rg: task)"),
    (EIArgs, ["--dataset", "gsm8k", "--rg_size", "100"], "--rg_size 100 has no effect with --dataset gsm8k (not an rg: task)"),
    (EvalArgs, ["--backend", "vllm", "--hf_decoding", "loop"], "--hf_decoding loop has no effect with --backend vllm"),
    (SFTArgs, ["--hf_decoding", "static", "--eval_limit", "0"], "--hf_decoding static has no effect with --eval_limit 0"),
    (SFTArgs, ["--eval_batch_size", "8", "--eval_limit", "0"], "--eval_batch_size 8 has no effect with --eval_limit 0"),
    (SFTArgs, ["--dataset", "rg:chain_sum", "--worked_style", "tool", "--delethink_chunk_size", "16"],
     "--delethink_chunk_size with --worked_style tool makes rows no rollout mode uses"),
    (SFTArgs, ["--dataset", "rg:products:max_digits=99999"], "max_digits=99999 is above 1,000"),
])
def test_a_flag_that_another_flag_makes_moot_is_refused_not_dropped(cls, argv, moot, capsys):
    with pytest.raises(SystemExit):
        parse(cls, argv)
    assert moot in capsys.readouterr().err


def test_flags_that_do_act_are_still_taken(capsys):
    assert parse(RLArgs, ["--advantage_estimator", "gae", "--gamma", "0.9", "--lam", "0.95"]).lam == 0.95
    assert parse(EvalArgs, ["--temperature", "0.6", "--top_p", "0.9"]).top_p == 0.9
    assert parse(SFTArgs, ["--dataset", "rg:chain_sum", "--rg_size", "100"]).rg_size == 100
    assert "--rg_size 10000000 is above 100,000 problems" in one_error_line(capsys, RLArgs, ["--rg_size", "10000000"])
    assert "--filter_low 0.9 is above --filter_high 0.1: no group's accuracy is in between" in one_error_line(
        capsys, RLArgs, ["--filter_low", "0.9", "--filter_high", "0.1"])
    assert "--group_size 1 leaves --advantage_estimator rloo no group" in one_error_line(
        capsys, RLArgs, ["--group_size", "1", "--rollout_batch_size", "8", "--train_batch_size", "8",
                         "--advantage_estimator", "rloo"])
    assert parse(RLArgs, ["--group_size", "1", "--rollout_batch_size", "8", "--train_batch_size", "8",
                          "--loss_type", "no_baseline"]).group_size == 1  # REINFORCE needs no group
    for cls in (RLArgs, SFTArgs, EIArgs, EvalArgs):  # no vLLM engine, no engine options
        assert "--vllm_max_model_len 64 has no effect with --backend hf" in one_error_line(
            capsys, cls, ["--backend", "hf", "--vllm_max_model_len", "64"])
    assert "--vllm_enforce_eager has no effect with --backend hf" in one_error_line(
        capsys, RLArgs, ["--backend", "hf", "--vllm_enforce_eager"])
    assert parse(EvalArgs, ["--rollout_mode", "tir", "--prompt", "tir", "--tool_timeout", "3"]).tool_timeout == 3
    # SFT's worked solutions exist for three tasks: another is refused when parsed, not after a suggestion of
    # rg:gsm_symbolic that then failed on its first question; so is a chain of one number
    for spec in ("rg:unknown_task", "rg:gsm_symbolic"):
        assert f"--dataset {spec}: SFT writes worked solutions only for rg:chain_sum, rg:basic_arithmetic, rg:products, " \
            "rg:repeated_addition and rg:add_until" in one_error_line(capsys, SFTArgs, ["--dataset", spec])
    for task in ("rg:repeated_addition", "rg:add_until"):
        assert "pass --worked_style counted" in one_error_line(capsys, SFTArgs, ["--dataset", task])
    assert parse(SFTArgs, ["--dataset", "rg:repeated_addition", "--worked_style", "counted"]).worked_style == "counted"
    assert "a worked solution needs two or more numbers; set min_terms=2" in one_error_line(
        capsys, SFTArgs, ["--dataset", "rg:chain_sum:min_terms=1,max_terms=1"])
    assert parse(SFTArgs, ["--dataset", "rg:chain_sum:min_terms=2,max_terms=3"]).dataset.endswith("max_terms=3")
    assert parse(RLArgs, ["--dataset", "rg:gsm_symbolic"]).dataset == "rg:gsm_symbolic"  # RL needs no worked solution


def test_delethink_bounds_its_chunks_and_says_its_budget(capsys):
    """1-token chunks x 1,000 turns kept evaluate on one question for minutes, and its start line said "max 256
    tokens", a flag delethink ignores."""
    argv = ["--rollout_mode", "delethink", "--delethink_chunk_size", "2", "--delethink_carryover", "1",
            "--delethink_keep_head", "0"]
    assert "--delethink_max_turns 1000 is above 64" in one_error_line(capsys, EvalArgs, argv + ["--delethink_max_turns", "1000"])
    args = parse(EvalArgs, ["--rollout_mode", "delethink", "--delethink_chunk_size", "32", "--delethink_carryover", "16",
                            "--delethink_keep_head", "0", "--delethink_max_turns", "4"])
    assert args.delethink_budget() == "up to 80 thinking tokens (4 chunks: 32 tokens, then 16 after a carryover of 16)"


def test_a_negative_number_reaches_the_range_check(capsys):
    """argparse took `-1e-5` for a flag and said "expected one argument"."""
    assert "--learning_rate must be greater than 0, not -1e-05" in one_error_line(capsys, RLArgs, ["--learning_rate", "-1e-5"])
    assert parse(RLArgs, ["--learning_rate", "1e-5"]).learning_rate == 1e-5


@pytest.mark.parametrize("logger", ["wandb", "tensorboard"])
def test_a_logger_whose_package_is_missing_is_one_line_before_the_folder_is_touched(logger, tiny_model_dir, tmp_path):
    import importlib.util
    from alignment import train_rl
    if importlib.util.find_spec(logger) is not None:
        pytest.skip(f"{logger} is installed here")
    args = parse(RLArgs, ["--model", tiny_model_dir, "--logger", logger, "--output_dir", str(tmp_path / "run")])
    with pytest.raises(UserError, match=f"--logger {logger} needs the {logger} package.*`uv pip install {logger}`"):
        train_rl.main(args)
    assert not (tmp_path / "run").exists()


def test_a_file_given_as_the_model_is_called_a_file(tmp_path):
    from alignment import models
    (tmp_path / "weights.bin").write_text("")
    with pytest.raises(UserError, match="is a file; pass a model folder"):
        models.resolve_model(str(tmp_path / "weights.bin"))


def test_a_delethink_chunk_longer_than_the_models_context_is_refused_before_any_work(tiny_model_dir, tmp_path,
                                                                                   data_dir):
    """Each delethink chunk is one call of prompt + C tokens: 8,192-token chunks on a 2,048-token model once ran
    for minutes, generating past the model's context."""
    from alignment import evaluate
    args = parse(EvalArgs, ["--model", tiny_model_dir, "--rollout_mode", "delethink", "--limit", "1",
                            "--data_dir", str(data_dir), "--output_dir", str(tmp_path / "eval")])
    with pytest.raises(UserError, match=r"cannot hold the longest prompt \(\d+ tokens\) and an answer of up to 8192 "
                                        r"tokens: lower --delethink_chunk_size to at most"):
        evaluate.main(args)


def test_a_malformed_rg_spec_is_refused_with_the_flags_before_any_folder(capsys):
    assert "max_terms is given twice" in one_error_line(capsys, RLArgs, ["--dataset", "rg:chain_sum:max_terms=3,max_terms=5"])
    assert "write task options as key=value" in one_error_line(capsys, EvalArgs, ["--dataset", "rg:chain_sum:max_terms"])
