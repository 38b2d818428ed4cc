"""Routing record and replay for MoE models: keep the expert ids each router chose in a forward
(the rollout engine records them), and make a later forward route every token to given ids (the
trainer replays them), so that training sees the experts that sampled each token. Beside the
routers' load-balancing statistics (archon.load_balance), whose `Router` holds both."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from archon.load_balance import Router, routers


def moe_routers(model: nn.Module) -> list[Router]:
    """The model's MoE routers in layer order (the L_moe axis of recorded and replayed expert ids)."""
    return routers(model)


@contextlib.contextmanager
def replayed_routing(model: nn.Module, experts: torch.Tensor | None):
    """Run the model's forwards with MoE layer l routing token t to experts[t, l] ([T, L_moe, k] ids
    for the packed tokens of the forward; a token whose ids are -1 routes on its own) instead of
    each router's own top-k. None: nothing replayed. Activation-checkpointed blocks take these ids
    again when they recompute in the backward (archon.parallel.activation_checkpoint)."""
    if experts is None:
        yield model
        return
    layers = moe_routers(model)
    if experts.dim() != 3 or experts.shape[1] != len(layers):
        raise ValueError(
            f"replayed expert ids have shape {tuple(experts.shape)}; the model has {len(layers)} MoE layers, "
            "so they must be [tokens, num_moe_layers, num_experts_per_tok]"
        )
    previous = [router.replayed_experts for router in layers]
    for layer, router in enumerate(layers):
        router.replayed_experts = experts[:, layer]
    try:
        yield model
    finally:
        for router, value in zip(layers, previous):
            router.replayed_experts = value


@contextlib.contextmanager
def recorded_routing(model: nn.Module):
    """Keep, for the duration, the expert ids every MoE router uses in each forward; yields the
    routers, whose `chosen_experts` lists gain one [T, k] tensor per forward (`take_recorded`)."""
    layers = moe_routers(model)
    for router in layers:
        router.chosen_experts = []
    try:
        yield layers
    finally:
        for router in layers:
            router.chosen_experts = None


def take_recorded(layers: list[Router]) -> torch.Tensor:
    """The last forward's expert ids of `layers` (under `recorded_routing`), [T, L_moe, k], and
    forget them."""
    chosen = torch.stack([router.chosen_experts[-1] for router in layers], dim=1)
    for router in layers:
        router.chosen_experts.clear()
    return chosen
