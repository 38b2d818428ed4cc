"""PEFT-format adapter export/import and merged-model export.

The adapter directory holds `adapter_model.safetensors` and `adapter_config.json` and loads with
`peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter_dir)`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from archon.checkpoint.atomic import (
    atomic_directory,
    atomic_file,
    atomic_save_safetensors,
    atomic_write_json,
)
from archon.checkpoint.hf import (
    copy_local_into,
    local_region,
    open_safetensors,
    read_json_file,
    warn_non_finite,
)
from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.dtensor import full_tensor
from archon.lora.config import LoRAConfig
from archon.lora.layers import ExpertLoRA, LoRALinear, LoRAModule, merged_weight
from archon.lora.utils import (
    is_lora_param,
    lora_modules,
    lora_parameters,
)

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_CARD = "README.md"


def merged_named_tensors(model: nn.Module, named_params) -> Iterator[tuple[str, torch.Tensor]]:
    """(archon name, gathered tensor) of each base parameter in `named_params`, with the delta of
    the LoRA module owning it (its `delta_weight()`) added in fp32 where it has one."""
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in named_params:
        if is_lora_param(name):
            continue
        module_path, _, param_name = name.rpartition(".")
        if module_path not in deltas:
            owner = model.get_submodule(module_path)
            deltas[module_path] = owner.delta_weight() if isinstance(owner, LoRAModule) else {}
        tensor = full_tensor(param.detach())
        delta = deltas[module_path].get(param_name)
        yield name, tensor if delta is None else merged_weight(tensor, full_tensor(delta))


def peft_target_module_names(model: nn.Module, converter: StateDictConverter) -> list[str]:
    """PEFT `target_modules` for the LoRALinear modules of `model`: a leaf name when every linear with
    that name carries LoRA, else the HF path of each one that does (PEFT matches both). Linears of
    multi-token-prediction layers (`mtp.*`) without LoRA do not count: HF's causal LM, which PEFT
    loads the adapter into, has no such layers."""
    linears: dict[str, list[tuple[str, bool]]] = {}
    for name, module in model.named_modules():
        if name.startswith("mtp.") and not isinstance(module, LoRALinear):
            continue
        if isinstance(module, nn.Linear):
            linears.setdefault(name.rsplit(".", 1)[-1], []).append((name, isinstance(module, LoRALinear)))
    targets = []
    for leaf, modules in linears.items():
        adapted = [name for name, is_lora in modules if is_lora]
        if len(adapted) == len(modules):
            targets.append(leaf)
        else:
            targets.extend(converter.hf_name(name) for name in adapted)
    return targets


def peft_adapter_config(
    model: nn.Module, converter: StateDictConverter, lora: LoRAConfig, base_model_name_or_path: str
) -> dict:
    """adapter_config.json for the model's LoRA; an error if PEFT could not read it as archon computes it."""
    target_modules, target_parameters = converter.peft_targets(
        peft_target_module_names(model, converter), lora_parameters(model).keys()
    )
    leaves = {name.rsplit(".", 1)[-1] for name in target_modules}
    clashing = sorted(leaves & set(converter.peft_reserved_module_names))
    if target_parameters and clashing:
        raise ValueError(
            f"cannot export a PEFT adapter with LoRA on both MoE experts and dense module(s) {clashing}: PEFT "
            "would read those names as expert projections. Leave them out of LoRAConfig.target_modules, or set "
            "LoRAConfig.experts=False"
        )
    if target_parameters and (lora.rank_pattern or lora.alpha_pattern):
        # PEFT matches patterns against "<module>.<parameter>" for these, vLLM against the module name.
        raise ValueError(
            "LoRAConfig.rank_pattern/alpha_pattern cannot be exported to PEFT for a model whose adapter has "
            f"target_parameters ({', '.join(target_parameters)}: MoE experts, or dense MLPs in an MoE model); "
            "leave the patterns out for this model"
        )
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "rank_pattern": dict(lora.rank_pattern),
        "alpha_pattern": dict(lora.alpha_pattern),
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


def peft_state_dict(model: nn.Module, converter: StateDictConverter) -> dict[str, torch.Tensor]:
    """Adapter tensors under PEFT key names (DTensor shards gathered; every rank must call this)."""
    lora_state = {k: full_tensor(p.detach()).cpu() for k, p in lora_parameters(model).items()}
    return converter.lora_state_dict_to_peft(lora_state)


