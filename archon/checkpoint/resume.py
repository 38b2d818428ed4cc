"""Resume checkpoints: sharded state through torch.distributed.checkpoint, written atomically.

Layout of one checkpoint, `<root>/step-<step:08d>/`:

    *.distcp, .metadata     DCP shards of the trainable parameters and the optimizer state
    rng/rank-<r>.pt         each rank's RNG states (torch CPU and accelerator, Python, NumPy), as
                            tensors and plain Python values, so they load with weights_only=True
    trainer_state.json      step, LR-schedule state, data-loader position, LoRA config (rank 0)

Everything is written into `<root>/.step-<step>.tmp` and renamed into place by rank 0 once every
rank has finished, so a directory named `step-*` is always complete. Re-saving a step moves the
old copy aside first (archon.checkpoint.atomic.replace_directory); `recover` undoes what a kill
between the renames left. The newest `keep_last` up to the saved step are kept; newer ones (from a
run resumed at an earlier checkpoint) are left alone. All ranks must see the same `root` (a shared
file system when ranks span machines).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from archon.checkpoint.atomic import (
    atomic_write_json,
    recover_directories,
    replace_directory,
    staging_path,
)
from archon.device import npu_available

STEP_DIR = re.compile(r"step-(\d{8})")
TRAINER_STATE = "trainer_state.json"
METADATA = ".metadata"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded: damaged files, or state that does not fit this run."""


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


# ---- RNG state ------------------------------------------------------------------------------------
# Stored as tensors, ints, floats and lists only, so `torch.load(weights_only=True)` reads it and a
# checkpoint from elsewhere cannot run code when it is loaded.


def rng_state() -> dict[str, Any]:
    version, mt_state, gauss_next = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(mt_state), gauss_next]}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    if npu_available():
        state["npu"] = torch.npu.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, mt_state, gauss_next = state["python"]
    random.setstate((version, tuple(mt_state), gauss_next))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached_gaussian = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "npu" in state:
        torch.npu.set_rng_state_all(state["npu"])


def _load_failure(e: Exception) -> str:
    """The informative part of a torch.load error (the weights_only unpickler's own text is long)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().splitlines()[0]
        return detail.split(". Please use")[0]
    return text.strip().splitlines()[0] if text.strip() else type(e).__name__


def read_rng_state(path: Path) -> dict[str, Any]:
    """Load one rank's RNG file with weights_only=True; anything else in it is refused."""
    try:
        state = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist; was the checkpoint written by a run with fewer ranks?") from None
    except Exception as e:
        reason = _load_failure(e)
        if "numpy" in reason:
            reason += (
                " (an RNG file holding NumPy arrays is in the format used before RNG states were stored "
                "as tensors; such checkpoints cannot be resumed)"
            )
        raise CheckpointError(
            f"{path} is not a readable RNG state file (loaded with weights_only=True: only tensors and plain "
            f"values are accepted): {reason}"
        ) from None
    if not (
        isinstance(state, dict)
        and isinstance(state.get("torch"), torch.Tensor)
        and isinstance(state.get("python"), (list, tuple))
        and len(state["python"]) == 3
    ):
        raise CheckpointError(f"{path} does not hold an RNG state (expected keys 'torch' and 'python')")
    return state


# ---- checking a checkpoint before loading it ------------------------------------------------------


