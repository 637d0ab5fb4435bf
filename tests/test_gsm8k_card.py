"""bench/gsm8k_card.py (issue 76): the interval on hand-computed counts, which stages --stages takes, the tool
statistics' heuristics, and (slow) the driver's smoke run on a tiny model in both arms, stopped and resumed."""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gsm8k_card  # noqa: E402


def test_wilson_interval_on_hand_computed_counts():
    # 5 of 10: centre (0.5 + 1.96^2 / 20) / (1 + 1.96^2 / 10) = 0.5; half 1.96 sqrt(0.025 + 1.96^2 / 400) / 1.38416
    low, high = gsm8k_card.wilson(5, 10)
    assert math.isclose(low, 0.236590, abs_tol=1e-6) and math.isclose(high, 0.763410, abs_tol=1e-6)
    # 0 of 10: the interval is [0, z^2 / (n + z^2)] = [0, 3.8416 / 13.8416], not the normal approximation's point 0
    assert gsm8k_card.wilson(0, 10) == (0.0, pytest.approx(3.8416 / 13.8416))
    assert gsm8k_card.wilson(10, 10) == (pytest.approx(10 / 13.8416), 1.0)
    # nanochat's RL figure on the whole test split: 100 of 1,319 right is 0.0758 in [0.0627, 0.0914]
    low, high = gsm8k_card.wilson(100, 1319)
    assert round(low, 4) == 0.0627 and round(high, 4) == 0.0914
    assert all(math.isnan(x) for x in gsm8k_card.wilson(0, 0))


@pytest.mark.parametrize("kinds, expected", [
    (["sft", "eval"], {"sft-text", "eval-sft-text", "pass8-sft-text"}),
    (["sft"], {"sft-text"}),
    (["eval"], {"eval-sft-text", "pass8-sft-text", "eval-rl-text-seed0", "pass8-rl-text-seed0"}),
    (["rl"], {"rl-text-seed0"}),
    (["rl", "eval"], {"rl-text-seed0", "eval-rl-text-seed0", "pass8-rl-text-seed0"}),
])
def test_stages_takes_the_kinds_named_and_the_evaluations_of_their_models(kinds, expected, tmp_path):
    args = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--stages", *kinds, "--out", str(tmp_path / "c")])
    assert {stage.name for stage in gsm8k_card.plan(args, args.out)} == expected


def test_every_rl_stage_reads_its_arms_sft_and_the_test_split_is_never_a_training_set(tmp_path):
    args = gsm8k_card.parse_args(["--out", str(tmp_path / "c")])
    stages = {stage.name: stage for stage in gsm8k_card.plan(args, args.out)}
    for arm in ("text", "tool"):
        for seed in (0, 1, 2):
            rl = stages[f"rl-{arm}-seed{seed}"]
            assert rl.reads == (f"sft-{arm}",) and rl.command[rl.command.index("--model") + 1] == str(args.out / f"sft-{arm}")
            assert rl.command[rl.command.index("--dataset") + 1] == "gsm8k" and "--eval_dataset" not in rl.command
        assert ("--rollout_mode" in stages[f"rl-{arm}-seed0"].command) == (arm == "tool")
    for stage in stages.values():  # evaluations read the test split (evaluate's default), training the train split
        assert "--split" not in stage.command


def test_bad_flags_are_one_line(tmp_path, capsys):
    for argv in (["--sft_examples", "12"], ["--limit", "-1"], ["--seeds", "0", "0"], ["--rl_flags", "--n_steps 3"],
                 ["--arms", "maths"], ["--rl_steps", "0"]):
        with pytest.raises(SystemExit) as exit:
            gsm8k_card.parse_args(argv + ["--out", str(tmp_path / "c")])
        assert exit.value.code == 2
        err = capsys.readouterr().err  # one line, not argparse's usage block above it
        assert len(err.strip().splitlines()) == 1 and "error: " in err and "usage:" not in err, err
        if "--rl_flags" in argv:
            assert "--rl_flags may not set --n_steps" in err