def save_peft_adapter(
    model: nn.Module,
    converter: StateDictConverter,
    lora: LoRAConfig,
    out_dir: str | os.PathLike,
    base_model_name_or_path: str,
    write: bool = True,
    model_card: str | None = None,
) -> Path:
    """Export the adapter atomically. Under FSDP/TP every rank calls this; only `write=True` ranks write.
    `model_card`: the text of the directory's README.md (PEFT's model card), written with the adapter."""
    tensors = peft_state_dict(model, converter)
    if not tensors:
        raise ValueError("model has no LoRA parameters to export")
    config = peft_adapter_config(model, converter, lora, base_model_name_or_path)
    out_dir = Path(out_dir)
    if write:
        with atomic_directory(out_dir) as tmp:
            atomic_save_safetensors(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
            atomic_write_json(tmp / ADAPTER_CONFIG, config)
            if model_card is not None:
                with atomic_file(tmp / ADAPTER_CARD, "w") as f:
                    f.write(model_card)
    return out_dir


# adapter_config.json fields that archon reads.
_PEFT_FIELDS_USED = frozenset(
    {
        "peft_type",
        "r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "target_parameters",
        "rank_pattern",
        "alpha_pattern",
        "use_rslora",
        "bias",
        "fan_in_fan_out",
    }
)
# Fields that describe how an adapter was made or is to be served, not what it computes.
_PEFT_FIELDS_IGNORED = frozenset(
    {
        "base_model_name_or_path",
        "revision",
        "peft_version",
        "auto_mapping",
        "task_type",
        "inference_mode",
        "init_lora_weights",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "megatron_config",
        "megatron_core",
        "qalora_group_size",
        "ensure_weight_tying",
    }
)


def read_peft_config(adapter_dir: str | os.PathLike) -> dict:
    """adapter_config.json of a PEFT LoRA adapter that archon computes exactly as PEFT does.

    Any other field that is set (DoRA, biases, modules_to_save, layer selection, ...) is an error that
    names it: archon would otherwise compute something else than PEFT."""
    adapter_dir = Path(adapter_dir)
    path = adapter_dir / ADAPTER_CONFIG
    if not adapter_dir.is_dir():
        raise FileNotFoundError(f"PEFT adapter directory {str(adapter_dir)!r} does not exist")
    if not path.exists():
        raise FileNotFoundError(f"{str(path)!r} does not exist; is {str(adapter_dir)!r} a PEFT adapter directory?")
    config = read_json_file(path, "adapter config")
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{str(path)!r} has peft_type {config.get('peft_type')!r}; only 'LORA' is supported")
    unsupported = {k: v for k, v in config.items() if k not in _PEFT_FIELDS_USED | _PEFT_FIELDS_IGNORED and v}
    if config.get("bias", "none") != "none":
        unsupported["bias"] = config["bias"]
    if config.get("fan_in_fan_out"):
        unsupported["fan_in_fan_out"] = config["fan_in_fan_out"]
    if unsupported:
        fields = ", ".join(f"{k}={v!r}" for k, v in sorted(unsupported.items()))
        hint = ""
        if "use_dora" in unsupported:
            hint = " (DoRA adapters cannot be imported; merge them into the base model first)"
        raise ValueError(f"{str(path)!r} sets field(s) archon does not support: {fields}{hint}")
    return config


def _field(config: dict, path: Path, name: str, types: tuple[type, ...], default=None, required: bool = False):
    if name not in config or config[name] is None:
        if required:
            raise KeyError(f"{str(path)!r} lacks the field {name!r}")
        return default
    value = config[name]
    if not isinstance(value, types) or isinstance(value, bool) and bool not in types:
        raise ValueError(f"{str(path)!r} field {name!r} has the wrong type: {value!r}")
    return value


def lora_config_from_peft(adapter_dir: str | os.PathLike) -> LoRAConfig:
    """The LoRAConfig to build a model that can take this adapter."""
    config = read_peft_config(adapter_dir)
    path = Path(adapter_dir) / ADAPTER_CONFIG
    targets = _field(config, path, "target_modules", (list, str), default=[])
    if isinstance(targets, str) and targets.lower() == "all-linear":
        # PEFT resolves this against the model it loads into: every nn.Linear but the output head.
        # archon's "all-linear" without experts is the same set for the linears it can adapt; the key
        # check in load_peft_adapter fails, naming the key, if the adapter covers a module it cannot.
        targets = "all-linear"
    elif isinstance(targets, str):
        raise ValueError(
            f"{str(path)!r} field 'target_modules' is a regular expression ({targets!r}); archon needs a list of "
            "module names"
        )
    target_parameters = _field(config, path, "target_parameters", (list,), default=[])
    if not targets and not target_parameters:
        raise KeyError(f"{str(path)!r} lacks the field 'target_modules' (or 'target_parameters')")
    rank_pattern = _field(config, path, "rank_pattern", (dict,), default={})
    alpha_pattern = _field(config, path, "alpha_pattern", (dict,), default={})
    if target_parameters and (rank_pattern or alpha_pattern):
        raise ValueError(
            f"{str(path)!r} sets rank_pattern/alpha_pattern together with target_parameters; archon supports "
            "per-module rank and alpha on target_modules only"
        )
    if targets == "all-linear":
        if target_parameters:
            raise ValueError(
                f"{str(path)!r} sets target_parameters with target_modules 'all-linear'; archon needs a list"
            )
        experts = False
    else:
        targets, experts = list(targets), True
    for name in target_parameters:
        # "<module>.weight" is a dense module's weight; anything else is a stacked expert weight
        module, _, param = name.rpartition(".")
        target = module.rsplit(".", 1)[-1] if param == "weight" else "experts"
        if target not in targets:
            targets.append(target)
    try:
        return LoRAConfig(
            rank=_field(config, path, "r", (int,), required=True),
            alpha=_field(config, path, "lora_alpha", (int, float), required=True),
            dropout=_field(config, path, "lora_dropout", (int, float), default=0.0),
            target_modules=targets if targets == "all-linear" else tuple(targets),
            experts=experts,
            use_rslora=_field(config, path, "use_rslora", (bool,), default=False),
            rank_pattern=dict(rank_pattern),
            alpha_pattern=dict(alpha_pattern),
        )
    except ValueError as e:
        raise ValueError(f"{str(path)!r}: {e}") from None


def read_adapter_weights(adapter_dir: str | os.PathLike) -> dict[str, torch.Tensor]:
    """adapter_model.safetensors, warning about (and naming) any tensor with NaN/inf values."""
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not weights.exists():
        legacy = Path(adapter_dir) / "adapter_model.bin"
        hint = f"; {str(legacy)!r} exists, but archon reads safetensors adapters only" if legacy.exists() else ""
        raise FileNotFoundError(f"{str(weights)!r} does not exist{hint}")
    with open_safetensors(weights) as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    for key, tensor in tensors.items():
        warn_non_finite(key, tensor, weights)
    return tensors


def _check_lora_settings(
    model: nn.Module, converter: StateDictConverter, expected: LoRAConfig, config_path: Path
) -> None:
    """Fail, naming the module, where the model's LoRA rank or scaling is not the adapter's."""
    for name, module in lora_modules(model):
        hf_path = converter.hf_name(name)
        if isinstance(module, LoRALinear):
            settings = expected.module_settings(hf_path)
            if settings is None:
                continue  # the key check reports modules the adapter does not cover
            have = (module.rank, module.scaling)
        else:  # stacked experts: one setting for all of them
            settings = (expected.rank, expected.scaling)
            have = next(((m.rank, m.scaling) for m in module.modules() if isinstance(m, ExpertLoRA)), settings)
        if have[0] != settings[0] or not math.isclose(have[1], settings[1], rel_tol=1e-12):
            raise ValueError(
                f"{str(config_path)!r} gives {hf_path!r} rank {settings[0]} and scaling {settings[1]:g}, but the "
                f"model has rank {have[0]} and scaling {have[1]:g}; build the model with "
                "lora_config_from_peft(adapter_dir)"
            )


@torch.no_grad()
def load_peft_adapter(model: nn.Module, converter: StateDictConverter, adapter_dir: str | os.PathLike) -> None:
    """Load a PEFT adapter into a model built with a matching LoRAConfig; every key, shape, rank and
    scaling must match. In a parallelised model (FSDP2, TP, EP) every rank calls this and copies
    its own shard of each factor."""
    expected = lora_config_from_peft(adapter_dir)
    weights = Path(adapter_dir) / ADAPTER_WEIGHTS
    peft_state = read_adapter_weights(adapter_dir)
    params = lora_parameters(model)
    if not params:
        raise ValueError("model has no LoRA parameters; build it with lora_config_from_peft(adapter_dir)")
    _check_lora_settings(model, converter, expected, Path(adapter_dir) / ADAPTER_CONFIG)
    try:
        loaded = converter.lora_state_dict_from_peft(peft_state, {k: p.shape for k, p in params.items()})
    except (KeyError, ValueError) as e:
        raise type(e)(f"{str(weights)!r}: {e.args[0]}") from None
    for key, tensor in loaded.items():
        region = local_region(params[key])
        copy_local_into(params[key], tensor if region is None else tensor[region], key)


__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "full_tensor",
    "load_peft_adapter",
    "lora_config_from_peft",
    "peft_adapter_config",
    "peft_state_dict",
    "peft_target_module_names",
    "read_adapter_weights",
    "read_peft_config",
    "save_peft_adapter",
]
