"""Model building: meta device -> LoRA built in -> (parallelize) -> materialize -> load HF weights."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from archon.checkpoint.hf import HFCheckpoint, load_hf_weights
from archon.checkpoint.state_dict_adapter import StateDictAdapter
from archon.lora import LoRAConfig, is_lora_param, mark_only_lora_trainable, reset_lora_parameters
from archon.spec import ModelSpec, get_spec


@dataclass
class LoadedModel:
    model: nn.Module
    spec: ModelSpec
    args: Any
    adapter: StateDictAdapter
    hf_config: Any
    path: Path
    lora: LoRAConfig | None


def load_hf_config(path: str | os.PathLike):
    from transformers import AutoConfig

    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no config.json in {str(path)!r}; expected an HF model directory")
    return AutoConfig.from_pretrained(path)


def build_model(
    path: str | os.PathLike,
    lora: LoRAConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallelize: Callable[[nn.Module], nn.Module] | None = None,
) -> LoadedModel:
    """Build the archon model for the HF checkpoint at `path` and load its weights.

    The model is created on the meta device with LoRA in place, optionally parallelized, then
    materialized on `device`; base weights come from the checkpoint, LoRA A/B are initialised
    afterwards (A kaiming-uniform, B zeros) and kept in fp32. With LoRA, only adapter parameters
    are trainable.
    """
    path = Path(path)
    hf_config = load_hf_config(path)
    spec = get_spec(hf_config.model_type)
    args = spec.args_cls.from_hf_config(hf_config)
    if lora is not None:
        lora.validate(spec.lora_targets, spec.name)
    checkpoint = HFCheckpoint(path)

    with torch.device("meta"):
        model = spec.model_cls(args, lora)
    model.to(dtype)
    for name, param in model.named_parameters():
        if is_lora_param(name):
            param.data = param.data.float()
    if parallelize is not None:
        model = parallelize(model)
    model.to_empty(device=device)
    adapter = spec.state_dict_adapter_cls(args)
    load_hf_weights(model, adapter, checkpoint)
    if lora is not None:
        reset_lora_parameters(model)
        mark_only_lora_trainable(model)
    return LoadedModel(model, spec, args, adapter, hf_config, path, lora)