def read_trainer_state(path: Path) -> dict[str, Any]:
    state_file = Path(path) / TRAINER_STATE
    try:
        state = json.loads(state_file.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{state_file} does not exist; is {path} a complete checkpoint?") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{state_file} cannot be read: {e}") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{state_file} is not a trainer state (a JSON object with an integer 'step')")
    step = state["step"]
    # a resume keeps the metrics of the steps up to this one and drops the rest: a bad one would lose them
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CheckpointError(f"{state_file}: 'step' is {step!r}, not an RL step (an integer >= 0)")
    return state


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; this reads it allowing only the classes such an index is made of,
    so a hostile one cannot run code."""

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.filesystem as dcp_filesystem
        import torch.distributed.checkpoint.metadata as dcp_metadata

        allowed = {
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_filesystem._StorageInfo,
            ("torch", "Size"): torch.Size,
            ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
            ("pathlib", "PosixPath"): Path().__class__,
            ("pathlib", "WindowsPath"): Path().__class__,
        }
        if (module, name) in allowed:
            return allowed[(module, name)]
        value = getattr(dcp_metadata if module == dcp_metadata.__name__ else torch, name, None)
        if module == dcp_metadata.__name__ and isinstance(value, type) and value.__module__ == module:
            return value
        if module == "torch" and isinstance(value, torch.dtype):
            return value
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def read_metadata(path: Path):
    """The DCP index of the checkpoint at `path` (which tensors are in which .distcp file); an index
    that points at a file outside the checkpoint directory is refused."""
    metadata_file = Path(path) / METADATA
    try:
        with open(metadata_file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except FileNotFoundError:
        raise CheckpointError(f"{metadata_file} does not exist; is {path} a complete checkpoint?") from None
    except Exception as e:
        raise CheckpointError(f"{metadata_file} cannot be read: {e}") from None
    inside = Path(path).resolve()
    for relative in {getattr(info, "relative_path", None) for info in getattr(metadata, "storage_data", {}).values()}:
        if not isinstance(relative, str) or inside not in (inside / relative).resolve().parents:
            raise CheckpointError(
                f"{metadata_file} names storage file {relative!r}, which is not a file inside the checkpoint "
                f"directory {path}; the index is damaged or forged"
            )
    return metadata


def _check_shards(path: Path, metadata, tensors: bool = True) -> list[str]:
    """Every stored item is inside its .distcp file and deserializes with weights_only=True; with
    `tensors=False` only the non-tensor items are read. DCP itself loads the non-tensor items with
    weights_only=False, so this check is what keeps a hostile file from running code."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensor_keys = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        by_file.setdefault(info.relative_path, []).append((index, info))
    problems: list[str] = []
    for relative_path, items in sorted(by_file.items()):
        shard = path / relative_path
        needed = max(info.offset + info.length for _, info in items)
        try:
            size = shard.stat().st_size
            if size < needed:
                problems.append(f"{shard} is truncated: {size} bytes, its index in {METADATA} needs {needed}")
                continue
            with open(shard, "rb") as f:
                for index, info in items:
                    if not tensors and index.fqn in tensor_keys:
                        continue
                    f.seek(info.offset)
                    try:
                        torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
                    except Exception as e:
                        problems.append(
                            f"{shard} is corrupt: {index.fqn!r} does not load with weights_only=True "
                            f"({_load_failure(e)})"
                        )
                        break
        except OSError as e:
            problems.append(f"{shard} cannot be read: {e.strerror or e}")
    return problems


def checkpoint_problems(path: str | os.PathLike, world_size: int) -> list[str]:
    """What is wrong with the checkpoint at `path` for a run of `world_size` ranks, each problem
    naming its file; empty when it is complete and readable."""
    path = Path(path)
    problems: list[str] = []
    try:
        read_trainer_state(path)
    except CheckpointError as e:
        problems.append(str(e))
    try:
        problems += _check_shards(path, read_metadata(path))
    except CheckpointError as e:
        problems.append(str(e))
    for rank in range(world_size):
        try:
            read_rng_state(path / "rng" / f"rank-{rank}.pt")
        except CheckpointError as e:
            problems.append(str(e))
    return problems


def _differences(saved: Any, current: Any, where: str) -> list[str]:
    """The fields of `current` whose value in `saved` differs. At the top level, fields `current`
    lacks are not compared (settings recorded by other versions); below it (the entries of
    rank_pattern / alpha_pattern, ...) every key of either side is."""
    if isinstance(saved, dict) and isinstance(current, dict):
        keys = list(current) + ([k for k in saved if k not in current] if where.count(".") >= 1 else [])
        return [d for key in keys for d in _differences(saved.get(key), current.get(key), f"{where}.{key}")]
    return [] if saved == current else [f"{where}: checkpoint {saved!r}, this run {current!r}"]


def lora_settings(lora) -> dict[str, Any] | None:
    """The settings of a LoRAConfig that its trained weights depend on (all but dropout), as stored
    under "lora" in trainer_state.json and compared when resuming."""
    if lora is None:
        return None
    from dataclasses import asdict

    settings = json.loads(json.dumps(asdict(lora)))
    settings.pop("dropout")
    return settings


