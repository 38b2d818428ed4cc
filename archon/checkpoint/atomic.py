"""Atomic file and directory writes: write to a temporary sibling, then rename over the target.

A directory is replaced in two renames (`path` -> `.<name>.old`, then `.<name>.tmp` -> `path`).
A process killed between them leaves the previous complete copy at `.<name>.old`;
`recover_directory` (run before the next write, and by the run-directory check before a resume)
puts it back, and removes what a killed write left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb"):
    """Yield a file handle; on success the file appears at `path` in one rename, on error nothing does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, mode) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    with atomic_file(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


def atomic_save_safetensors(tensors: dict, path: str | os.PathLike, metadata: dict[str, str] | None = None) -> None:
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)
    with atomic_file(path) as f:
        f.write(data)


def staging_path(path: Path) -> Path:
    """Where the next version of directory `path` is written before it is renamed into place."""
    return path.parent / f".{path.name}.tmp"


def aside_path(path: Path) -> Path:
    """Where the previous version of directory `path` waits while the new one is renamed in."""
    return path.parent / f".{path.name}.old"


def recover_directory(path: str | os.PathLike) -> None:
    """Finish what a killed replace of directory `path` left: a previous version moved aside with
    nothing in its place is put back (it is the newest complete one), a previous version whose
    replacement is in place is removed, and a partly written new version is removed."""
    path = Path(path)
    old = aside_path(path)
    if old.is_dir():
        if path.exists():
            shutil.rmtree(old)
        else:
            os.replace(old, path)
    shutil.rmtree(staging_path(path), ignore_errors=True)


def recover_directories(parent: str | os.PathLike) -> None:
    """`recover_directory` for every directory under `parent` that a killed write left behind,
    and removal of the temporary files of killed `atomic_file` writes."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    for entry in sorted(parent.iterdir()):
        name = entry.name
        if not name.startswith("."):
            continue
        if entry.is_dir() and (name.endswith(".old") or name.endswith(".tmp")):
            recover_directory(parent / name[1:-4])
        elif entry.is_file() and name.endswith(".tmp"):
            entry.unlink()


def replace_directory(new: Path, path: Path) -> None:
    """Rename the complete directory `new` to `path`, replacing any previous version (see the module
    docstring for what a kill between the two renames leaves)."""
    old = aside_path(path)
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike):
    """Yield a temporary directory to fill; on success it replaces `path` whole.

    An existing `path` is moved aside first and removed only after the new one is in place. One
    process writes a given `path` at a time.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_directory(path)
    tmp = staging_path(path)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_directory(tmp, path)