def test_rl_without_its_sft_says_to_run_the_sft_stage(tmp_path, capsys):
    """`--stages rl` before any SFT failed inside train_rl, whose message suggested --model (moot here). A usage
    error: exit 2 and one line, as a bad flag's (it was exit 1)."""
    args = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--stages", "rl", "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit) as exit:
        gsm8k_card.check_inputs(args)
    [line] = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and line.endswith(" error: rl-text-seed0 reads sft-text, which has not finished: run "
                                                  "--stages sft (or add sft to --stages) first."), line
    gsm8k_card.check_inputs(gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--stages", "sft", "rl",
                                                   "--out", str(tmp_path / "c")]))  # it runs first: fine


def test_ignores_output_reads_the_printed_numbers_and_the_box():
    quoted = "x\n```python\nprint(48/2)\n```\n```output\n24.0\n```\nSo 24 clips. The answer is \\boxed{24}."
    assert not gsm8k_card.ignores_output(quoted)  # 24 is 24.0
    assert gsm8k_card.ignores_output(quoted.replace("\\boxed{24}", "\\boxed{25}"))
    assert not gsm8k_card.ignores_output("no code. The answer is \\boxed{3}.")  # no output: not counted
    # the box as the grader reads it: a unit, a dollar sign, a thousands comma (float() of the box counted the first two)
    printed = "```python\nprint(12 + 6)\n```\n```output\n18\n```\nSo "
    for box in ("18 apples", "\\$18", "$18", "18.00", "\\text{18 apples}"):
        assert not gsm8k_card.ignores_output(printed + f"\\boxed{{{box}}}."), box
    for box in ("19 apples", "\\$19", "18 or 19"):
        assert gsm8k_card.ignores_output(printed + f"\\boxed{{{box}}}."), box
    assert not gsm8k_card.ignores_output("```output\n1,200\n```\n\\boxed{1200}")
    assert gsm8k_card.outputs("```output\n1,200 and 3.5\n```") == ["1200", "3.5"]


def test_failure_kinds_and_the_failures_file(tmp_path):
    records = [{"prompt": f"User: q{i}\nAssistant:", "response": "r", "ground_truth": "1", "problem": i,
                "answer_reward": 0.0, "format_reward": 1.0, "finish_reason": "stop", "stats": {}} for i in range(120)]
    records[0]["finish_reason"] = "length"
    records[2]["format_reward"] = 0.0
    records[4]["stats"] = {"exec_errors": 1}
    records.append({**records[1], "answer_reward": 1.0, "problem": 999})  # a right answer is never a failure
    tally = gsm8k_card.write_failures("eval-x", records, tmp_path)
    text = (tmp_path / "failures-eval-x.md").read_text()
    assert sum(tally.values()) == 50 and text.count("## problem") == 50 and "problem 999" not in text
    assert tally["out of tokens"] == 1 and tally["format"] == 1 and tally["code error"] == 1


def test_the_card_of_nothing_run_yet_is_dashes_and_nanochats_rows(tmp_path):
    args = gsm8k_card.parse_args(["--out", str(tmp_path / "c"), "--card"])
    args.out.mkdir()
    gsm8k_card.write_card(args, args.out, {})
    card = (args.out / "gsm8k_card.md").read_text()
    assert "| sft-text | text | - |" in card and "0.0758" in card and "0.0455" in card
    assert card.startswith("GSM8K test, greedy on (none run yet): ") and "temperature 1.0 on (none run yet); " in card


