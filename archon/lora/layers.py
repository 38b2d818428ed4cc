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

from archon.grouped_mm import ExpertGroups, expert_matmul
from archon.lora.config import LoRAConfig


class LoRAModule:
    """Mixin for modules that carry LoRA: they can be re-initialised, switched off, merged, unmerged."""

    lora_enabled: bool
    merged: bool

    def reset_lora_parameters(self) -> None:
        raise NotImplementedError

    def merge_lora(self) -> None:
        raise NotImplementedError

    def unmerge_lora(self) -> None:
        raise NotImplementedError


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
        self._weight_before_merge: torch.Tensor | None = None
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

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A in fp32, shape [out, in]."""
        return (self.lora_b.weight.float() @ self.lora_a.weight.float()) * self.scaling

    @torch.no_grad()
    def merge_lora(self) -> None:
        if self.merged:
            return
        self._weight_before_merge = self.weight.detach().clone()
        self.weight.copy_((self.weight.float() + self.delta_weight()).to(self.weight.dtype))
        self.merged = True

    @torch.no_grad()
    def unmerge_lora(self) -> None:
        if not self.merged:
            return
        self.weight.copy_(self._weight_before_merge)
        self._weight_before_merge = None
        self.merged = False

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

    def forward(self, x: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
        """Low-rank update for rows x[N, in] sorted by expert: [N, out]. Two grouped matmuls over all
        experts, x @ A[e]^T then @ B[e]^T."""
        x = self.lora_dropout(x.to(self.lora_a.dtype))
        h = expert_matmul(x, self.lora_a.transpose(1, 2), groups)  # [N, r]
        return expert_matmul(h, self.lora_b.transpose(1, 2), groups) * self.scaling

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A per expert in fp32, shape [E, out, in]."""
        return torch.bmm(self.lora_b.float(), self.lora_a.float()) * self.scaling
