"""The run directory check made before a run builds anything: a new run never writes over an
earlier one, a resume finds the checkpoint it was asked for (intact), and a directory that cannot
be written is reported before any work is done.

Rank 0 looks at the file system and the other ranks receive its answer, so every rank raises the
same error or resumes from the same checkpoint.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch.distributed as dist

from archon.checkpoint.atomic import recover_directories
from archon.checkpoint.resume import (
    STEP_DIR,
    TRAINER_STATE,
    CheckpointError,
    CheckpointManager,
    check_same_settings,
    checkpoint_problems,
    lora_settings,
    read_trainer_state,
)

logger = logging.getLogger("archon.rl")

CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters"
SUPERSEDED = "superseded"
ADAPTER_EXPORT = re.compile(r"step_(\d+)")
# Everything a run writes into its directory; `--overwrite` deletes these and nothing else.
RUN_OUTPUTS = (
    CHECKPOINTS, "adapter", ADAPTERS, SUPERSEDED, "metrics.jsonl", "tensorboard", "curves.png", "vllm_logs", "vllm_adapters",
    "tasks",
)  # fmt: skip


def _is_run_output(name: str) -> bool:
    # leftovers of killed atomic writes: `.<output>.tmp`, `.<output>.old`, `.<file>.<random>.tmp`
    return name in RUN_OUTPUTS or (name.startswith(".") and name.endswith((".tmp", ".old")))


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise PermissionError(
            f"run directory {directory} cannot be written ({e.strerror or e}); a run writes its checkpoints, "
            "adapters and metrics there: choose another --logging.run-dir or make it writable"
        ) from None


def _start_fresh(run_dir: Path, overwrite: bool) -> None:
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.is_dir() else []
    if entries and not overwrite:
        raise FileExistsError(
            f"run directory {run_dir} is not empty ({', '.join(entries[:8])}{', ...' if len(entries) > 8 else ''}); "
            "pass --resume to continue the run in it, --overwrite to delete its outputs and start again, "
            "or choose another --logging.run-dir"
        )
    others = [name for name in entries if not _is_run_output(name)]
    if others:
        raise FileExistsError(
            f"run directory {run_dir} holds files that are not a run's outputs ({', '.join(others)}); "
            "--overwrite deletes only a run's outputs, so move them or choose another --logging.run-dir"
        )
    _check_writable(run_dir)
    for name in entries:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    if entries:
        logger.warning("--overwrite: deleted the earlier run's outputs in %s: %s", run_dir, ", ".join(entries))


def _recover(run_dir: Path, manager: CheckpointManager) -> None:
    """Undo what writes killed in the earlier run left (see archon.checkpoint.atomic)."""
    _check_writable(run_dir)
    manager.recover()
    recover_directories(run_dir)
    recover_directories(run_dir / ADAPTERS)


def _checkpoint_to_resume(run_dir: Path, resume: str, world_size: int, lora) -> Path:
    manager = CheckpointManager(run_dir / CHECKPOINTS)
    if resume == "latest":
        if manager.root.is_dir():
            _recover(run_dir, manager)
        path = manager.latest()
        if path is None:
            state = "is empty" if manager.root.is_dir() else "does not exist"
            raise FileNotFoundError(
                f"--resume: there is no checkpoint to resume in {manager.root} (the directory {state}); "
                "check --logging.run-dir, give a checkpoint directory with --resume PATH, or drop --resume "
                "to start a new run"
            )
    else:
        path = Path(resume)
        if not (path / TRAINER_STATE).exists() and not (path.is_dir() and any(path.glob("*.distcp"))):
            raise FileNotFoundError(
                f"--resume {resume}: {'no such directory' if not path.exists() else 'not a checkpoint directory'}; "
                f"a checkpoint is a directory RUN_DIR/{CHECKPOINTS}/step-NNNNNNNN (a bare --resume takes the newest)"
            )
        _recover(run_dir, manager)
    problems = checkpoint_problems(path, world_size)
    if problems:
        intact = CheckpointManager(path.parent).newest_intact(path, world_size)
        advice = (
            f"the newest intact checkpoint before it is {intact}: resume from it with --resume {intact}"
            if intact is not None
            else f"no older checkpoint in {path.parent} is intact"
        )
        raise CheckpointError(f"checkpoint {path} is damaged:\n  " + "\n  ".join(problems) + f"\n{advice}")
    check_same_settings(path, read_trainer_state(path), {"lora": lora_settings(lora)})
    in_this_run = path.parent.resolve() == manager.root.resolve()
    if in_this_run:
        _set_aside_newer_outputs(run_dir, manager, path)
    return path


def _set_aside_newer_outputs(run_dir: Path, manager: CheckpointManager, path: Path) -> None:
    """Resuming from an older checkpoint starts a new history from it: the newer checkpoints and
    adapter exports of the earlier one move to RUN_DIR/superseded/after-<checkpoint>-<n>/, so that a
    later bare --resume cannot pick them up and pruning cannot count them, and nothing is deleted."""
    step = int(STEP_DIR.fullmatch(path.name).group(1))
    newer = [p for p in manager.checkpoints() if int(STEP_DIR.fullmatch(p.name).group(1)) > step]
    adapters = run_dir / ADAPTERS
    if adapters.is_dir():
        newer += [
            p for p in adapters.iterdir()
            if ADAPTER_EXPORT.fullmatch(p.name) and int(ADAPTER_EXPORT.fullmatch(p.name).group(1)) > step
        ]  # fmt: skip
    if not newer:
        return
    superseded = run_dir / SUPERSEDED
    n = sum(1 for p in superseded.glob(f"after-{path.name}-*")) if superseded.is_dir() else 0
    target = superseded / f"after-{path.name}-{n}"
    for p in newer:
        (target / p.parent.name).mkdir(parents=True, exist_ok=True)
        os.replace(p, target / p.parent.name / p.name)
    logger.warning(
        "resuming from %s: the earlier run's newer outputs (%s) were moved to %s",
        path, ", ".join(f"{p.parent.name}/{p.name}" for p in newer), target,
    )  # fmt: skip


def prepare_run_dir(run_dir: str | os.PathLike, resume: str | None, overwrite: bool, lora=None) -> Path | None:
    """Check `run_dir` for a run about to start (every rank calls this, before building anything).
    Returns the checkpoint to resume from, or None for a new run. Raises, on every rank, when the
    run directory holds an earlier run and neither `resume` nor `overwrite` is set, when there is
    nothing to resume, when the checkpoint is damaged or was trained with another LoRA config than
    `lora`, and when the directory cannot be written."""
    run_dir = Path(run_dir)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    outcome: list[Path | None | BaseException] = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            if resume is not None and overwrite:
                raise ValueError("--resume and --overwrite contradict each other: choose one")
            if run_dir.exists() and not run_dir.is_dir():
                raise NotADirectoryError(f"run directory {run_dir} is a file; choose another --logging.run-dir")
            if resume is None:
                _start_fresh(run_dir, overwrite)
            else:
                outcome[0] = _checkpoint_to_resume(run_dir, resume, world_size, lora)
        except Exception as e:  # every rank must learn of it, or the others wait in the broadcast
            outcome[0] = e
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return outcome[0]