def check_same_settings(path: Path, trainer_state: dict[str, Any], expected: dict[str, Any]) -> None:
    """Each entry of `expected` equals the checkpoint's; entries the checkpoint did not record are
    not compared."""
    differences = [
        d
        for key, value in expected.items()
        if key in trainer_state
        for d in _differences(trainer_state[key], json.loads(json.dumps(value)), key)
    ]
    if differences:
        raise CheckpointError(
            f"checkpoint {path} was trained with other settings than this run, so its weights do not fit "
            "(resume with the checkpoint's settings, or start a new run):\n  " + "\n  ".join(differences)
        )


def _check_keys(path: Path, metadata, model_state: dict[str, Any]) -> None:
    """The checkpoint holds exactly this model's trainable tensors, with the same shapes."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = {
        k[len("model.") :]: v.size
        for k, v in metadata.state_dict_metadata.items()
        if k.startswith("model.") and isinstance(v, TensorStorageMetadata)
    }
    shapes = [
        f"{k} (checkpoint {tuple(stored[k])}, this run {tuple(t.shape)})"
        for k, t in sorted(model_state.items())
        if k in stored and tuple(stored[k]) != tuple(t.shape)
    ]
    groups = {
        "missing from the checkpoint": sorted(model_state.keys() - stored.keys()),
        "in the checkpoint but not trainable in this run": sorted(stored.keys() - model_state.keys()),
        "other shape": shapes,
    }
    problems = [
        f"{what} ({len(keys)}): {', '.join(keys[:4])}{', ...' if len(keys) > 4 else ''}"
        for what, keys in groups.items()
        if keys
    ]
    if problems:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model's trainable parameters:\n  " + "\n  ".join(problems)
        )


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

    def recover(self) -> None:
        """Put back a checkpoint that a kill during its re-save left moved aside, and remove partly
        written ones. One process (rank 0) calls it, before listing checkpoints to resume from."""
        recover_directories(self.root)

    def newest_intact(self, before: Path, world_size: int) -> Path | None:
        """The newest checkpoint older than `before` that `checkpoint_problems` finds nothing wrong with."""
        older = [p for p in self.checkpoints() if p.name < before.name]
        return next((p for p in reversed(older) if not checkpoint_problems(p, world_size)), None)

    def save(self, step: int, app_state: dict[str, Any], trainer_state: dict[str, Any]) -> Path:
        """Write `app_state` (DCP state dicts) and `trainer_state` (JSON) for `step`; every rank calls it."""
        import torch.distributed.checkpoint as dcp

        final = self.step_dir(step)
        tmp = staging_path(final)
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            self.recover()
            tmp.mkdir()
            (tmp / "rng").mkdir()
        _barrier()
        with _single_process_quiet():
            dcp.save(app_state, checkpoint_id=str(tmp), no_dist=not dist.is_initialized())
        torch.save(rng_state(), tmp / "rng" / f"rank-{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            atomic_write_json(tmp / TRAINER_STATE, trainer_state)
            replace_directory(tmp, final)
            up_to_this = [p for p in self.checkpoints() if p.name <= final.name]
            for stale in up_to_this[: -self.keep_last]:
                shutil.rmtree(stale, ignore_errors=True)
        _barrier()
        return final

    def load(
        self, path: str | os.PathLike, app_state: dict[str, Any], expected: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Fill `app_state` in place from the checkpoint at `path`, restore this rank's RNG states,
        and return the trainer state.

        `expected`: trainer-state entries that must equal this run's (the LoRA config); a difference
        is an error naming each field, raised before any tensor is read. `app_state["model"]` must
        match the stored tensors key for key and shape for shape.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        path = Path(path)
        trainer_state = read_trainer_state(path)
        check_same_settings(path, trainer_state, expected or {})
        metadata = read_metadata(path)
        _check_keys(path, metadata, app_state.get("model", {}))
        problems = _check_shards(path, metadata, tensors=False)
        if problems:
            raise CheckpointError(f"checkpoint {path} is damaged:\n  " + "\n  ".join(problems))
        rng = read_rng_state(path / "rng" / f"rank-{_rank()}.pt")
        try:
            with _single_process_quiet():
                dcp.load(app_state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
        except (CheckpointException, pickle.UnpicklingError, RuntimeError, ValueError, OSError, EOFError) as e:
            files = ", ".join(sorted(p.name for p in path.glob("*.distcp")))
            raise CheckpointError(f"reading the tensors of checkpoint {path} ({files}) failed: {e}") from None
        set_rng_state(rng)
        return trainer_state
