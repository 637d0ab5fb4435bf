"""Draw the curves of a training run from its metrics.jsonl to a PNG.

    uv run -m alignment.plot checkpoints/rl/<run>        # writes <run>/curves.png
    uv run -m alignment.plot checkpoints/rl/seed0 checkpoints/rl/seed1 --out seeds.png   # several runs, one plot
    uv run -m alignment.plot checkpoints/ei/<run> checkpoints/rl/<run> --x generated_tokens --out ei_vs_grpo.png

Panels: reward (training rollouts and evaluation), format and answer rates, response length, entropy.
"""

import argparse
import json
import os
from pathlib import Path

from alignment.errors import MissingFileError, UserError, cli, one_line_error
from alignment.folders import PLOT_FILE, read_jsonl

PANELS = [
    ("reward", [("reward", "train reward"), ("eval_avg_all_rewards", "eval reward")]),
    ("format / answer rate", [("format_reward", "train format"), ("answer_reward", "train answer"),
                              ("eval_avg_format_rewards", "eval format"), ("eval_avg_answer_rewards", "eval answer")]),
    ("response tokens", [("response_tokens", "train"), ("eval_mean_response_tokens", "eval")]),
    ("entropy (nats/token)", [("entropy", "train")]),
]


def plot(run_dirs, out: str | Path | None = None, x: str = "step", overwrite: bool = False) -> Path:
    """Draw one run (a folder or a list of one) or several on the same axes (e.g. seeds of one recipe):
    with several, each series is labelled with its run's name (`run_labels`) and the PNG goes to `out`
    (default: curves.png in the first run's parent folder). `x` is the horizontal axis: the step, or
    generated_tokens (the tokens sampled so far) to compare runs at equal sampling work (EI against RL). An existing
    file is replaced only with `overwrite`, but for curves.png in the one run folder drawn (plot's own file there)."""
    out = Path(out) if out is not None else None
    if out is not None and out.suffix.lower() not in (".png", ".pdf", ".svg", ".jpg", ".jpeg"):
        raise UserError(f"--out {out}: name a picture file ending .png (or .pdf, .svg, .jpg).")
    if out is not None and not out.parent.is_dir():
        raise MissingFileError(f"--out {out}: the folder {out.parent} does not exist; create it first.")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [Path(run_dirs)] if isinstance(run_dirs, (str, Path)) else [Path(r) for r in run_dirs]
    distinct = {}  # `rl1` and `rl1/` are one run: drawn once, not twice under one label
    for run_dir in run_dirs:
        distinct.setdefault(run_dir.resolve(), run_dir)
    if len(distinct) < len(run_dirs):
        print(f"[plot] {len(run_dirs) - len(distinct)} run folder(s) given more than once; drawn once")
        run_dirs = list(distinct.values())
    runs = []
    for run_dir, name in zip(run_dirs, run_labels(run_dirs)):
        runs.append((name, read_metrics(run_dir)))
    drawable = {key for _, series in PANELS for key, _ in series}
    for (name, records), run_dir in zip(runs, run_dirs):
        if not any(r.get(key) is not None and r.get(x) is not None for r in records for key in drawable):
            raise UserError(_nothing_to_draw(run_dir, records, x))
    target = Path(out or (run_dirs[0] if len(runs) == 1 else run_dirs[0].parent) / PLOT_FILE)
    own = len(runs) == 1 and target.resolve() == (run_dirs[0] / PLOT_FILE).resolve()
    if os.path.lexists(target) and not overwrite and not own:  # a user's picture is never replaced silently
        raise UserError(f"{target} already exists: choose another --out, or add --overwrite to replace it.")
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, series) in zip(axes, PANELS):
        for run_index, (name, records) in enumerate(runs):
            for key, label in series:
                points = [(r[x], r[key]) for r in records if r.get(key) is not None and r.get(x) is not None]
                if points:
                    label = label if len(runs) == 1 else f"{name}: {label}"
                    ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=label,
                            color=f"C{run_index}" if len(runs) > 1 else None,
                            linestyle=_style(key, len(runs)))
        ax.set_title(title)
        ax.set_xlabel(x.replace("_", " "))
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(", ".join(name for name, _ in runs))
    fig.tight_layout()
    out = target
    drawn = sum(len(ax.lines) for ax in axes)
    try:
        fig.savefig(out, dpi=110)
    except OSError as e:  # a read-only folder, /proc, a name too long: the picture, not the runs, is the problem
        raise UserError(f"cannot write {out} ({e.strerror or e}): choose another --out.") from None
    finally:
        plt.close(fig)
    print(f"[plot] {drawn} curves in {sum(bool(ax.lines) for ax in axes)} of {len(PANELS)} panels, {len(runs)} run(s)")
    return out


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of a run's metrics.jsonl, an SFT evaluation's `{"eval": {...}}` flattened to eval_* keys as
    train_rl and expert_iteration log them."""
    path = run_dir / "metrics.jsonl"
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"{run_dir} is a file, not a run folder; pass the folder that holds metrics.jsonl.")
    if path.is_dir():
        raise UserError(f"{path} is a folder, not a file; pass a run folder written by alignment.train_rl, "
                        f"alignment.expert_iteration or alignment.sft.")
    if not path.exists() and (run_dir / "config.json").is_file():  # a run started, nothing logged yet
        raise MissingFileError(f"{run_dir} holds a run that has logged no step yet (no metrics.jsonl): plot it once "
                               f"it has trained a step or evaluated.")
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; pass a run folder written by alignment.train_rl, "
                               f"alignment.expert_iteration or alignment.sft.")
    lines = path.read_text().splitlines()  # before the records: a line appended meanwhile is not taken for a bad one
    records = read_jsonl(path)
    if len(records) < len(lines):  # read_jsonl leaves out a last line that is not JSON: say which
        damaged = f"line {len(lines)} of {path} is not JSON ({lines[-1][:40]!r})"
        if not records:
            raise UserError(f"{damaged}, and the file holds no other line: fix or delete that line.")
        print(f"[plot] warning: {damaged}: left out (cut off by a run still writing, or damaged: fix or delete it)")
    for number, record in enumerate(records, 1):  # read_jsonl drops only a cut-off last line: index is line
        if not isinstance(record, dict):
            raise UserError(f"line {number} of {path} is not a JSON object ({json.dumps(record)[:40]}); each line "
                            f"must be one record such as {{\"step\": 1, \"reward\": 0.5}}: fix or delete that line.")
    return [{**r, **{f"eval_{k}": v for k, v in r["eval"].items()}} if isinstance(r.get("eval"), dict) else r
            for r in records]


def _nothing_to_draw(run_dir: Path, records: list[dict], x: str) -> str:
    """Why a run has no curve against `x`: no records yet, none with `x`, or none with a value we draw."""
    path = run_dir / "metrics.jsonl"
    try:
        script = json.loads((run_dir / "config.json").read_text()).get("script")
    except (OSError, ValueError, AttributeError):  # no config.json (or not a run's): say less
        script = None
    if not records:
        return f"{path} holds no records yet; plot the run once it has logged a step or an evaluation."
    if not any(r.get(x) is not None for r in records):
        if script == "sft":
            return f"{path}: sft runs log no {x} (train_rl and expert_iteration runs do); use --x step."
        return f"{path}: none of its {len(records)} records has {x}; use --x step."
    if script == "sft":
        return (f"{path} holds nothing to draw against {x}: sft runs draw only their evaluations, and none of its "
                f"{len(records)} records is one; train with --eval_limit above 0 or plot after the first --eval_every.")
    return (f"{path} holds nothing to draw against {x} ({len(records)} records): plot takes runs of "
            f"alignment.train_rl, expert_iteration or sft that logged a step or an evaluation.")


def run_labels(run_dirs: list[Path]) -> list[str]:
    """Each run's name in the legend: its folder's name, with the parent's in front when two folders share a
    name (checkpoints/ei/seed0 against checkpoints/rl/seed0 -> ei/seed0, rl/seed0)."""
    names = [run_dir.name for run_dir in run_dirs]
    if len(set(names)) == len(names):
        return names
    return [f"{run_dir.resolve().parent.name}/{run_dir.name}" for run_dir in run_dirs]


def _style(key: str, n_runs: int) -> str:
    """One run: solid lines. Several (one colour each): eval solid, eval format dashed, training dotted."""
    if n_runs == 1:
        return "-"
    return ":" if not key.startswith("eval") else "--" if "format" in key else "-"


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m alignment.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.error = one_line_error  # argparse's complaints as one line, as the other scripts'
    parser.add_argument("run_dirs", nargs="+", help="one or more run folders with metrics.jsonl (several: one plot)")
    parser.add_argument("--out", default=None, help="PNG path (default <run_dir>/curves.png; several runs: their parent)")
    parser.add_argument("--x", default="step", choices=("step", "generated_tokens"),
                        help="horizontal axis: step, or generated_tokens (runs at equal sampling work)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out file (a run's own "
                        "curves.png is replaced without it)")
    args = parser.parse_args(argv)
    cli(lambda a: print(f"[plot] wrote {plot(a.run_dirs, a.out, a.x, a.overwrite)}"), args)


if __name__ == "__main__":
    main()
