"""Per-step metrics: one JSON object a line in RUN_DIR/metrics.jsonl, mirrored to the experiment
trackers (archon.rl.logging.trackers), with the sample tables (archon.rl.logging.samples)."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from archon.checkpoint.atomic import atomic_file
from archon.rl.logging.samples import drop_tables_after, tracker_table, write_table
from archon.rl.logging.trackers import TensorBoardTracker, close_trackers
from archon.secrets import redact_value

METRICS_FILE = "metrics.jsonl"
logger = logging.getLogger("archon.rl")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends `{"step": s, **metrics}` lines (flushed each step, so a crash loses nothing written)
    and sends each record's numbers to `trackers` (started by archon.rl.logging.trackers.open_trackers;
    `tensorboard`: add a TensorBoard one in RUN_DIR/tensorboard). A tracker that fails while logging
    is reported and dropped for the rest of the run; metrics.jsonl and the sample files go on."""

    def __init__(
        self, run_dir: str | os.PathLike, tensorboard: bool = True, enabled: bool = True, trackers: list | None = None
    ) -> None:
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self.trackers = list(trackers or [])
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        if tensorboard:
            self.trackers.append(TensorBoardTracker(None, self.run_dir, {}))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(redact_value(record)) + "\n")  # strings only: a number stays a number
        self._file.flush()
        scalars = {
            k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        self._to_trackers(step, "log_scalars", step, scalars)

    def log_samples(self, step: int, rows: list[dict[str, Any]], evaluation: bool = False) -> None:
        """A sample table (archon.rl.logging.samples rows) of `step`: to RUN_DIR/samples and each tracker."""
        if not self.enabled or not rows:
            return
        rows = redact_value(rows)  # a prompt or a tool's output may echo a secret of the run
        write_table(self.run_dir, step, rows, evaluation)
        columns, values = tracker_table(rows)
        self._to_trackers(step, "log_table", "eval_samples" if evaluation else "samples", step, columns, values)

    def _to_trackers(self, step: int, method: str, *args) -> None:
        for tracker in list(self.trackers):
            try:
                getattr(tracker, method)(*args)
            except Exception as e:  # noqa: BLE001 - a tracker's failure must not end the run
                self.trackers.remove(tracker)
                logger.error(
                    "step %d: the %s tracker failed (%s: %s); it gets nothing more in this run. %s has every step.",
                    step,
                    tracker.name,
                    type(e).__name__,
                    e,
                    self.path,
                )
                close_trackers([tracker])

    def drop_after(self, step: int) -> None:
        """Remove the records and sample tables of steps after `step` (a resumed run logs them again)."""
        if not self.enabled:
            return
        drop_tables_after(self.run_dir, step)
        for tracker in self.trackers:
            if isinstance(tracker, TensorBoardTracker):  # the one backend that can take steps back
                tracker.drop_after(step)
        if not self.path.exists():
            return
        kept = [line for record, line in _read_records(self.path) if record["step"] <= step]
        self._file.close()
        with atomic_file(self.path, "wb") as f:
            f.writelines(kept)
        self._file = open(self.path, "a")

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            close_trackers(self.trackers)
            self.trackers = []


def _read_records(path: Path) -> list[tuple[dict[str, Any], bytes]]:
    """Each record of the metrics file `path`, with its line (newline included). A last line without
    its newline that is not a record is what a run killed while writing leaves: it is dropped, with
    a warning. Any other bad line is an error naming its line number."""
    lines = path.read_bytes().splitlines(keepends=True)
    records = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:  # not JSON, or not UTF-8
            if line_no == len(lines) and not line.endswith(b"\n"):
                logger.warning(
                    "%s:%d: dropped the last line, a record cut short (the run was killed while writing it): %r",
                    path,
                    line_no,
                    line[:80],
                )
                break
            raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{line_no}: not a metrics record (a JSON object with an integer 'step')")
        records.append((record, line if line.endswith(b"\n") else line + b"\n"))
    return records


SUMMARY_METRICS = ("eval_accuracy", "accuracy", "reward_mean")
"""The metrics of the last record the recipe's final line shows (each task's, by their prefix)."""


def summary(record: dict[str, Any]) -> dict[str, float | str]:
    """The SUMMARY_METRICS of a metrics record, rounded to 4 decimals; a value that was not finite
    (stored as None, see `_plain`) or is missing a number shows as "n/a"."""
    shown: dict[str, float | str] = {}
    for key, value in record.items():
        if key.rsplit("/", 1)[-1] not in SUMMARY_METRICS:
            continue
        value = _plain(value)
        is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
        shown[key] = round(value, 4) if is_number else "n/a"
    return shown


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(run_dir)!r} a run directory?")
    return [record for record, _ in _read_records(path)]
