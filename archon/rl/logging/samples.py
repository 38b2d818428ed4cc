"""Sample tables: what the policy wrote, row by row, for a look at a run's rollouts.

Every `logging.samples_every` steps and at each evaluation, a table of whole groups of samples
(at most `logging.samples_per_table` rows per task, gathered from every data-parallel rank) is
written to RUN_DIR/samples/step_N.jsonl (an evaluation's: step_N.eval.jsonl), one JSON object a
line, and sent to each tracker. `python -m archon.tools.show_samples RUN_DIR` prints one.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from archon.checkpoint.atomic import atomic_file

SAMPLES_DIR = "samples"
TABLE_FILE = re.compile(r"step_(\d+)(\.eval)?\.jsonl")
FIELDS = ("task", "data_source", "source", "group", "reward", "parts", "stop", "version", "lag", "prompt", "completion")
"""A row's fields: the task ("" for a run without tasks), the prompt's data_source and where it was
read from, its group in the table (from 0), the reward and its terms (unweighted, by name), the stop
reason, the adapter version that sampled it, its lag behind the trainer's version, and the texts."""


def table_path(run_dir: str | os.PathLike, step: int, evaluation: bool = False) -> Path:
    return Path(run_dir) / SAMPLES_DIR / f"step_{step}{'.eval' if evaluation else ''}.jsonl"


def whole_groups(samples: list, limit_rows: int, share: int = 1) -> list[int]:
    """The indices of the samples of the first groups (same prompt_index, in order) that a table of
    at most `limit_rows` rows (at least one group) takes from one of `share` ranks."""
    groups: list[int] = []
    for sample in samples:
        if sample.prompt_index not in groups:
            groups.append(sample.prompt_index)
    if not groups:
        return []
    group_size = max(1, len(samples) // len(groups))
    wanted = max(1, limit_rows // group_size)
    kept = set(groups[: -(-wanted // share)])
    return [i for i, sample in enumerate(samples) if sample.prompt_index in kept]


def sample_rows(
    task_name: str, examples, samples: list, scores, tokenizer, trainer_version: int, limit_rows: int, share: int = 1
) -> list[dict[str, Any]]:
    """The table rows of this rank's share of a task's scored samples: whole groups, at most
    `limit_rows` / `share` rows' worth. A multi-turn trajectory's completion is its whole text after
    the first prompt (sampled turns and environment turns, special tokens kept), its stop the
    episode's stop reason."""
    rows = []
    for i in whole_groups(samples, limit_rows, share):
        sample = samples[i]
        example = examples[sample.prompt_index]
        trajectory = sample.extra.get("trajectory")
        completion = tokenizer.decode(sample.completion_ids, skip_special_tokens=trajectory is None)
        rows.append(
            {
                "task": task_name,
                "data_source": example.data_source,
                "source": example.source,
                "group": sample.prompt_index,
                "reward": float(scores.rewards[i]),
                "parts": {name: float(values[i]) for name, values in sorted(scores.parts.items())},
                "stop": trajectory.stop_reason.value if trajectory is not None else sample.finish_reason,
                "version": sample.version,
                "lag": trainer_version - sample.version,
                "prompt": tokenizer.decode(sample.prompt_ids, skip_special_tokens=False),
                "completion": completion,
            }
        )
    return rows


def merge_rank_rows(per_rank: list[list[dict[str, Any]]], limit_rows: int) -> list[dict[str, Any]]:
    """One task's rows of every rank, groups renumbered from 0 across ranks, cut to whole groups
    within `limit_rows` (at least one)."""
    merged, groups = [], []
    for rank, rows in enumerate(per_rank):
        for row in rows:
            key = (rank, row["group"])
            if key not in groups:
                groups.append(key)
            merged.append({**row, "group": groups.index(key)})
    if not merged:
        return []
    group_size = max(1, len(merged) // len(groups))
    wanted = max(1, limit_rows // group_size)
    return [row for row in merged if row["group"] < wanted]


def tracker_table(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """The rows as (columns, values) for a tracker's table type: a column `reward/<term>` per reward
    term (None where a row's task has no such term)."""
    parts = sorted({name for row in rows for name in row["parts"]})
    columns = [f for f in FIELDS if f != "parts"]
    columns = columns[:5] + [f"reward/{name}" for name in parts] + columns[5:]
    values = []
    for row in rows:
        plain = [row[f] for f in FIELDS if f != "parts"]
        values.append(plain[:5] + [row["parts"].get(name) for name in parts] + plain[5:])
    return columns, values


def write_table(run_dir: str | os.PathLike, step: int, rows: list[dict[str, Any]], evaluation: bool = False) -> Path:
    path = table_path(run_dir, step, evaluation)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return path


def recorded_steps(run_dir: str | os.PathLike, evaluation: bool = False) -> list[int]:
    """The steps with a table (of training samples, or of an evaluation's), in order."""
    directory = Path(run_dir) / SAMPLES_DIR
    if not directory.is_dir():
        return []
    steps = []
    for path in directory.iterdir():
        match = TABLE_FILE.fullmatch(path.name)
        if match and bool(match.group(2)) == evaluation:
            steps.append(int(match.group(1)))
    return sorted(steps)


def drop_tables_after(run_dir: str | os.PathLike, step: int) -> None:
    """Remove the tables of steps after `step` (a resumed run writes them again)."""
    directory = Path(run_dir) / SAMPLES_DIR
    if not directory.is_dir():
        return
    for path in directory.iterdir():
        match = TABLE_FILE.fullmatch(path.name)
        if match and int(match.group(1)) > step:
            path.unlink()


def read_table(path: str | os.PathLike) -> list[dict[str, Any]]:
    """A table's rows; a line that is not a JSON object is an error naming it."""
    rows = []
    for line_no, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{line_no}: not a JSON object")
        rows.append(row)
    return rows
