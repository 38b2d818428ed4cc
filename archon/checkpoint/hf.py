"""Hugging Face checkpoints: read (single or sharded safetensors) into an archon model, write back."""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from archon.checkpoint.atomic import (
    atomic_directory,
    atomic_save_safetensors,
    atomic_write_json,
)
from archon.checkpoint.state_dict_converter import StateDictConverter, is_lora_param

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"
# Files that hold a tokenizer's vocabulary in the common formats; named when a directory has no tokenizer.
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json", "vocab.txt")


def _named(path: Path, option: str | None) -> str:
    return f"{str(path)!r} (from {option})" if option else repr(str(path))


def check_model_dir(path: str | os.PathLike | None, option: str | None = None) -> Path:
    """`path` as a Path if it is an HF model directory with a config.json; otherwise an error that
    names the path and `option`, the setting it came from."""
    if path is None:
        raise ValueError(f"no model directory given{f' ({option} is not set)' if option else ''}")
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model directory {_named(path, option)} does not exist")
    if not path.is_dir():
        raise NotADirectoryError(f"model path {_named(path, option)} is a file; expected an HF model directory")
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {_named(path, option)}; expected an HF model directory")
    return path


def load_tokenizer(path: str | os.PathLike, option: str | None = None):
    """The tokenizer saved in directory `path`; fails naming the directory when it holds none (given a
    model directory without one, AutoTokenizer may build an empty tokenizer that encodes text as nothing)."""
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer directory {_named(path, option)} does not exist")
    missing = (
        f"no tokenizer in {_named(path, option)}: none of {', '.join(TOKENIZER_VOCAB_FILES)} is there; save the "
        "tokenizer with the model, or point model.tokenizer at a directory that has one"
    )
    has_vocab_file = any((path / name).exists() for name in TOKENIZER_VOCAB_FILES)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        if not has_vocab_file:
            raise FileNotFoundError(missing) from e
        raise ValueError(f"cannot load the tokenizer in {_named(path, option)}: {e}") from e
    if not tokenizer.encode("a b", add_special_tokens=False):
        if not has_vocab_file:
            raise FileNotFoundError(missing)
        raise ValueError(f"the tokenizer in {_named(path, option)} encodes text as no tokens; its vocabulary is empty")
    return tokenizer


def read_json_file(path: Path, what: str) -> dict:
    """A JSON object from `path`; an error naming the file when it is missing, not JSON or not an object."""
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{what} {str(path)!r} is not valid JSON (corrupt or truncated?): {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} {str(path)!r} must hold a JSON object, got {type(value).__name__}")
    return value


def open_safetensors(file: Path):
    """A safetensors handle; an error naming the file when its header or size is wrong (e.g. truncated)."""
    try:
        return safe_open(file, "pt")
    except SafetensorError as e:
        raise ValueError(f"{str(file)!r} is not a readable safetensors file (truncated or corrupt?): {e}") from None


def warn_non_finite(name: str, tensor: torch.Tensor, file: Path) -> None:
    """Warn, naming the tensor and its file, when `tensor` holds NaN or infinite values."""
    if not tensor.is_floating_point():
        return
    bad = int((~torch.isfinite(tensor)).sum())
    if bad:
        warnings.warn(
            f"tensor {name!r} in {str(file)!r} holds {bad} NaN/inf value(s) of {tensor.numel()}",
            RuntimeWarning,
            stacklevel=2,
        )


