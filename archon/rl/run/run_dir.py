"""The run directory check made before a run builds anything: a new run never writes over an
earlier one, a resume finds the checkpoint it was asked for (intact), and a directory that cannot
be written is reported before any work is done.

A run holds its directory from the check to its end (RUN_DIR/run.lock, see RunDirLock), so that a
second run on it fails at once instead of mixing its checkpoints and metrics with the first's.

Rank 0 looks at the file system (and holds the lock) and the other ranks receive its answer, so
every rank raises the same error or resumes from the same checkpoint.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from archon.distributed import first_rank_then_broadcast
from archon.rl.samples import SAMPLES_DIR
from archon.rl.trackers import TRACKER_DIRS, TRACKERS_STATE

logger = logging.getLogger("archon.rl")

CHECKPOINTS = "checkpoints"
ADAPTERS = "adapters"
SUPERSEDED = "superseded"
TASKS_DIR = "tasks"
"""A multi-task run's outputs: RUN_DIR/tasks/<name>/ for each task (archon.rl.run.task)."""
LOCK_FILE = "run.lock"
ADAPTER_EXPORT = re.compile(r"step_(\d+)")
# Everything a run writes into its directory; `--overwrite` deletes these and nothing else.
RUN_OUTPUTS = (
    CHECKPOINTS,
    "adapter",
    ADAPTERS,
    SUPERSEDED,
    "metrics.jsonl",
    "tensorboard",
    "curves.png",
    "vllm_logs",
    "vllm_adapters",
    TASKS_DIR,
    SAMPLES_DIR,
    TRACKERS_STATE,
    *TRACKER_DIRS,
)


def _is_run_output(name: str) -> bool:
    # leftovers of killed atomic writes: `.<output>.tmp`, `.<output>.old`, `.<file>.<random>.tmp`
    return name in RUN_OUTPUTS or (name.startswith(".") and name.endswith((".tmp", ".old")))


def _not_writable(directory: Path, error: OSError) -> PermissionError:
    return PermissionError(
        f"run directory {directory} cannot be written ({error.strerror or error}); a run writes its checkpoints, "
        "adapters and metrics there: choose another --logging.run-dir or make it writable"
    )


def _check_writable(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-check.", suffix=".tmp", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _not_writable(directory, e) from None


class RunDirInUseError(RuntimeError):
    """Another process holds the run directory."""


def _holder(record: bytes) -> str:
    """Who a lock file names, in words."""
    try:
        holder = json.loads(record)
        return f"process {holder['pid']} on {holder['host']} (started {holder['started']})"
    except (ValueError, TypeError, KeyError):
        return "another process"


class RunDirLock:
    """A run's exclusive hold on its directory: RUN_DIR/run.lock, locked with flock(2) while the run
    uses the directory, and naming its holder (pid, host, start time) for the others' messages.

    The OS drops a flock when the process holding it ends, however it ends, so the lock a crashed
    run left is free: it is taken over, with a warning naming that run. `release` removes the file.
    """

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._file = None
        self._made_run_dir = False

    def acquire(self) -> None:
        """Take the lock, or raise RunDirInUseError naming its holder (at once, without waiting)."""
        self._made_run_dir = not self.run_dir.exists()
        while True:
            try:
                self.run_dir.mkdir(parents=True, exist_ok=True)
                lock_file = os.fdopen(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644), "r+b")
            except OSError as e:
                raise _not_writable(self.run_dir, e) from None
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock_file.seek(0)
                holder = _holder(lock_file.read())
                lock_file.close()
                raise RunDirInUseError(
                    f"run directory {self.run_dir} is in use by {holder}, which holds {self.path}: two runs in one "
                    "directory would mix their checkpoints and metrics. Wait for that run to end (or stop it), or "
                    "choose another --logging.run-dir"
                ) from None
            # the holder before may have removed the file between its opening and the flock: lock the new one
            with contextlib.suppress(FileNotFoundError):
                if os.stat(self.path).st_ino == os.fstat(lock_file.fileno()).st_ino:
                    break
            lock_file.close()
        lock_file.seek(0)
        previous = lock_file.read()
        lock_file.truncate(0)
        started = time.strftime("%Y-%m-%d %H:%M:%S %z")
        lock_file.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": started}).encode())
        lock_file.flush()
        self._file = lock_file
        if previous.strip():
            logger.warning(
                "run directory %s: took over %s from %s, which ended without releasing it (it crashed or was killed)",
                self.run_dir,
                self.path,
                _holder(previous),
            )

    def release(self) -> None:
        """Give the directory up (nothing when not held); a directory that `acquire` made and that is
        still empty is removed again."""
        if self._file is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self._file.close()  # drops the flock
        self._file = None
        if self._made_run_dir:
            with contextlib.suppress(OSError):  # not empty: the run wrote there
                self.run_dir.rmdir()


@dataclass
class PreparedRunDir:
    """A run directory checked for a run about to start and held by it (see prepare_run_dir)."""

    path: Path
    resume_from: Path | None
    """The checkpoint to resume from: None for a new run, and for a multi-task run (each task
    resumes from its own newest checkpoint)."""
    lock: RunDirLock | None
    """Rank 0's hold on the directory (None on the other ranks)."""

    def release(self) -> None:
        """Give the directory up; whoever called prepare_run_dir calls this once the run has ended
        (normally, by an error or by an interrupt)."""
        if self.lock is not None:
            self.lock.release()


def _start_fresh(run_dir: Path, overwrite: bool) -> None:
    entries = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE) if run_dir.is_dir() else []
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


