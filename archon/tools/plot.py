"""Plot a run's reward and accuracy curves: python -m archon.tools.plot RUN_DIR [--out FILE].

A multi-task run logs each task's metrics as `<task>/<metric>`: each task gets its own curves, in
one colour, the metric told apart by the line style."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

from archon.rl.metrics import read_metrics

CURVES = (
    ("reward_mean", "reward (mean)"),
    ("accuracy", "train accuracy"),
    ("eval_accuracy", "held-out accuracy"),
)
TASK_LINE_STYLES = {"reward_mean": "-", "accuracy": "--", "eval_accuracy": ":"}


@dataclass
class PlotArgs:
    run_dir: Annotated[str, tyro.conf.Positional]
    """Directory holding metrics.jsonl."""
    out: str | None = None
    """PNG path; default RUN_DIR/curves.png."""


def curves(records: list[dict[str, Any]]) -> list[tuple[str | None, str, str, list[int], list[float]]]:
    """(task, metric, label, steps, values) of each curve to draw from metrics records: the metrics
    of CURVES, unprefixed (task None) and per task (`<task>/<metric>`, tasks in the order they first
    appear)."""
    metrics = {key for key, _ in CURVES}
    tasks: list[str] = []
    for record in records:
        for name in record:
            task, _, metric = name.rpartition("/")
            if task and metric in metrics and task not in tasks:
                tasks.append(task)
    drawn = []
    for task in [None, *tasks]:
        for key, label in CURVES:
            name = key if task is None else f"{task}/{key}"
            points = [(r["step"], r[name]) for r in records if r.get(name) is not None]
            if points:
                steps, values = zip(*points)
                drawn.append((task, key, label if task is None else f"{task}: {label}", list(steps), list(values)))
    return drawn


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = curves(read_metrics(run_dir))
    if not drawn:
        names = [key for key, _ in CURVES]
        raise ValueError(f"{run_dir}/metrics.jsonl has none of {names} (nor <task>/ before one of them)")
    out = Path(out) if out is not None else Path(run_dir) / "curves.png"
    tasks = list(dict.fromkeys(task for task, *_ in drawn if task is not None))
    fig, ax = plt.subplots(figsize=(7, 4))
    for task, key, label, steps, values in drawn:
        style = {} if task is None else {"color": f"C{tasks.index(task) % 10}", "linestyle": TASK_LINE_STYLES[key]}
        ax.plot(steps, values, marker="o" if key == "eval_accuracy" else None, markersize=3, label=label, **style)
    ax.set_xlabel("step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize="small" if tasks else None)
    ax.set_title(Path(run_dir).name)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(PlotArgs, args=argv)
    print(plot_run(args.run_dir, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
