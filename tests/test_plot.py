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
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(UserError, match="holds nothing to draw"):
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
