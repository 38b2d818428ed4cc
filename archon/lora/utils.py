"""Whole-model LoRA utilities: per-module settings, trainability, adapter parameters, on/off, merge/unmerge."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from archon.checkpoint.state_dict_converter import is_lora_param
from archon.lora.config import LoRAConfig
from archon.lora.layers import ExpertLoRA, LoRALinear, LoRAModule
from archon.lora.multi_task import AdapterRouting, FactorCache, MultiExpertLoRA, MultiLoRALinear
from archon.packed_linear import Linear


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
                plain = Linear(
                    module.in_features,
                    module.out_features,
                    bias=module.bias is not None,
                    device=module.weight.device,
                    dtype=module.weight.dtype,
                )
                setattr(model.get_submodule(parent_name), child, plain)
                continue
            matched.update(lora.pattern_keys_matching(hf_path))
            if settings != (module.rank, module.scaling):
                module.set_rank(*settings)
    unmatched = sorted((set(lora.rank_pattern) | set(lora.alpha_pattern)) - matched)
    if unmatched:
        warnings.warn(f"LoRA rank_pattern/alpha_pattern key(s) {unmatched} match no adapted module", RuntimeWarning)


def lora_rank_problem(model: nn.Module, lora: LoRAConfig, hf_module_name: Callable[[str], str]) -> str | None:
    """Why `lora` cannot adapt the freshly built (meta) model, or None: a rank above min(in, out) of
    every module it adapts only adds parameters (an update B @ A has rank at most min(in, out)).
    `hf_module_name` maps an archon module FQN to its HF path."""
    sides: list[tuple[str, int, int]] = []  # (HF path, rank, min(in, out)) of each adapted module
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if isinstance(child, LoRALinear):
                hf_path = hf_module_name(f"{name}.{child_name}" if name else child_name)
                settings = lora.module_settings(hf_path)
                if settings is not None:
                    sides.append((hf_path, settings[0], min(child.in_features, child.out_features)))
            elif isinstance(child, ExpertLoRA):
                hf_path = hf_module_name(name)  # the stacked expert weights' module, as in configure_task_adapters
                if lora.module_settings(hf_path) is not None:
                    in_features, out_features = child.lora_a.shape[-1], child.lora_b.shape[1]
                    sides.append((hf_path, lora.rank, min(in_features, out_features)))
    if not sides or any(rank <= side for _, rank, side in sides):
        return None
    path, _, side = max(sides, key=lambda s: s[2])
    return (
        f"lora.rank={lora.rank}: larger than min(in, out) of every module it adapts (the largest is {side}, for "
        f"{path!r}); an update B @ A has rank at most min(in, out), so a larger rank only adds parameters"
    )


# ---- several tasks (multi-LoRA) ------------------------------------------------------------------


def union_lora_config(task_loras: dict[str, LoRAConfig]) -> LoRAConfig:
    """The config a multi-task model is built with before `configure_task_adapters`: LoRA on every
    linear (and on the experts when any task adapts them), so that every module a task targets exists."""
    experts = any(lora.targets("experts") for lora in task_loras.values())
    return LoRAConfig(rank=1, alpha=1.0, target_modules="all-linear", experts=experts)


def configure_task_adapters(
    model: nn.Module, task_loras: dict[str, LoRAConfig], hf_module_name: Callable[[str], str]
) -> None:
    """Turn the freshly built (meta) model, made with `union_lora_config`, into a multi-task model:
    each LoRA module becomes a MultiLoRALinear holding the adapter of every task that targets its HF
    path (with that task's rank and scaling), or a plain linear when no task does; stacked experts get
    a MultiExpertLoRA (or none). `task_loras` is ordered: a task's index there is its id in routing."""
    matched: dict[str, set[str]] = {task: set() for task in task_loras}
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            path = f"{name}.{child_name}" if name else child_name
            if isinstance(child, LoRALinear):
                hf_path = hf_module_name(path)
                settings = {}
                for task, lora in task_loras.items():
                    found = lora.module_settings(hf_path)
                    settings[task] = None if found is None else (*found, lora.dropout)
                    if found is not None:
                        matched[task].update(lora.pattern_keys_matching(hf_path))
                if any(value is not None for value in settings.values()):
                    replacement = MultiLoRALinear(
                        child.in_features,
                        child.out_features,
                        child.bias is not None,
                        settings,
                        device=child.weight.device,
                        dtype=child.weight.dtype,
                    )
                else:
                    replacement = Linear(
                        child.in_features,
                        child.out_features,
                        bias=child.bias is not None,
                        device=child.weight.device,
                        dtype=child.weight.dtype,
                    )
                setattr(module, child_name, replacement)
            elif isinstance(child, ExpertLoRA):
                # the stacked expert weights' module is the HF path the task's targets are matched on
                hf_path = hf_module_name(name)
                configs = {
                    task: lora if lora.module_settings(hf_path) is not None else None
                    for task, lora in task_loras.items()
                }
                num_experts, _, in_features = child.lora_a.shape
                out_features = child.lora_b.shape[1]
                replacement = None
                if any(value is not None for value in configs.values()):
                    replacement = MultiExpertLoRA(num_experts, in_features, out_features, configs)
                setattr(module, child_name, replacement)
    for task, lora in task_loras.items():
        unmatched = sorted((set(lora.rank_pattern) | set(lora.alpha_pattern)) - matched[task])
        if unmatched:
            warnings.warn(
                f"task {task!r}: LoRA rank_pattern/alpha_pattern key(s) {unmatched} match no adapted module",
                RuntimeWarning,
            )


def task_names(model: nn.Module) -> tuple[str, ...]:
    """The tasks of a multi-task model, in routing order (() for a single-adapter model)."""
    for module in model.modules():
        if isinstance(module, (MultiLoRALinear, MultiExpertLoRA)):
            return module.task_names
    return ()


def multi_task_layers(model: nn.Module) -> list[MultiLoRALinear | MultiExpertLoRA]:
    """The layers of `model` that hold several task adapters."""
    return [m for m in model.modules() if isinstance(m, (MultiLoRALinear, MultiExpertLoRA))]


@contextlib.contextmanager
def routing_set(routing: dict[nn.Module, AdapterRouting | None]):
    """Give each multi-task layer its routing for the duration, then the one it had."""
    previous = {layer: layer.routing for layer in routing}
    for layer, value in routing.items():
        layer.routing = value
    try:
        yield
    finally:
        for layer, value in previous.items():
            layer.routing = value


@contextlib.contextmanager
def adapter_routing(model: nn.Module, task_of_token: torch.Tensor):
    """Run a multi-task model's forward with token t using the adapter of task task_of_token[t] (an
    index into the model's tasks); task_of_token: [T] for the packed tokens of the forward.
    Activation-checkpointed blocks take this routing again when they recompute in the backward."""
    modules = multi_task_layers(model)
    if not modules:
        raise ValueError("adapter_routing needs a multi-task model (built with several task adapters)")
    routing = AdapterRouting.from_task_ids(task_of_token, len(modules[0].task_names))
    with routing_set({module: routing for module in modules}):
        yield model


@contextlib.contextmanager
def cached_task_factors(model: nn.Module):
    """Let a multi-task model's layers keep their stacked task factors between forwards that take no
    gradient of them (decoding: every step would stack every layer's factors again), for the
    duration. A layer stacks again when a factor changed in place (its version moved) or was
    replaced. Under FSDP2 the forward sees gathered copies of the factors, which FSDP2 refills
    without moving their versions: enter this only where the adapter does not change (one
    `generate`), as the cache is dropped on exit."""
    modules = multi_task_layers(model)
    for module in modules:
        module.factor_cache = FactorCache()
    try:
        yield model
    finally:
        for module in modules:
            module.factor_cache = None


@contextlib.contextmanager
def task_view(model: nn.Module, task: str):
    """Make a multi-task model, for the duration, the single-adapter model of `task`: every
    MultiLoRALinear is swapped for a LoRALinear (or plain linear) sharing its weights and the task's
    factors, every MultiExpertLoRA for the task's ExpertLoRA. Parameter names are then the plain
    recipe's, so export, sync, merge and checkpoints work on it unchanged."""
    if task not in task_names(model):
        raise ValueError(f"task {task!r} is not one of the model's tasks {list(task_names(model))}")
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MultiLoRALinear):
                setattr(module, child_name, child.single_task_module(task))
            elif isinstance(child, MultiExpertLoRA):
                setattr(module, child_name, child.tasks[task] if task in child.tasks else None)
            else:
                continue
            swapped.append((module, child_name, child))
    try:
        yield model
    finally:
        for module, child_name, child in swapped:
            setattr(module, child_name, child)


def task_parameters(model: nn.Module, task: str) -> dict[str, nn.Parameter]:
    """The adapter parameters of `task` in a multi-task model, by their single-adapter FQN."""
    with task_view(model, task):
        return lora_parameters(model)