class HFCheckpoint:
    """The tensors of an HF checkpoint directory: every file's header is read at once, tensors when asked for."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {str(self.path)!r} does not exist")
        index = self.path / SAFETENSORS_INDEX
        single = self.path / SAFETENSORS_SINGLE
        self._handles: dict[Path, object] = {}
        if index.exists():
            weight_map = read_json_file(index, "checkpoint index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise ValueError(
                    f'checkpoint index {str(index)!r} lacks a "weight_map" object of tensor name -> file name'
                )
            self._file_of = {k: self.path / f for k, f in weight_map.items()}
        elif single.exists():
            self._handles[single] = open_safetensors(single)
            self._file_of = {k: single for k in self._handles[single].keys()}
        else:
            raise FileNotFoundError(
                f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {str(self.path)!r}; "
                "archon reads safetensors checkpoints only"
            )
        # Open every file now, so a missing, truncated or corrupt shard fails before any weight is read.
        for file in sorted(set(self._file_of.values())):
            if not file.exists():
                raise FileNotFoundError(f"checkpoint shard {str(file)!r} named in {str(index)!r} does not exist")
            if file not in self._handles:
                self._handles[file] = open_safetensors(file)
        keys_in = {file: set(handle.keys()) for file, handle in self._handles.items()}
        for key, file in self._file_of.items():
            if key not in keys_in[file]:
                raise KeyError(f"{str(index)!r} puts tensor {key!r} in {str(file)!r}, which does not hold it")

    def keys(self) -> set[str]:
        return set(self._file_of)

    def file_of(self, key: str) -> Path:
        return self._file_of[key]

    def _handle(self, key: str):
        return self._handles[self._file_of[key]]

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def shape(self, key: str) -> list[int]:
        return self._handle(key).get_slice(key).get_shape()

    def dtype(self, key: str) -> torch.dtype:
        return self.get_slice(key, tuple(slice(0, 0) for _ in self.shape(key))).dtype

    def get_slice(self, key: str, region: tuple[slice, ...]) -> torch.Tensor:
        """Read only `region` (one slice per dimension) of tensor `key`."""
        return self._handle(key).get_slice(key)[region]

    def config(self) -> dict:
        return read_json_file(self.path / "config.json", "model config")


def expected_base_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base (non-LoRA) parameters and persistent buffers a checkpoint must provide."""
    state = model.state_dict()
    return {k: v for k, v in state.items() if not is_lora_param(k)}


