"""LoRA layers that are part of the model from construction on (meta device included).

Numerics follow PEFT: y = W x + b + s * B(A(dropout(x))), s = alpha/r (or alpha/sqrt(r) with rsLoRA),
A kaiming-uniform(a=sqrt(5)), B zeros. Base parameters keep their names (`q_proj.weight`), so plain
HF checkpoints load unchanged; adapter parameters are `lora_a` / `lora_b`.

A layer is built with the config's default rank and scaling; `configure_lora_modules`
(archon.lora.utils) then gives each module the rank and scaling that the config's patterns assign to
its HF path, while the model is still on the meta device.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from archon.lora.config import LoRAConfig


class LoRAModule:
    """Mixin for modules that carry LoRA, and the one home of the LoRA math outside the forward.

    A module declares its adapter with two methods: `adapter_params()` (its trainable factors) and
    `delta_weight()` (s * B @ A for each base parameter it adapts). Merge and unmerge here, the
    merged HF export and the merged weight sync all build on those two.
    """

    lora_enabled: bool
    merged: bool
    _weights_before_merge: dict[str, torch.Tensor] | None = None

    def adapter_params(self) -> dict[str, nn.Parameter]:
        """The adapter's parameters by name relative to this module ({} when it carries none)."""
        raise NotImplementedError

    def delta_weight(self) -> dict[str, torch.Tensor]:
        """Base parameter name (relative to this module) -> s * B @ A in fp32, in that parameter's
        layout ({} when the module carries no adapter)."""
        raise NotImplementedError

    def reset_lora_parameters(self) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def merge_lora(self) -> None:
        """Fold the adapter into the base weights (in fp32); `unmerge_lora` restores them bit-exactly."""
        if self.merged:
            return
        deltas = self.delta_weight()
        if not deltas:
            return
        self._weights_before_merge = {}
        for name, delta in deltas.items():
            weight = getattr(self, name)
            self._weights_before_merge[name] = weight.detach().clone()
            weight.copy_(merged_weight(weight, delta))
        self.merged = True

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        if not self.merged:
            return
        for name, saved in self._weights_before_merge.items():
            getattr(self, name).copy_(saved)
        self._weights_before_merge = None
        self.merged = False


def merged_weight(weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """W + delta, added in fp32 (a small delta survives a low-precision W) and cast back to W's dtype."""
    return (weight.float() + delta).to(weight.dtype)


class LoRALinear(nn.Linear, LoRAModule):
    """nn.Linear plus a low-rank update. `weight`/`bias` are the frozen base; `lora_a`, `lora_b` adapt it."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        lora: LoRAConfig,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.rank = lora.rank
        self.scaling = lora.scaling
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        self.lora_a = nn.Linear(in_features, lora.rank, bias=False, device=device, dtype=dtype)
        self.lora_b = nn.Linear(lora.rank, out_features, bias=False, device=device, dtype=dtype)
        self.lora_enabled = True
        self.merged = False
        if self.weight.device.type != "meta":
            self.reset_lora_parameters()

    def set_rank(self, rank: int, scaling: float) -> None:
        """Give this module its own rank and scaling (new, uninitialised factors on the same device)."""
        device = self.lora_a.weight.device
        self.lora_a = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=self.lora_a.weight.dtype)
        self.lora_b = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=self.lora_b.weight.dtype)
        self.rank, self.scaling = rank, scaling
        if device.type != "meta":
            self.reset_lora_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled or self.merged:
            return out
        x = self.lora_dropout(x.to(self.lora_a.weight.dtype))
        return out + (self.lora_b(self.lora_a(x)) * self.scaling).to(out.dtype)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)

    def adapter_params(self) -> dict[str, nn.Parameter]:
        return {"lora_a.weight": self.lora_a.weight, "lora_b.weight": self.lora_b.weight}

    def delta_weight(self) -> dict[str, torch.Tensor]:
        """{"weight": s * B @ A in fp32, [out, in]}."""
        return {"weight": (self.lora_b.weight.float() @ self.lora_a.weight.float()) * self.scaling}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


def linear(
    in_features: int, out_features: int, bias: bool, name: str, lora: LoRAConfig | None
) -> nn.Linear:
    """An nn.Linear, or a LoRALinear when `lora` targets the HF module name `name`."""
    if lora is not None and lora.targets(name):
        return LoRALinear(in_features, out_features, bias, lora)
    return nn.Linear(in_features, out_features, bias=bias)


class ExpertLoRA(nn.Module):
    """LoRA for a stacked expert weight W[E, out, in]: expert e uses W[e] + s * B[e] @ A[e].

    lora_a: [E, r, in], lora_b: [E, out, r]. Dropout acts on the expert's input, as for LoRALinear.
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, lora: LoRAConfig) -> None:
        super().__init__()
        self.rank = lora.rank
        self.scaling = lora.scaling
        self.lora_a = nn.Parameter(torch.empty(num_experts, lora.rank, in_features))
        self.lora_b = nn.Parameter(torch.empty(num_experts, out_features, lora.rank))
        self.lora_dropout = nn.Dropout(lora.dropout) if lora.dropout > 0 else nn.Identity()
        if self.lora_a.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        # Same bound as kaiming_uniform_(a=sqrt(5)) on each expert's [r, in] matrix (fan_in = in).
        bound = 1.0 / math.sqrt(self.lora_a.shape[-1])
        nn.init.uniform_(self.lora_a, -bound, bound)
        nn.init.zeros_(self.lora_b)

    def forward(self, x: torch.Tensor, expert: int) -> torch.Tensor:
        """Low-rank update for tokens x[n, in] routed to `expert`: [n, out]."""
        x = self.lora_dropout(x.to(self.lora_a.dtype))
        return (x @ self.lora_a[expert].t()) @ self.lora_b[expert].t() * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A per expert in fp32, shape [E, out, in]."""
        return torch.bmm(self.lora_b.float(), self.lora_a.float()) * self.scaling
