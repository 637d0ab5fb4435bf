"""Draw the curves of a training run from its metrics.jsonl to a PNG.

    uv run -m alignment.plot checkpoints/rl/<run>        # writes <run>/curves.png

Panels: reward (training rollouts and evaluation), format and answer rates, response length, entropy.
"""

import argparse
import json
from pathlib import Path

from alignment.errors import MissingFileError, cli

PANELS = [
    ("reward", [("reward", "train reward"), ("eval_avg_all_rewards", "eval reward")]),
    ("format / answer rate", [("format_reward", "train format"), ("answer_reward", "train answer"),
                              ("eval_avg_format_rewards", "eval format"), ("eval_avg_answer_rewards", "eval answer")]),
    ("response tokens", [("response_tokens", "train"), ("eval_mean_response_tokens", "eval")]),
    ("entropy (nats/token)", [("entropy", "train")]),
]


def plot(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise MissingFileError(f"{path} does not exist; pass a run folder written by alignment.train_rl or alignment.sft.")
    records = [json.loads(line) for line in open(path)]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    for ax, (title, series) in zip(axes, PANELS):
        for key, label in series:
            points = [(r["step"], r[key]) for r in records if key in r]
            if points:
                ax.plot(*zip(*points), marker="o" if key.startswith("eval") else None, markersize=3, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out or run_dir / "curves.png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m alignment.plot", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="a run folder with metrics.jsonl")
    parser.add_argument("--out", default=None, help="PNG path (default <run_dir>/curves.png)")
    args = parser.parse_args(argv)
    cli(lambda a: print(f"[plot] wrote {plot(a.run_dir, a.out)}"), args)


if __name__ == "__main__":
    main()