def local_region(target: torch.Tensor) -> tuple[slice, ...] | None:
    """The box of the global tensor this rank holds (DTensor shards), or None for the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(target, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(target.shape, target.device_mesh, target.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _probe_shape(ndim: int) -> tuple[int, ...]:
    return (2, 3, 5, 7, 11)[:ndim]


def _combine_is_identity(converter: StateDictConverter, key: str, ndim: int) -> bool:
    probe = torch.arange(math.prod(_probe_shape(ndim)), dtype=torch.float32).reshape(_probe_shape(ndim))
    try:
        out = converter.combine(key, [probe])
    except Exception:
        return False
    return out.shape == probe.shape and torch.equal(out, probe)


def _combine_is_stack_of_cat(converter: StateDictConverter, key: str, n_sources: int, n_stacked: int) -> bool:
    """Whether combine(sources) == stack over dim 0 of n_stacked groups, each a cat over dim 0 of
    consecutive sources (how stacked MoE experts are built from per-expert HF tensors)."""
    if n_stacked == 0 or n_sources % n_stacked:
        return False
    probes = [torch.full((1, 1), float(i)) for i in range(n_sources)]
    try:
        out = converter.combine(key, probes)
    except Exception:
        return False
    expected = torch.arange(n_sources, dtype=torch.float32).reshape(n_stacked, n_sources // n_stacked, 1)
    return out.shape == expected.shape and torch.equal(out, expected)


def _shape_error(key: str, sources: list[str], got, want) -> ValueError:
    return ValueError(
        f"checkpoint tensor {sources[0]!r} gives {key!r} shape {tuple(got)}, but the model expects {tuple(want)}"
    )


def check_source_shapes(
    converter: StateDictConverter, checkpoint: HFCheckpoint, key: str, sources: list[str], want: tuple[int, ...]
) -> None:
    """Each checkpoint tensor of archon parameter `key` (shape `want`) must have the shape the
    converter writes for it, checked before `combine` splits, stacks or reorders it (reading only
    the files' headers); a stacked tensor read whole must have the model's shape."""
    written = {name: tuple(t.shape) for name, t in converter.to_hf(key, torch.empty(want, device="meta"))}
    for source in sources:
        expected = written.get(source, want if len(sources) == 1 else None)
        got = tuple(checkpoint.shape(source))
        if expected is not None and got != expected:
            raise ValueError(
                f"checkpoint tensor {source!r} in {checkpoint.file_of(source).name!r} has shape {got}, but the model "
                f"expects {expected} (for {key!r} of shape {want})"
            )


def read_local(
    converter: StateDictConverter, checkpoint: HFCheckpoint, key: str, sources: list[str], target: torch.Tensor
) -> torch.Tensor:
    """The part of archon tensor `key` that `target` holds on this rank, reading no more of the
    checkpoint than needed when the adapter maps the key one to one or stacks per-expert tensors."""
    region = local_region(target)
    want = tuple(target.shape)
    # probed in the stored tensor's rank: a combine that only reshapes ([1, 1, H, 1] -> [H]) is no identity
    if (
        region is not None
        and len(sources) == 1
        and _combine_is_identity(converter, key, len(checkpoint.shape(sources[0])))
    ):
        got = tuple(checkpoint.shape(sources[0]))
        if got != want:
            raise _shape_error(key, sources, got, want)
        return checkpoint.get_slice(sources[0], region)
    if (
        region is not None
        and len(sources) > 1
        and len(want) >= 2
        and _combine_is_stack_of_cat(converter, key, len(sources), want[0])
    ):
        return _read_stacked_region(checkpoint, key, sources, want, region)
    tensor = converter.combine(key, [checkpoint.get(s) for s in sources])
    if tuple(tensor.shape) != want:
        raise _shape_error(key, sources, tensor.shape, want)
    return tensor if region is None else tensor[region]


def _read_stacked_region(checkpoint, key, sources, want, region) -> torch.Tensor:
    n_stacked = want[0]
    per_group = len(sources) // n_stacked
    groups = [sources[i * per_group : (i + 1) * per_group] for i in range(n_stacked)]
    part_shapes = [[tuple(checkpoint.shape(s)) for s in group] for group in groups]
    for group, shapes in zip(groups, part_shapes):
        got = (n_stacked, sum(s[0] for s in shapes), *shapes[0][1:])
        if got != want or any(s[1:] != shapes[0][1:] for s in shapes):
            raise _shape_error(key, group, got, want)
    rows, rest = region[1], region[2:]
    stacked = []
    for index in range(region[0].start, region[0].stop):
        pieces, offset = [], 0
        for source, shape in zip(groups[index], part_shapes[index]):
            lo, hi = max(rows.start, offset), min(rows.stop, offset + shape[0])
            if lo < hi:
                pieces.append(checkpoint.get_slice(source, (slice(lo - offset, hi - offset), *rest)))
            offset += shape[0]
        stacked.append(torch.cat(pieces, dim=0))
    if not stacked:
        dtype = checkpoint.dtype(sources[0])
        return torch.empty([s.stop - s.start for s in region], dtype=dtype)
    return torch.stack(stacked)


def copy_local_into(target: torch.Tensor, local: torch.Tensor, key: str) -> None:
    from torch.distributed.tensor import DTensor

    dest = target.to_local() if isinstance(target, DTensor) else target
    if tuple(local.shape) != tuple(dest.shape):
        raise ValueError(f"{key!r}: this rank holds a shard of shape {tuple(dest.shape)} but read {tuple(local.shape)}")
    dest.copy_(local.to(dest.device, dest.dtype))


def save_hf_checkpoint(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    out_dir: str | os.PathLike,
    config: dict,
    max_shard_bytes: int = 2 * 1024**3,
    extra_files: dict[str, str | bytes] | None = None,
) -> Path:
    """Write HF-named tensors as (sharded) safetensors plus config.json, atomically as a directory."""
    out_dir = Path(out_dir)
    with atomic_directory(out_dir) as tmp:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in named_tensors:
            nbytes = tensor.numel() * tensor.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.detach().cpu().contiguous()
            size += nbytes
        if len(shards) == 1:
            atomic_save_safetensors(shards[0], tmp / SAFETENSORS_SINGLE, metadata={"format": "pt"})
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                atomic_save_safetensors(shard, tmp / fname, metadata={"format": "pt"})
                weight_map.update({k: fname for k in shard})
                total += sum(t.numel() * t.element_size() for t in shard.values())
            atomic_write_json(tmp / SAFETENSORS_INDEX, {"metadata": {"total_size": total}, "weight_map": weight_map})
        atomic_write_json(tmp / "config.json", config)
        for fname, content in (extra_files or {}).items():
            (tmp / fname).write_bytes(content if isinstance(content, bytes) else content.encode())
    return out_dir