@pytest.mark.slow
def test_the_driver_runs_both_arms_on_a_tiny_model_stopped_and_resumed(tiny_model_dir, tmp_path):
    out = tmp_path / "card"
    command = [sys.executable, "bench/gsm8k_card.py", "--model", tiny_model_dir, "--seeds", "0", "--sft_examples", "16",
               "--rl_steps", "2", "--limit", "3", "--passk_limit", "2", "--rl_eval_limit", "2", "--backend", "hf",
               "--out", str(out)]
    # stopped while the text arm's RL runs: the stage gets the signal, saves its step, the driver says how to go on
    driver = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 900
    while not (out / "rl-text-seed0" / "metrics.jsonl").exists() and driver.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    driver.send_signal(signal.SIGINT)
    stdout, stderr = driver.communicate(timeout=900)
    assert driver.returncode != 0 and "run the same command again to continue" in stderr, stdout[-2000:] + stderr[-2000:]
    assert "Traceback" not in stderr
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("done, kept") >= 3  # the text arm's SFT and its evaluations were not run again
    card = (out / "gsm8k_card.md").read_text()
    for name in ("sft-text", "rl-text-seed0", "sft-tool", "rl-tool-seed0"):
        assert f"| {name} |" in card and (out / f"eval-{name}" / "summary.json").exists()
        assert json.loads((out / f"pass8-{name}" / "summary.json").read_text())["count"] == 2
    assert (out / "failures-eval-sft-tool.md").exists()
    steps = [m["step"] for m in map(json.loads, open(out / "rl-text-seed0" / "metrics.jsonl")) if "loss" in m]
    assert steps == [1, 2]  # resumed where it stopped: no step twice, none missing


def test_a_failures_file_a_reader_edited_is_kept(tmp_path, capsys):
    records = [{"prompt": "User: q\nAssistant:", "response": "r", "ground_truth": "1", "problem": i,
                "answer_reward": 0.0, "format_reward": 1.0, "finish_reason": "stop", "stats": {}} for i in range(3)]
    gsm8k_card.write_failures("eval-x", records, tmp_path)
    path = tmp_path / "failures-eval-x.md"
    gsm8k_card.write_failures("eval-x", records[:2], tmp_path)  # its own, unedited: written again
    assert path.read_text().startswith("# eval-x: 2 of 2 failures")
    path.write_text(path.read_text() + "\nproblem 0: arithmetic\n")
    gsm8k_card.write_failures("eval-x", records, tmp_path)
    assert path.read_text().endswith("problem 0: arithmetic\n") and "kept" in capsys.readouterr().out


