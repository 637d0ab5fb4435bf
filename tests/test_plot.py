import os
from pathlib import Path

from alignment.plot import run_labels


def test_runs_are_named_by_folder_and_by_parent_where_folder_names_collide():
    assert run_labels([Path("checkpoints/rl/seed0"), Path("checkpoints/rl/seed1")]) == ["seed0", "seed1"]
    assert run_labels([Path("checkpoints/ei/seed0"), Path("checkpoints/rl/seed0")]) == ["ei/seed0", "rl/seed0"]


def test_plot_draws_only_what_is_there_and_refuses_the_rest(tmp_path, capsys):
    import json
    import pytest
    from alignment.errors import MissingFileError, UserError
    from alignment.plot import plot
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"script": "sft"}))  # a run just started: not "pass a run folder"
    with pytest.raises(MissingFileError, match="holds a run that has logged no step yet"):
        plot(run)
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no records yet"):
        plot(run)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.5}) + "\n")  # an SFT step: no curve of ours
    with pytest.raises(UserError, match="holds nothing to draw"):
        plot(run)
    with pytest.raises(UserError, match="ending .png"):
        plot(run, tmp_path / "curves.txt")
    with pytest.raises(MissingFileError, match="does not exist; create it first"):
        plot(run, tmp_path / "missing" / "curves.png")
    assert not list(tmp_path.rglob("*.png")) and not (tmp_path / "curves.txt").exists()
    lines = [{"step": s, "reward": 0.1 * s, "format_reward": 0.5, "answer_reward": 0.2, "response_tokens": 30}
             for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    assert plot(run).exists()
    assert "[plot] 4 curves in 3 of 4 panels, 1 run(s)" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"cannot write .*: choose another --out"):  # not a traceback
        plot(run, tmp_path / ("x" * 300 + ".png"))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if not os.access(locked, os.W_OK):  # (root writes anywhere)
        with pytest.raises(UserError, match=r"cannot write .*: choose another --out"):
            plot(run, locked / "curves.png")


def _write(path, records):
    import json
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_metrics_line_that_is_not_an_object_is_named(tmp_path):
    import pytest
    from alignment.errors import UserError
    from alignment.plot import plot
    (tmp_path / "metrics.jsonl").write_text("[1, 2]\n")
    with pytest.raises(UserError, match=r"line 1 of .*metrics.jsonl is not a JSON object \(\[1, 2\]\)"):
        plot(tmp_path)


def test_nothing_to_draw_says_which_thing_is_missing(tmp_path):
    import json
    import pytest
    from alignment.errors import UserError
    from alignment.plot import plot
    run = tmp_path / "sft_run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds no records yet"):
        plot(run)
    (run / "config.json").write_text(json.dumps({"script": "sft"}))
    _write(run / "metrics.jsonl", [{"step": 1, "loss": 0.5}, {"step": 1, "eval": {"avg_all_rewards": 0.2}}])
    with pytest.raises(UserError, match="sft runs log no generated_tokens .*use --x step"):
        plot(run, x="generated_tokens")
    assert plot(run).exists()  # against the step, SFT's evaluation (logged nested under "eval") is drawn
    _write(run / "metrics.jsonl", [{"step": 1, "loss": 0.5}])
    with pytest.raises(UserError, match="sft runs draw only their evaluations"):
        plot(run)
    (run / "config.json").unlink()
    _write(run / "metrics.jsonl", [{"step": 1, "reward": 0.5}])  # an RL run from before generated_tokens was counted
    with pytest.raises(UserError, match="none of its 1 records has generated_tokens; use --x step"):
        plot(run, x="generated_tokens")


def test_a_run_given_twice_is_drawn_once(tmp_path, capsys):
    from alignment.plot import plot
    run = tmp_path / "rl1"
    run.mkdir()
    _write(run / "metrics.jsonl", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.6}])
    out = plot([run, f"{run}/", tmp_path / "." / "rl1"], tmp_path / "both.png")
    assert out.exists()
    printed = capsys.readouterr().out
    assert "given more than once; drawn once" in printed and "1 curves in 1 of 4 panels, 1 run(s)" in printed


def test_a_run_folder_that_is_a_file_is_named_as_such(tmp_path):
    import pytest
    from alignment.errors import UserError
    from alignment.plot import plot
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(UserError, match="metrics.jsonl is a folder, not a file"):
        plot(tmp_path)
    (tmp_path / "run").write_text("")
    with pytest.raises(UserError, match="run is a file, not a run folder"):
        plot(tmp_path / "run")


def test_an_existing_out_file_is_replaced_only_with_overwrite(tmp_path, capsys):
    """The tester's `plot <run> --out existing.png` replaced a user's picture; a run's own curves.png is plot's."""
    import pytest
    from alignment.errors import UserError
    from alignment.plot import main, plot
    run = tmp_path / "run"
    run.mkdir()
    _write(run / "metrics.jsonl", [{"step": 1, "reward": 0.5}, {"step": 2, "reward": 0.6}])
    mine = tmp_path / "existing.png"
    mine.write_bytes(b"a user's picture")
    with pytest.raises(UserError, match=r"existing.png already exists: choose another --out, or add --overwrite"):
        plot(run, mine)
    with pytest.raises(SystemExit):
        main([str(run), "--out", str(mine)])
    assert "error: " in capsys.readouterr().err and mine.read_bytes() == b"a user's picture"
    main([str(run), "--out", str(mine), "--overwrite"])
    assert mine.read_bytes() != b"a user's picture"
    assert plot(run).exists() and plot(run).exists()  # <run>/curves.png, plot's own, is drawn again
    assert plot(run, run / "curves.png").exists()


def test_a_damaged_metrics_line_is_named(tmp_path, capsys):
    """Only a garbage line said "holds no records yet"; a good line and a garbage one plotted and said nothing."""
    import pytest
    from alignment.errors import UserError
    from alignment.plot import plot
    (tmp_path / "metrics.jsonl").write_text("garbage\n")
    with pytest.raises(UserError, match=r"line 1 of .*metrics.jsonl is not JSON \('garbage'\), and the file holds no"):
        plot(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\ngarbage\n')
    assert plot(tmp_path).exists()
    assert "[plot] warning: line 2 of " in capsys.readouterr().out
