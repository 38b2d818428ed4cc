"""Plot a run's reward and accuracy curves: python -m archon.tools.plot RUN_DIR [--out FILE]."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

CURVES = (
    ("reward_mean", "reward (mean)"),
    ("accuracy", "train accuracy"),
    ("eval_accuracy", "held-out accuracy"),
)


@dataclass
class PlotArgs:
    run_dir: str
    """Directory holding metrics.jsonl."""
    out: str | None = None
    """PNG path; default RUN_DIR/curves.png."""


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from archon.rl.metrics import read_metrics

    records = read_metrics(run_dir)
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    fig, ax = plt.subplots(figsize=(7, 4))
    plotted = 0
    for key, label in CURVES:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if key == "eval_accuracy" else None, markersize=3, label=label)
            plotted += 1
    if not plotted:
        raise ValueError(f"{run_dir}/metrics.jsonl has none of {[k for k, _ in CURVES]}")
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(Path(run_dir).name)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    import tyro

    args = tyro.cli(PlotArgs, args=argv)
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
