"""PEFT-format adapter export/import and merged-model export.

The adapter directory holds `adapter_model.safetensors` and `adapter_config.json` and loads with
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from archon.checkpoint.atomic import atomic_directory, atomic_save_safetensors, atomic_write_json
from archon.checkpoint.hf import save_hf_checkpoint
from archon.checkpoint.state_dict_adapter import StateDictAdapter
from archon.lora.config import LoRAConfig
from archon.lora.layers import LoRALinear
from archon.lora.utils import is_lora_param, lora_parameters, merge_lora, unmerge_lora

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor with the whole value, gathering DTensor shards (FSDP/TP) when needed."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def peft_adapter_config(
    model: nn.Module, adapter: StateDictAdapter, lora: LoRAConfig, base_model_name_or_path: str
) -> dict:
    target_modules, target_parameters = adapter.peft_targets(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, LoRALinear)},
        lora_parameters(model).keys(),
    )
    clashing = sorted(set(target_modules) & set(adapter.peft_reserved_module_names))
    if target_parameters and clashing:
        raise ValueError(
            f"cannot export a PEFT adapter with LoRA on both MoE experts and dense module(s) {clashing}: PEFT "
            "would read those names as expert projections. Leave them out of LoRAConfig.target_modules, or set "
            "LoRAConfig.experts=False"
        )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_modules,
        "target_parameters": target_parameters or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": lora.use_rslora,
        "use_dora": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }


def peft_state_dict(model: nn.Module, adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT key names (DTensor shards gathered; every rank must call this)."""
    lora_state = {k: full_tensor(p.detach()).cpu() for k, p in lora_parameters(model).items()}
    return adapter.lora_state_dict_to_peft(lora_state)


def save_peft_adapter(
    model: nn.Module,
    adapter: StateDictAdapter,
    lora: LoRAConfig,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    write: bool = True,
) -> Path:
    """Export the adapter atomically. Under FSDP/TP every rank calls this; only `write=True` ranks write."""
    tensors = peft_state_dict(model, adapter)
    if not tensors:
        raise ValueError("model has no LoRA parameters to export")
    config = peft_adapter_config(model, adapter, lora, base_model_name_or_path)
    out_dir = Path(out_dir)
    if write:
        with atomic_directory(out_dir) as tmp:
            atomic_save_safetensors(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            atomic_write_json(tmp / ADAPTER_CONFIG, config)
    return out_dir


def read_peft_config(adapter_dir: str | os.PathLike) -> dict:
    import json

    path = Path(adapter_dir) / ADAPTER_CONFIG
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(adapter_dir)!r} a PEFT adapter directory?")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{str(path)!r} has peft_type {config.get('peft_type')!r}; only 'LORA' is supported")
    return config


def lora_config_from_peft(adapter_dir: str | os.PathLike) -> LoRAConfig:
    """The LoRAConfig to build a model that can take this adapter."""
    config = read_peft_config(adapter_dir)
    targets = config["target_modules"]
    if isinstance(targets, str):
        raise ValueError(f"adapter_config.json target_modules is a regex ({targets!r}); archon needs a list")
    targets = list(targets)
    for name in config.get("target_parameters") or []:
        # "<module>.weight" is a dense module's weight; anything else is a stacked expert weight
        module, _, param = name.rpartition(".")
        target = module.rsplit(".", 1)[-1] if param == "weight" else "experts"
        if target not in targets:
            targets.append(target)
    targets = tuple(targets)
    return LoRAConfig(
        rank=config["r"],
        alpha=config["lora_alpha"],
        dropout=config.get("lora_dropout", 0.0),
        target_modules=targets,
        use_rslora=config.get("use_rslora", False),
    )


@torch.no_grad()
def load_peft_adapter(model: nn.Module, adapter: StateDictAdapter, adapter_dir: str | os.PathLike) -> None:
    """Load a PEFT adapter into a model built with a matching LoRAConfig; every key must match."""
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.exists():
        raise FileNotFoundError(f"{str(weights)!r} does not exist")
    read_peft_config(adapter_dir)
    peft_state = load_file(str(weights))
    params = lora_parameters(model)
    if not params:
        raise ValueError("model has no LoRA parameters; build it with the adapter's LoRAConfig")
    loaded = adapter.lora_state_dict_from_peft(peft_state, {k: p.shape for k, p in params.items()})
    for key, tensor in loaded.items():
        params[key].copy_(tensor.to(params[key].dtype))


def save_merged_hf(
    model: nn.Module,
    adapter: StateDictAdapter,
    out_dir: str | os.PathLike,
    hf_config: dict,
    source_dir: str | os.PathLike | None = None,
    write: bool = True,
) -> Path:
    """Write base + s*B@A as a plain HF checkpoint (merged in fp32), leaving the model unmerged.

    Without LoRA this writes the model as it is (e.g. after full fine-tuning). Under FSDP/TP every
    rank calls this (shards are gathered); only `write=True` ranks write."""
    merge_lora(model)
    try:
        base = {k: full_tensor(v) for k, v in model.state_dict().items() if not is_lora_param(k)}
        extra = {}
        if source_dir is not None:
            for f in Path(source_dir).iterdir():
                if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")):
                    extra[f.name] = f.read_bytes()
        path = Path(out_dir)
        if write:
            save_hf_checkpoint(adapter.iter_to_hf(base.items()), out_dir, hf_config, extra_files=extra)
    finally:
        unmerge_lora(model)
    return path


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "full_tensor",
    "load_peft_adapter",
    "lora_config_from_peft",
    "peft_adapter_config",
    "peft_state_dict",
    "read_peft_config",
    "save_merged_hf",
    "save_peft_adapter",
]

