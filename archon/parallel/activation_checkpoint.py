"""Activation checkpointing of transformer blocks, keeping every parameter's name unchanged.

none: keep all activations. full: keep only each block's inputs and recompute the block in the
backward pass. selective: recompute the block but keep the outputs of the expensive ops (matmuls,
attention, collectives, top-k routing), so only cheap element-wise work is redone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from archon.load_balance import routers
from archon.lora.utils import multi_task_layers, routing_set

ACMode = Literal["none", "full", "selective"]
AC_MODES = ("none", "full", "selective")


def _ops(*names: str) -> set:
    """Resolve `namespace.op.overload` names, skipping ops this build does not have."""
    found = set()
    for name in names:
        obj = torch.ops
        try:
            for part in name.split("."):
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            continue
        found.add(obj)
    return found


@functools.cache
def selective_save_ops() -> frozenset:
    return frozenset(
        _ops(
            "aten.mm.default",
            "aten.addmm.default",
            "aten.bmm.default",
            "aten.baddbmm.default",
            "aten._grouped_mm.default",
            "aten._scaled_dot_product_flash_attention.default",
            "aten._scaled_dot_product_flash_attention_for_cpu.default",
            "aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_cudnn_attention.default",
            "aten._flash_attention_forward.default",
            "aten.topk.default",
            "_c10d_functional.all_reduce.default",
            "_c10d_functional.all_gather_into_tensor.default",
            "_c10d_functional.reduce_scatter_tensor.default",
            "_c10d_functional.all_to_all_single.default",
        )
    )


def _selective_policy(ctx, op, *args, **kwargs):
    if op in selective_save_ops():
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def checkpoint_module(module: nn.Module, mode: ACMode) -> nn.Module:
    """Make `module`'s forward recompute in backward; its parameters keep their names."""
    if mode not in AC_MODES:
        raise ValueError(f"activation_checkpoint={mode!r}; expected one of {', '.join(AC_MODES)}")
    if mode == "none":
        return module
    forward = module.forward
    extra = {"context_fn": _selective_context} if mode == "selective" else {}
    routed_layers = multi_task_layers(module)
    moe_routers = routers(module)

    @functools.wraps(forward)
    def checkpointed_forward(*args, **kwargs):
        # The recomputation runs in the backward pass, after `adapter_routing` and `replayed_routing`
        # have exited: it takes the adapter routing and the replayed expert ids of this forward again.
        routing = {layer: layer.routing for layer in routed_layers}
        replayed = {router: router.replayed_experts for router in moe_routers}

        def run(*args, **kwargs):
            previous = {router: router.replayed_experts for router in replayed}
            for router, experts in replayed.items():
                router.replayed_experts = experts
            try:
                with routing_set(routing):
                    return forward(*args, **kwargs)
            finally:
                for router, experts in previous.items():
                    router.replayed_experts = experts

        uses_state = routed_layers or any(experts is not None for experts in replayed.values())
        return checkpoint(
            run if uses_state else forward, *args, use_reentrant=False, preserve_rng_state=True, **extra, **kwargs
        )

    module.forward = checkpointed_forward
    return module


def apply_activation_checkpointing(blocks: Iterable[nn.Module], mode: ACMode) -> None:
    for block in blocks:
        checkpoint_module(block, mode)