def two_problem_greedy_eval(folder: Path):
    """A greedy evaluation of 2 problems, the first right, as alignment.evaluate writes it."""
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"count": 2, "n_samples": 1, "avg_format_rewards": 1.0,
                                                     "mean_response_tokens": 5.0}))
    rows = [{"prompt": "User: q\nAssistant:", "response": "r", "ground_truth": "1", "problem": i, "n_tokens": 5,
             "answer_reward": float(i == 0), "format_reward": 1.0, "finish_reason": "stop", "stats": {}} for i in range(2)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_cards_header_says_what_the_runs_held(tmp_path):
    args = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--out", str(tmp_path / "c")])
    two_problem_greedy_eval(args.out / "eval-sft-text")
    gsm8k_card.write_card(args, args.out, {})
    card = (args.out / "gsm8k_card.md").read_text()
    assert "greedy on the first 2 problems: " in card and "all 1,319" not in card and "0.5000 [0.0945, 0.9055]" in card


def test_card_alone_on_a_missing_folder_and_moot_flags_are_one_line(tmp_path):
    missing = subprocess.run([sys.executable, "bench/gsm8k_card.py", "--card", "--out", str(tmp_path / "none")],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1  # a usage error, as argparse's: exit 2, one line
    for argv in (["--card", "--overwrite"], ["--card", "--stages", "sft"], ["--stages", "eval", "eval"]):
        with pytest.raises(SystemExit):
            gsm8k_card.parse_args(argv + ["--out", str(tmp_path / "c")])


def test_the_card_never_replaces_a_file_it_did_not_write(tmp_path):
    """`--card --out <a folder of the user's>` replaced their gsm8k_card.md (a probe round, 2026-12-02)."""
    mine = tmp_path / "drafts"
    mine.mkdir()
    (mine / "gsm8k_card.md").write_text("report draft v3 - do not lose\n")
    done = subprocess.run([sys.executable, "bench/gsm8k_card.py", "--card", "--out", str(mine)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "holds no stage this driver ran" in done.stderr and "Traceback" not in done.stderr
    (mine / "stages.json").write_text("{}")  # a folder of the driver's: its card, once edited, is kept too
    with pytest.raises(SystemExit, match="is not the file this driver last wrote"):
        gsm8k_card.write_own(mine / "gsm8k_card.md", "card\n")
    assert (mine / "gsm8k_card.md").read_text() == "report draft v3 - do not lose\n"  # (write_own: test_bench_drivers)


def test_an_unknown_rl_flag_is_one_line_naming_the_script_to_ask(tmp_path):
    """It was two lines, the second saying to "fix the driver's flags", exit 1 (a probe round, 2026-12-02)."""
    done = subprocess.run([sys.executable, "bench/gsm8k_card.py", "--out", str(tmp_path / "c"), "--rl_flags",
                           "--bogus_flag"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "[gsm8k_card] error: the rl-text-seed0 stage (alignment.train_rl) refused its flags: unknown flag --bogus_flag "
        "(--rl_flags takes its flags: uv run -m alignment.train_rl --help)"]
    assert not (tmp_path / "c").exists()


def test_kept_rows_outlive_their_folder_and_join_a_later_card(tmp_path):
    """A session's outputs/ is often gone by the next: --keep holds each evaluated model's row, and a later card
    (another --out, nothing run in it) shows it, labelled; writing a card again keeps one file a row."""
    keep = tmp_path / "kept"
    args = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--out", str(tmp_path / "c"), "--keep", str(keep)])
    two_problem_greedy_eval(args.out / "eval-sft-text")
    gsm8k_card.write_card(args, args.out, {})
    gsm8k_card.write_card(args, args.out, {})
    assert len(list(keep.glob("sft-text-*.json"))) == 1
    assert (args.out / "gsm8k_card.md").read_text().count("0.5000 [0.0945, 0.9055]") == 1  # its own row, once
    [kept] = keep.glob("sft-text-*.json")
    first = json.loads(kept.read_text())
    two_problem_greedy_eval(args.out / "pass8-sft-text")  # its pass@8 lands in a later run: the kept row takes it
    (args.out / "pass8-sft-text" / "summary.json").write_text(json.dumps({"count": 2, "n_samples": 8, "pass@8": 0.75}))
    gsm8k_card.write_card(args, args.out, {})
    assert list(keep.glob("sft-text-*.json")) == [kept]
    again = json.loads(kept.read_text())
    assert "| 0.750 |" in again["line"] and "| 0.750 |" not in first["line"]
    assert {k: again[k] for k in ("date", "commit", "cpu")} == {k: first[k] for k in ("date", "commit", "cpu")}
    later = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--out", str(tmp_path / "d"), "--keep", str(keep)])
    later.out.mkdir()
    gsm8k_card.write_card(later, later.out, {})
    card = (later.out / "gsm8k_card.md").read_text()
    assert "| sft-text | text | - |" in card  # this folder's own, not run
    assert re.search(r"\| sft-text \(\d{4}-\d\d-\d\d, \w+, [\w ]+\) \| text \| 0\.5000 \[0\.0945, 0\.9055\]", card), card
    (keep / "notes.json").write_text("[1, 2]")
    with pytest.raises(gsm8k_card.UserError, match="notes.json is not a row this driver kept"):
        gsm8k_card.write_card(later, later.out, {})


def sampled_eval(folder: Path, summary: dict, responses: list[str]):
    """A pass@8 evaluation of one problem (gold 18, the r1_zero prompt), as alignment.evaluate writes it."""
    from alignment.drgrpo_grader import r1_zero_reward_fn
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps({"count": 1, "n_samples": 8, "pass@8": 1.0, **summary}))
    rows = [{"prompt": "User: q\nAssistant:", "response": text, "ground_truth": "18", "problem": 0, "sample": i,
             "n_tokens": 5, "finish_reason": "stop", "stats": {}, **r1_zero_reward_fn(text, "18")}
            for i, text in enumerate(responses)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_an_older_maj_is_recomputed_from_its_records_or_marked(tmp_path):
    """maj@8 written by evaluate's rule before 2026-12-07 (unformatted answers voted, a tie went to the first): the
    card recomputes it from the records where the summary names its prompt, and marks it where it cannot."""
    right, wrong = " x </think> <answer> 18 </answer>", " x </think> <answer> 20 </answer>"
    tie = [right] * 4 + [wrong] * 4  # the old rule: right (seen first); now a tie, wrong
    args = gsm8k_card.parse_args(["--arms", "text", "--seeds", "0", "--out", str(tmp_path / "c")])
    two_problem_greedy_eval(args.out / "eval-sft-text")
    sampled_eval(args.out / "pass8-sft-text", {"maj@8": 1.0, "config": {"prompt": "r1_zero"}}, tie)
    two_problem_greedy_eval(args.out / "eval-rl-text-seed0")
    sampled_eval(args.out / "pass8-rl-text-seed0", {"maj@8": 1.0}, tie)  # no config: which grader cannot be told
    gsm8k_card.write_card(args, args.out, {})
    card = (args.out / "gsm8k_card.md").read_text()
    assert "| sft-text | text | 0.5000 [0.0945, 0.9055] | 1.000 | 1.000 | 0.000 |" in card  # recomputed
    assert "| rl-text-seed0 | text | 0.5000 [0.0945, 0.9055] | 1.000 | 1.000 | 1.000† |" in card
    assert "Marked: rl-text-seed0 (maj@8)." in card and "sft-text (maj@8)" not in card


def test_kept_figures_of_an_older_rule_are_marked_and_of_this_one_not(tmp_path):
    """The rows kept before 2026-12-07 (docs/gsm8k_card) carry no records: their maj@8 and "ignores output" are
    marked, by their maj_rule / ignores_rule or by having none."""
    keep = tmp_path / "kept"
    keep.mkdir()
    line = "| {} | tool | 0.0743 [0.0613, 0.0897] | 0.971 | 0.215 | 0.083 | 118 | 2.78 / 3 / 0.06 | 3 / 0 / 0 / 47 | - | - |"
    rules = {"old": {"maj_rule": "pre-2026-12-07", "ignores_rule": "pre-2026-12-07"}, "unsaid": {},
             "new": {"maj_rule": "2026-12-07", "ignores_rule": gsm8k_card.IGNORES_RULE}}
    for kind, rule in rules.items():
        name = f"rl-tool-{kind}"
        (keep / f"{name}-abc.json").write_text(json.dumps({"name": name, "line": line.format(name), "rl": None,
                                                           "key": "abc", **rule, "date": "2026-12-04", "commit": "c",
                                                           "cpu": "avx2"}))
    args = gsm8k_card.parse_args(["--arms", "tool", "--seeds", "0", "--out", str(tmp_path / "c"), "--keep", str(keep)])
    args.out.mkdir()
    gsm8k_card.write_card(args, args.out, {})
    card = (args.out / "gsm8k_card.md").read_text()
    for kind in ("old", "unsaid"):
        assert re.search(rf"\| rl-tool-{kind} \(.*\) \| tool \| .* \| 0\.215 \| 0\.083† \| 118 \| 2\.78 / 3 / 0\.06† \|", card)
        assert f"rl-tool-{kind} (2026-12-04, c, avx2) (maj@8, ignores output)" in card
    assert re.search(r"\| rl-tool-new \(.*\) \| tool \| .* \| 0\.215 \| 0\.083 \| 118 \| 2\.78 / 3 / 0\.06 \|", card)
    assert "rl-tool-new (2026" not in card.split("Marked: ")[1]
