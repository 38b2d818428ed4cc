"""Building a model: the model is created on the meta device with LoRA in place, parallelized
by its family's parallelize function (TP -> activation checkpointing -> compile -> FSDP2),
materialised with `to_empty`, filled from the HF checkpoint (each rank reads only the slices it
holds), and its LoRA factors are initialised (A kaiming-uniform, B zeros) from a seeded generator,
so every layout starts from the same adapter.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from archon.checkpoint.hf import (
    HFCheckpoint,
    check_model_dir,
    copy_local_into,
    load_hf_weights,
    local_region,
)
from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora import (
    LoRAConfig,
    configure_lora_modules,
    configure_task_adapters,
    is_lora_param,
    mark_only_lora_trainable,
    task_view,
    union_lora_config,
)
from archon.lora.peft import peft_adapter_config
from archon.parallel import ParallelConfig, ParallelDims
from archon.spec import ModelSpec, get_spec

__all__ = ["LoadedModel", "build_model", "init_lora_weights", "load_hf_config"]


# ---------------------------------------------------------------------------------------------
# Build
# ---------------------------------------------------------------------------------------------


@dataclass
class LoadedModel:
    model: nn.Module
    spec: ModelSpec
    args: Any
    converter: StateDictConverter
    hf_config: Any
    path: Path
    lora: LoRAConfig | None
    dims: ParallelDims | None = None


def load_hf_config(path: str | os.PathLike, option: str | None = None):
    """The HF config of the model directory `path`; `option` names the setting the path came from."""
    from transformers import AutoConfig

    path = Path(path)
    check_model_dir(path, option)
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{str(path / 'config.json')!r} is not a usable HF model config: {e}") from e


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int = 0) -> None:
    """A kaiming-uniform (bound 1/sqrt(fan_in), fan_in = the last dim, as PEFT), B zeros.

    Each full factor is drawn from one seeded generator in parameter order and every rank copies
    the part it holds, so sharded and single-process models start from the same adapter.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if not is_lora_param(name):
            continue
        parts = name.split(".")
        if "lora_b" in parts:
            full = torch.zeros(param.shape)
        else:
            bound = 1.0 / math.sqrt(param.shape[-1])
            full = torch.empty(param.shape).uniform_(-bound, bound, generator=generator)
        region = local_region(param)
        copy_local_into(param, full if region is None else full[region], name)


def build_model(
    path: str | os.PathLike,
    lora: LoRAConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    parallel: ParallelConfig | None = None,
    dims: ParallelDims | None = None,
    seed: int = 0,
    path_option: str | None = None,
    task_loras: dict[str, LoRAConfig] | None = None,
) -> LoadedModel:
    """Build the archon model for the HF checkpoint at `path` and load its weights.

    Base weights take `dtype`; LoRA factors stay fp32. With LoRA only the adapter is trainable,
    without it every parameter is. Parallelism: pass `dims` (and `parallel` for AC/compile/FSDP
    options) to use the family's parallelize function.
    `path_option` names the setting `path` came from, for error messages.
    `task_loras` (instead of `lora`) builds a multi-task model: one adapter per task, in this order,
    on the one frozen base (archon.lora.MultiLoRALinear); each task's adapter starts as the one a
    single-adapter model with its config and `seed` would.
    """
    path = Path(path)
    hf_config = load_hf_config(path, path_option)
    spec = get_spec(hf_config.model_type)
    args = spec.args_cls.from_hf_config(hf_config)
    if task_loras is not None:
        if lora is not None:
            raise ValueError("build_model takes either lora (one adapter) or task_loras (one per task), not both")
        if not task_loras:
            raise ValueError("task_loras must name at least one task")
        for task, task_lora in task_loras.items():
            try:
                task_lora.validate(spec.lora_targets, spec.name)
            except ValueError as e:
                raise ValueError(f"task {task!r}: {e}") from None
        lora = union_lora_config(task_loras)
    elif lora is not None:
        lora.validate(spec.lora_targets, spec.name)
    checkpoint = HFCheckpoint(path)

    converter = spec.state_dict_converter_cls(args)
    with torch.device("meta"):
        model = spec.model_cls(args, lora)
    if task_loras is not None:
        if dims is not None and (dims.distributed or (parallel is not None and parallel.compile)):
            raise ValueError(
                "a multi-task (several adapters) model runs in one process without compile; "
                "set parallel sizes to 1 and parallel.compile=False"
            )
        configure_task_adapters(model, task_loras, converter.hf_name)
        for task, task_lora in task_loras.items():
            with task_view(model, task):
                try:
                    peft_adapter_config(model, converter, task_lora, str(path))
                except ValueError as e:
                    raise ValueError(f"task {task!r}: {e}") from None
    elif lora is not None:
        configure_lora_modules(model, lora, converter.hf_name)
        peft_adapter_config(model, converter, lora, str(path))  # fail now, not at the first export
    model.to(dtype)
    for name, param in model.named_parameters():
        if is_lora_param(name):
            param.data = param.data.float()
    if lora is not None:
        mark_only_lora_trainable(model)

    if dims is not None:
        parallel = parallel or ParallelConfig()
        needs_pipeline = dims.distributed or parallel.activation_checkpoint != "none" or parallel.compile
        if needs_pipeline:
            if spec.parallelize_fn is None:
                raise ValueError(f"model family {spec.name!r} has no parallelize function (ModelSpec.parallelize_fn)")
            model = spec.parallelize_fn(model, dims, parallel)
    model.to_empty(device=device)
    load_hf_weights(model, converter, checkpoint)
    if task_loras is not None:
        for task in task_loras:
            with task_view(model, task):
                init_lora_weights(model, seed)
        return LoadedModel(model, spec, args, converter, hf_config, path, None, dims)
    if lora is not None:
        init_lora_weights(model, seed)
    return LoadedModel(model, spec, args, converter, hf_config, path, lora, dims)


