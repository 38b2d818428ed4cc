"""Per-step metrics: one JSON object a line in RUN_DIR/metrics.jsonl, mirrored to TensorBoard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


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
        from archon.checkpoint.atomic import atomic_file

        self._file.close()
        lines = self.path.read_text().splitlines(keepends=True)
        with atomic_file(self.path, "w") as f:
            f.writelines(line for line in lines if json.loads(line)["step"] <= step)
        self._file = open(self.path, "a")

    def close(self) -> None:
        if self.enabled:
            self._file.close()
            if self._writer is not None:
                self._writer.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(run_dir)!r} a run directory?")
    records = []
    for line_no, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{line_no}: not a JSON object ({e})") from None
    return records
