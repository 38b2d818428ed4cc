"""Per-step metrics: one JSON object a line in RUN_DIR/metrics.jsonl, mirrored to TensorBoard."""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any

from archon.checkpoint.atomic import atomic_file

METRICS_FILE = "metrics.jsonl"
logger = logging.getLogger("archon.rl")


def _plain(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """Appends `{"step": s, **metrics}` lines (flushed each step, so a crash loses nothing written)."""

    def __init__(self, run_dir: str | os.PathLike, tensorboard: bool = True, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / METRICS_FILE
        self._writer = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._writer.add_scalar(key, value, step)
            self._writer.flush()

    def drop_after(self, step: int) -> None:
        """Remove the records of steps after `step` (a resumed run logs them again)."""
        if not self.enabled or not self.path.exists():
            return
        kept = [line for record, line in _read_records(self.path) if record["step"] <= step]
        self._file.close()
        with atomic_file(self.path, "wb") as f:
            f.writelines(kept)
        self._file = open(self.path, "a")

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._writer is not None:
                self._writer.close()


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
                logger.warning("%s:%d: dropped the last line, a record cut short (the run was killed while writing "
                               "it): %r", path, line_no, line[:80])  # fmt: skip
                break
            raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{line_no}: not a metrics record (a JSON object with an integer 'step')")
        records.append((record, line if line.endswith(b"\n") else line + b"\n"))
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(run_dir)!r} a run directory?")
    return [record for record, _ in _read_records(path)]
