"""Print a sample table of a run (RUN_DIR/samples/step_N.jsonl, archon.rl.samples) readably: one block
per sample, a header line with its reward, reward terms, stop reason, adapter version and lag, then
its prompt and completion.

    python -m archon.tools.show_samples RUN_DIR                 # the latest step's table
    python -m archon.tools.show_samples RUN_DIR --step 20 --eval --task add --full
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import tyro

from archon.rl.samples import SAMPLES_DIR, read_table, recorded_steps, table_path


@dataclass
class ShowSamplesArgs:
    run_dir: Annotated[str, tyro.conf.Positional]
    """The run directory (logging.run_dir)."""
    step: int | None = None
    """The step whose table to show; default: the latest recorded."""
    eval: bool = False
    """The evaluation's table of the step (step_N.eval.jsonl) instead of the training samples'."""
    task: str | None = None
    """Only this task's samples (a multi-task run)."""
    full: bool = False
    """Show whole prompts and completions; by default each is cut to `max_chars`."""
    max_chars: int = 400
    """Characters of a prompt or completion shown without --full (its start and end)."""


def shorten(text: str, max_chars: int) -> str:
    """`text`, or its start and end with the number of characters left out between them."""
    if len(text) <= max_chars:
        return text
    head, tail = max_chars * 2 // 3, max_chars // 3
    return f"{text[:head]} [... {len(text) - head - tail} characters; --full shows all ...] {text[-tail:]}"


def _indented(text: str) -> str:
    return "\n".join("    " + line for line in (text.splitlines() or [""]))


def format_row(row: dict[str, Any], max_chars: int | None) -> str:
    """One sample's block: its header line, then its prompt and completion (cut to max_chars unless None)."""
    header = [f"group {row.get('group')}"]
    if row.get("task"):
        header.insert(0, f"[{row['task']}]")
    header.append(f"reward {row.get('reward', float('nan')):.4g}")
    parts = row.get("parts") or {}
    if parts:
        header.append("(" + ", ".join(f"{name} {value:.4g}" for name, value in parts.items()) + ")")
    header += [f"stop {row.get('stop')}", f"version {row.get('version')}", f"lag {row.get('lag')}"]
    if row.get("data_source"):
        header.append(f"data_source {row['data_source']}")
    if row.get("source"):
        header.append(f"from {row['source']}")
    cut = (lambda text: text) if max_chars is None else (lambda text: shorten(text, max_chars))
    return "\n".join(
        [
            "== " + "  ".join(header),
            "-- prompt",
            _indented(cut(str(row.get("prompt", "")))),
            "-- completion",
            _indented(cut(str(row.get("completion", "")))),
        ]
    )


def show(
    run_dir: str | Path,
    step: int | None = None,
    evaluation: bool = False,
    task: str | None = None,
    full: bool = False,
    max_chars: int = 400,
) -> str:
    """The table of `step` (default: the latest) as text. Errors: no samples directory, the step not
    recorded (naming those that are), no sample of `task`."""
    run_dir = Path(run_dir)
    kind = "evaluation" if evaluation else "training"
    if not (run_dir / SAMPLES_DIR).is_dir():
        raise FileNotFoundError(
            f"{run_dir / SAMPLES_DIR} does not exist: no sample tables were recorded in {run_dir} (is it a run "
            "directory? logging.samples_every=0 turns them off)"
        )
    steps = recorded_steps(run_dir, evaluation)
    if not steps:
        raise FileNotFoundError(f"{run_dir / SAMPLES_DIR} has no {kind} sample table")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise ValueError(
            f"step {step} has no {kind} sample table in {run_dir / SAMPLES_DIR}; recorded steps: "
            f"{', '.join(map(str, steps))}"
        )
    rows = read_table(table_path(run_dir, step, evaluation))
    if task is not None:
        tasks = sorted({str(row.get("task")) for row in rows})
        rows = [row for row in rows if row.get("task") == task]
        if not rows:
            raise ValueError(f"step {step}'s {kind} table has no sample of task {task!r}; its tasks: {tasks}")
    title = f"{kind} samples of step {step} ({len(rows)}) in {table_path(run_dir, step, evaluation)}"
    return "\n\n".join([title, *(format_row(row, None if full else max_chars) for row in rows)])


def main(argv: list[str] | None = None) -> int:
    args = tyro.cli(ShowSamplesArgs, args=argv)
    try:
        print(show(args.run_dir, args.step, args.eval, args.task, args.full, args.max_chars))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
