"""Hugging Face checkpoints: read (single or sharded safetensors) into an archon model, write back."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from archon.checkpoint.atomic import atomic_directory, atomic_save_safetensors, atomic_write_json
from archon.checkpoint.state_dict_adapter import StateDictAdapter
from archon.lora.utils import is_lora_param

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"


class HFCheckpoint:
    """Lazy access to the tensors of an HF checkpoint directory."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {str(self.path)!r} does not exist")
        index = self.path / SAFETENSORS_INDEX
        single = self.path / SAFETENSORS_SINGLE
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self._file_of = {k: self.path / f for k, f in weight_map.items()}
        elif single.exists():
            with safe_open(single, "pt") as f:
                self._file_of = {k: single for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX} in {str(self.path)!r}; "
                "archon reads safetensors checkpoints only"
            )
        for file in set(self._file_of.values()):
            if not file.exists():
                raise FileNotFoundError(f"checkpoint shard {str(file)!r} named in the index does not exist")
        self._handles: dict[Path, object] = {}

    def keys(self) -> set[str]:
        return set(self._file_of)

    def _handle(self, key: str):
        file = self._file_of[key]
        if file not in self._handles:
            self._handles[file] = safe_open(file, "pt")
        return self._handles[file]

    def get(self, key: str) -> torch.Tensor:
        return self._handle(key).get_tensor(key)

    def shape(self, key: str) -> list[int]:
        return self._handle(key).get_slice(key).get_shape()

    def config(self) -> dict:
        return json.loads((self.path / "config.json").read_text())


def expected_base_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base (non-LoRA) parameters and persistent buffers a checkpoint must provide."""
    state = model.state_dict()
    return {k: v for k, v in state.items() if not is_lora_param(k)}


@torch.no_grad()
def load_hf_weights(model: nn.Module, adapter: StateDictAdapter, checkpoint: HFCheckpoint) -> None:
    """Copy every base weight from `checkpoint` into `model`; fail naming any missing, unexpected or
    mis-shaped key before anything is copied."""
    hf_keys = checkpoint.keys()
    expected = expected_base_params(model)
    plan: dict[str, list[str]] = {}
    missing: list[str] = []
    for key in expected:
        sources = adapter.hf_sources(key, hf_keys)
        absent = [s for s in sources if s not in hf_keys]
        if absent:
            missing.append(f"{absent[0]!r} (for {key!r})")
        plan[key] = sources
    used = {s for sources in plan.values() for s in sources}
    unexpected = sorted(k for k in hf_keys - used if not adapter.is_ignored(k))
    errors = []
    if missing:
        errors.append(f"missing {len(missing)} key(s): " + ", ".join(missing[:5]))
    if unexpected:
        errors.append(f"unexpected {len(unexpected)} key(s): " + ", ".join(repr(k) for k in unexpected[:5]))
    if errors:
        raise KeyError(f"checkpoint {str(checkpoint.path)!r} does not match the model: " + "; ".join(errors))

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for key, sources in plan.items():
        tensor = adapter.combine(key, [checkpoint.get(s) for s in sources])
        target = params[key]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"checkpoint tensor {sources[0]!r} gives {key!r} shape {tuple(tensor.shape)}, "
                f"but the model expects {tuple(target.shape)}"
            )
        _copy_into(target, tensor)


def _copy_into(target: torch.Tensor, tensor: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        local = distribute_tensor(tensor.to(target.device, target.dtype), target.device_mesh, target.placements)
        target.to_local().copy_(local.to_local())
    else:
        target.copy_(tensor.to(target.dtype))


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
