"""Resume checkpoints: sharded state through torch.distributed.checkpoint, written atomically.

Layout of one checkpoint, `<root>/step-<step:08d>/`:

    *.distcp, .metadata     DCP shards of the trainable parameters and the optimizer state
    rng/rank-<r>.pt         each rank's RNG states (torch CPU and accelerator, Python, NumPy)
    trainer_state.json      step, LR-schedule state, data-loader position (written by rank 0)

Everything is written into `<root>/.tmp-step-<step>` and renamed into place by rank 0 once every
rank has finished, so a directory named `step-*` is always complete. The newest `keep_last` are
kept. All ranks must see the same `root` (a shared file system when ranks span machines).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from archon.checkpoint.atomic import atomic_write_json

STEP_DIR = re.compile(r"step-(\d{8})")
TRAINER_STATE = "trainer_state.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group; that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    from archon.device import npu_available

    if npu_available():
        state["npu"] = torch.npu.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "npu" in state:
        torch.npu.set_rng_state_all(state["npu"])


class CheckpointManager:
    def __init__(self, root: str | os.PathLike, keep_last: int = 3) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def step_dir(self, step: int) -> Path:
        return self.root / f"step-{step:08d}"

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and STEP_DIR.fullmatch(p.name)]
        return sorted(found, key=lambda p: int(STEP_DIR.fullmatch(p.name).group(1)))

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None

    def save(self, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Write `app_state` (DCP state dicts) and `trainer_state` (JSON) for `step`; every rank calls it."""
        import torch.distributed.checkpoint as dcp

        final = self.step_dir(step)
        tmp = self.root / f".tmp-step-{step:08d}"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "rng").mkdir()
        _barrier()
        with _single_process_quiet():
            dcp.save(app_state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        torch.save(rng_state(), tmp / "rng" / f"rank-{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            atomic_write_json(tmp / TRAINER_STATE, trainer_state)
            if final.exists():
                old = self.root / f".old-step-{step:08d}"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            for stale in self.checkpoints()[: -self.keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        return final

    def load(self, path: str | os.PathLike, app_state: dict[str, Any]) -> dict[str, Any]:
        """Fill `app_state` in place from the checkpoint at `path`, restore this rank's RNG states,
        and return the trainer state."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        state_file = path / TRAINER_STATE
        if not state_file.exists():
            raise FileNotFoundError(f"{str(state_file)!r} does not exist; is {str(path)!r} a complete checkpoint?")
        with _single_process_quiet():
            dcp.load(app_state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        rng_file = path / "rng" / f"rank-{_rank()}.pt"
        if not rng_file.exists():
            raise FileNotFoundError(
                f"{str(rng_file)!r} does not exist; was the checkpoint written by a run with fewer ranks?"
            )
        set_rng_state(torch.load(rng_file, weights_only=False))
        return json.loads(state_file.read_text())
