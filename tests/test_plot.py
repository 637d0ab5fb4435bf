from pathlib import Path

from alignment.plot import run_labels


def test_runs_are_named_by_folder_and_by_parent_where_folder_names_collide():
    assert run_labels([Path("checkpoints/rl/seed0"), Path("checkpoints/rl/seed1")]) == ["seed0", "seed1"]
    assert run_labels([Path("checkpoints/ei/seed0"), Path("checkpoints/rl/seed0")]) == ["ei/seed0", "rl/seed0"]
