"""ModelSpec: what the engine needs to know about a model family, and the registry of families.

A family registers itself from its own `models/<family>/spec.py`; the engine never names one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

_REGISTRY: dict[str, "ModelSpec"] = {}
_FAMILIES_PACKAGE = "archon.models"


@dataclass(frozen=True)
class ModelSpec:
    """A model family.

    name: family name, e.g. "qwen3".
    hf_model_types: the HF `config.model_type` values this family serves.
    args_cls: dataclass with `from_hf_config(hf_config) -> args`.
    model_cls: `model_cls(args, lora_config | None)`; forward takes packed input.
    state_dict_converter_cls: `state_dict_converter_cls(args)`, maps HF <-> archon keys.
    parallelize_fn: `parallelize_fn(model, parallel_dims, config)`; applies TP/AC/compile/FSDP.
    lora_targets: HF leaf names of the modules LoRA may target, e.g. ("q_proj", ..., "experts").
    tiny_hf_config: kwargs for the transformers config class that make a tiny model of this
        family for alignment checks, per HF model_type.
    """

    name: str
    hf_model_types: tuple[str, ...]
    args_cls: type
    model_cls: type
    state_dict_converter_cls: type
    parallelize_fn: Callable[..., Any] | None
    lora_targets: tuple[str, ...]
    tiny_hf_config: dict[str, dict[str, Any]] = field(default_factory=dict)


def register(spec: ModelSpec) -> ModelSpec:
    for model_type in spec.hf_model_types:
        existing = _REGISTRY.get(model_type)
        if existing is not None and existing.name != spec.name:
            raise ValueError(
                f"HF model_type {model_type!r} is already served by family {existing.name!r}; "
                f"cannot register {spec.name!r} for it"
            )
        _REGISTRY[model_type] = spec
    return spec


def _load_families() -> None:
    importlib.import_module(_FAMILIES_PACKAGE)


def supported_model_types() -> list[str]:
    _load_families()
    return sorted(_REGISTRY)


def get_spec(model_type: str) -> ModelSpec:
    _load_families()
    try:
        return _REGISTRY[model_type]
    except KeyError:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_REGISTRY))}"
        ) from None
