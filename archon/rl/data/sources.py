"""Where a dataset's rows come from: a JSONL or Parquet file, a local HF `datasets` directory, a
Hugging Face dataset by name, or a reasoning-gym task. Each source is read as (row number, row,
problem) items, a malformed row's problem naming what is wrong with it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import parse_qsl

from archon.rl.data import reasoning_gym
from archon.rl.data.config import DataConfig


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, row, problem) for each non-blank line. A line that is not valid UTF-8 is a
    problem row, never decoded with replacement characters."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                # a byte-order mark may open the file
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield line_number, None, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset {exc.start})"
                continue
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield line_number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    for index, row in enumerate(pq.read_table(path).to_pylist()):
        yield index, row, None


def _iter_datasets_dir(path: Path, split: str) -> Iterator[tuple[int, Any, str | None]]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path} has splits {sorted(loaded)}, not {split!r}; set the data split")
        loaded = loaded[split]
    for index, row in enumerate(loaded):
        yield index, row, None


def _hub_cache_dir(name: str) -> Path:
    """Where datasets keeps the prepared copy of Hugging Face dataset `name` (owner/name)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    owner, repo = name.split("/")
    return Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{camelcase_to_snakecase(repo)}"


def _open_hub(name: str, subset: str | None, split: str) -> Iterator[tuple[int, Any, str | None]]:
    """The rows of a Hugging Face dataset, through datasets.load_dataset: its cache first, the Hub
    only when online (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE make it use the cache alone)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        loaded = datasets.load_dataset(name, subset, split=split)
    except (ConnectionError, FileNotFoundError, ValueError, DatasetNotFoundError) as e:
        raise ValueError(_hub_problem(name, subset, split, e)) from e
    return ((index, row, None) for index, row in enumerate(loaded))


def _hub_problem(name: str, subset: str | None, split: str, error: Exception) -> str:
    import datasets

    which = f"Hugging Face dataset {name!r}" + (f" (subset {subset!r})" if subset else "") + f", split {split!r}"
    cached = _hub_cache_dir(name)
    message = f"data path: {which} could not be loaded: {type(error).__name__}: {error}"
    if cached.is_dir():
        return message
    offline = " (offline mode is on: HF_DATASETS_OFFLINE or HF_HUB_OFFLINE)" if datasets.config.HF_HUB_OFFLINE else ""
    load = f"datasets.load_dataset({name!r}" + (f", {subset!r}" if subset else "") + ")"
    return (
        f"{message}. It is not in the local datasets cache (looked in {cached}) and the Hub could not be "
        f"reached{offline}. Download it first where the Hub can be reached, with the same HF_HOME or "
        f'HF_DATASETS_CACHE: python -c "import datasets; {load}"; or set data.path to a local '
        ".jsonl/.parquet file or save_to_disk directory (a local path that exists is always used as one)."
    )


def _iter_reasoning_gym(path: str, system_prompt: str | None) -> Iterator[tuple[int, Any, str | None]]:
    if (problem := reasoning_gym.source_problem(path)) is not None:
        raise ValueError(f"data path {path!r}: {problem}")
    source = reasoning_gym.parse_source(path)
    for index, (messages, entry) in enumerate(reasoning_gym.load_entries(source, system_prompt)):
        yield index, {"data_source": source.task, "prompt": messages, "entry": entry}, None


HUB_OPTIONS = ("subset", "split")
"""What a Hugging Face dataset name may set after a "?" (owner/name?split=test), over data.subset and data.split."""
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def hub_name(path: str) -> tuple[str, dict[str, str]] | None:
    """(owner/name, options) when `path` names a Hugging Face dataset rather than a local file, else
    None. A name does not exist locally, has exactly one slash between two names, no file suffix
    of ours, and may end in ?subset=...&split=... (see HUB_OPTIONS; checked by data_path_problem)."""
    if not path or Path(path).exists():
        return None
    name, _, query = path.partition("?")
    if name.count("/") != 1:
        return None
    owner, repo = name.split("/")
    if not (_HUB_PART.fullmatch(owner) and _HUB_PART.fullmatch(repo)):
        return None
    if repo.lower().endswith((".jsonl", ".ndjson", ".parquet")):
        return None
    return name, dict(parse_qsl(query, keep_blank_values=True))


def _hub_options_problem(path: str) -> str | None:
    _, _, query = path.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        return f"cannot read the options after '?': {e}"
    keys = [key for key, _ in pairs]
    unknown = sorted(set(keys) - set(HUB_OPTIONS))
    if unknown:
        return (
            f"unknown option {', '.join(map(repr, unknown))} after the dataset name (options: {', '.join(HUB_OPTIONS)})"
        )
    if len(keys) != len(set(keys)) or any(not value for _, value in pairs):
        return "each option after the dataset name is given once, with a value"
    return None


def data_path_problem(path: str) -> str | None:
    """What is wrong with a data or eval path that can be told without loading it, or None: a
    reasoning-gym source with a bad form, task or setting, a Hugging Face dataset name with bad
    options, or a local path that does not exist and is not shaped like a dataset name (whose cache
    is looked at only when loading)."""
    if reasoning_gym.is_source(path):
        return reasoning_gym.source_problem(path)
    if Path(path).exists():
        return None
    if hub_name(path) is not None:
        return _hub_options_problem(path)
    return "no such file or directory (nor a Hugging Face dataset name, owner/name)"


def open_rows(config: DataConfig) -> tuple[Iterator[tuple[int, Any, str | None]], bool]:
    """The rows of config.path as (row number, row, problem), and whether the row numbers are line
    numbers (JSONL's); a source that cannot be read at all raises."""
    path = Path(config.path)
    if reasoning_gym.is_source(config.path):
        return _iter_reasoning_gym(config.path, config.system_prompt), False
    if (named := hub_name(config.path)) is not None:
        if (problem := _hub_options_problem(config.path)) is not None:
            raise ValueError(f"data path {config.path!r}: {problem}")
        name, options = named
        subset, split = options.get("subset", config.subset), options.get("split", config.split)
        return _open_hub(name, subset, split), False
    if path.is_dir():
        if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"{path} is a directory but not one written by datasets' save_to_disk")
        return _iter_datasets_dir(path, config.split), False
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path), True
    if suffix == ".parquet":
        return _iter_parquet(path), False
    raise ValueError(f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .parquet or a datasets directory")


def data_sources_of(config: DataConfig) -> set[str]:
    """The `data_source` values of the rows of config.path ("" for rows without one), read without
    tokenizing: what the reward routing is checked against before a model is loaded. Malformed
    rows are left out (loading reports them)."""
    rows, _ = open_rows(config)
    found = set()
    for _, row, problem in rows:
        if problem is None and isinstance(row, dict):
            source = row.get("data_source")
            found.add(source if isinstance(source, str) else "")
    return found