def _recover(directory: Path, manager: CheckpointManager) -> None:
    """Undo what writes killed in the earlier run left in `directory`, a run's or a task's, whose
    checkpoints `manager` keeps (see archon.checkpoint.atomic)."""
    manager.recover()
    recover_directories(directory)
    recover_directories(directory / ADAPTERS)


def _recover_tasks(run_dir: Path, tasks: Sequence[str]) -> None:
    """A multi-task resume: what killed writes left in the run directory and in the directory of
    each task of `tasks` (the tasks each resume from their own newest checkpoint afterwards)."""
    _check_writable(run_dir)
    recover_directories(run_dir)
    for name in tasks:
        task_dir = run_dir / TASKS_DIR / name
        _recover(task_dir, CheckpointManager(task_dir / CHECKPOINTS))


def _task_step_to_resume(run_dir: Path, path: Path, tasks: Sequence[str], world_size: int) -> Path:
    """A multi-task resume from a checkpoint `path` (RUN_DIR/tasks/<name>/checkpoints/step-N): every
    task resumes from its own checkpoint of step N, a task never saved starts fresh. Refused, naming
    the task, when a task that has checkpoints has none of step N or a damaged one; each task's
    newer outputs are set aside as for a single-adapter resume from an older checkpoint."""
    match = STEP_DIR.fullmatch(path.name)
    if match is None or not (path / TRAINER_STATE).exists():
        raise FileNotFoundError(
            f"--resume {path}: {'no such directory' if not path.exists() else 'not a checkpoint directory'}; a "
            f"multi-task run resumes from a checkpoint RUN_DIR/{TASKS_DIR}/<name>/{CHECKPOINTS}/step-NNNNNNNN, and "
            "every task from its own checkpoint of that step (a bare --resume takes each task's newest)"
        )
    step = int(match.group(1))
    for name in tasks:
        task_dir = run_dir / TASKS_DIR / name
        manager = CheckpointManager(task_dir / CHECKPOINTS)
        if not manager.checkpoints():
            continue
        checkpoint = manager.step_dir(step)
        if not checkpoint.is_dir():
            saved = ", ".join(p.name for p in manager.checkpoints())
            raise FileNotFoundError(
                f"--resume {path}: task {name!r} has no checkpoint of step {step} (it has {saved}); every task "
                "with checkpoints resumes from its checkpoint of the step given"
            )
        problems = checkpoint_problems(checkpoint, world_size)
        if problems:
            raise CheckpointError(
                f"--resume {path}: task {name!r}: checkpoint {checkpoint} is damaged:\n  " + "\n  ".join(problems)
            )
        _set_aside_newer_outputs(task_dir, manager, checkpoint)
    return path


def _checkpoint_to_resume(run_dir: Path, resume: str, world_size: int, lora) -> Path:
    manager = CheckpointManager(run_dir / CHECKPOINTS)
    if resume == "latest":
        if manager.root.is_dir():
            _check_writable(run_dir)
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
        _check_writable(run_dir)
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
            p
            for p in adapters.iterdir()
            if ADAPTER_EXPORT.fullmatch(p.name) and int(ADAPTER_EXPORT.fullmatch(p.name).group(1)) > step
        ]
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
        path,
        ", ".join(f"{p.parent.name}/{p.name}" for p in newer),
        target,
    )


def prepare_run_dir(
    run_dir: str | os.PathLike, resume: str | None, overwrite: bool, lora=None, tasks: Sequence[str] = ()
) -> PreparedRunDir:
    """Check `run_dir` for a run about to start and take its lock (every rank calls this, before
    building anything; rank 0 holds the lock). Returns the checkpoint to resume from (None for a new
    run) and the lock, which the caller releases when the run ends. Raises, on every rank, when
    another process holds the directory, when it holds an earlier run and neither `resume` nor
    `overwrite` is set, when there is nothing to resume, when the checkpoint is damaged or was
    trained with another LoRA config than `lora`, and when the directory cannot be written.

    `tasks`: the task names of a multi-task run. Its resume undoes what killed writes left in each
    task's directory; each task then resumes from its own newest checkpoint ("latest"), or from its
    checkpoint of the step of the checkpoint `resume` names."""
    run_dir = Path(run_dir)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    lock = RunDirLock(run_dir) if not dist.is_initialized() or dist.get_rank() == 0 else None

    def check() -> Path | None:
        """Rank 0's check: the checkpoint to resume from, or None."""
        try:
            if resume is not None and overwrite:
                raise ValueError("--resume and --overwrite contradict each other: choose one")
            if run_dir.exists() and not run_dir.is_dir():
                raise NotADirectoryError(f"run directory {run_dir} is a file; choose another --logging.run-dir")
            lock.acquire()
            if resume is None:
                _start_fresh(run_dir, overwrite)
            elif tasks:
                _recover_tasks(run_dir, tasks)
                if resume != "latest":
                    return _task_step_to_resume(run_dir, Path(resume), tasks, world_size)
            else:
                return _checkpoint_to_resume(run_dir, resume, world_size, lora)
            return None
        except BaseException:
            lock.release()
            raise

    return PreparedRunDir(run_dir, first_rank_then_broadcast(check), lock)


def prune_adapter_exports(adapters_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step_NNNNNN adapter exports in `adapters_dir`."""
    exports = [p for p in adapters_dir.iterdir() if ADAPTER_EXPORT.fullmatch(p.name)]
    exports.sort(key=lambda p: int(ADAPTER_EXPORT.fullmatch(p.name).group(1)))
    for stale in exports[:-keep]:
        shutil.rmtree(stale)
