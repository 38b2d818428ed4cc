"""Whole-model LoRA utilities: per-module settings, trainability, adapter parameters, on/off, merge/unmerge."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from archon.lora.config import LoRAConfig
from archon.lora.layers import LoRALinear, LoRAModule

LORA_PARAM_MARKERS = ("lora_a", "lora_b")


def is_lora_param(name: str) -> bool:
    return any(part in LORA_PARAM_MARKERS for part in name.split("."))


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRAModule]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRAModule):
            yield name, module


def lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """Adapter parameters by archon FQN."""
    return {n: p for n, p in model.named_parameters() if is_lora_param(n)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in lora_parameters(model).items()}


def mark_only_lora_trainable(model: nn.Module) -> int:
    """Freeze every base parameter; return the number of trainable (adapter) elements."""
    trainable = 0
    for name, param in model.named_parameters():
        param.requires_grad_(is_lora_param(name))
        if param.requires_grad:
            trainable += param.numel()
    if trainable == 0:
        raise ValueError("model has no LoRA parameters to train; was it built with a LoRAConfig?")
    return trainable


def reset_lora_parameters(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.reset_lora_parameters()


def set_adapter_enabled(model: nn.Module, enabled: bool) -> None:
    for _, module in lora_modules(model):
        module.lora_enabled = enabled


@contextlib.contextmanager
def adapter_disabled(model: nn.Module):
    """Run the base model (the reference policy) without keeping a second copy."""
    previous = {name: module.lora_enabled for name, module in lora_modules(model)}
    set_adapter_enabled(model, False)
    try:
        yield model
    finally:
        for name, module in lora_modules(model):
            module.lora_enabled = previous[name]


def merge_lora(model: nn.Module) -> None:
    """Fold s*B@A into the base weights (in fp32). `unmerge_lora` restores them bit-exactly."""
    for _, module in lora_modules(model):
        module.merge_lora()


def unmerge_lora(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.unmerge_lora()


def configure_lora_modules(model: nn.Module, lora: LoRAConfig, hf_module_name: Callable[[str], str]) -> None:
    """Give each LoRA module the rank and scaling `lora` assigns to its HF path, and turn the modules
    it does not target back into plain linears. Call on the freshly built (meta) model, before it is
    parallelized or materialised. `hf_module_name` maps an archon module FQN to its HF path.
    MoE experts keep the config's rank and scaling (patterns that would reach them are refused at
    build time, see `archon.lora.peft.peft_adapter_config`)."""
    matched: set[str] = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            hf_path = hf_module_name(name)
            settings = lora.module_settings(hf_path)
            if settings is None:
                parent_name, _, child = name.rpartition(".")
                plain = nn.Linear(
                    module.in_features, module.out_features, bias=module.bias is not None,
                    device=module.weight.device, dtype=module.weight.dtype,
                )  # fmt: skip
                setattr(model.get_submodule(parent_name), child, plain)
                continue
            matched.update(lora.pattern_keys_matching(hf_path))
            if settings != (module.rank, module.scaling):
                module.set_rank(*settings)
    unmatched = sorted((set(lora.rank_pattern) | set(lora.alpha_pattern)) - matched)
    if unmatched:
        warnings.warn(f"LoRA rank_pattern/alpha_pattern key(s) {unmatched} match no adapted module", RuntimeWarning)
