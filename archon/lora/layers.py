"""LoRA layers that are part of the model from construction on (meta device included).

Numerics follow PEFT: y = W x + b + s * B(A(dropout(x))), s = alpha/r (or alpha/sqrt(r) with rsLoRA),
A kaiming-uniform(a=sqrt(5)), B zeros. Base parameters keep their names (`q_proj.weight`), so plain
HF checkpoints load unchanged; adapter parameters are `lora_a` / `lora_b`.

A layer is built with the config's default rank and scaling; `configure_lora_modules`
(archon.lora.utils) then gives each module the rank and scaling that the config's patterns assign to
its HF path, while the model is still on the meta device.

Several adapters on one base, one per task (multi-LoRA): archon.lora.multi_task.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from archon import packed_linear
from archon.grouped_mm import ExpertGroups, expert_matmul
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


@torch.no_grad()
def init_lora_factors(lora_a: torch.Tensor, lora_b: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """PEFT's LoRA init, in place: A [..., r, in] uniform in [-1/sqrt(in), 1/sqrt(in)] (what
    kaiming_uniform_(a=sqrt(5)) draws for each [r, in] matrix: fan_in = in), B [..., out, r] zeros.
    A takes one draw from `generator` (default: the global generator); B takes none."""
    bound = 1.0 / math.sqrt(lora_a.shape[-1])
    lora_a.uniform_(-bound, bound, generator=generator)
    lora_b.zero_()


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
        return self.forward_with_base(x, self.weight, self.bias)

    def forward_with_base(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The forward on base weights given by the caller (a task view's owner passes its own)."""
        if not self.lora_enabled or self.merged:
            return packed_linear.linear(x, weight, bias)
        frozen_base = not weight.requires_grad and (bias is None or not bias.requires_grad)
        if frozen_base and (isinstance(self.lora_dropout, nn.Identity) or not self.training):
            return _FrozenBaseLoRALinear.apply(x, weight, bias, self.lora_a.weight, self.lora_b.weight, self.scaling)
        out = packed_linear.linear(x, weight, bias)
        x = self.lora_dropout(x.to(self.lora_a.weight.dtype))
        return out + (self.lora_b(self.lora_a(x)) * self.scaling).to(out.dtype)

    def reset_lora_parameters(self) -> None:
        init_lora_factors(self.lora_a.weight, self.lora_b.weight)

    def adapter_params(self) -> dict[str, nn.Parameter]:
        return {"lora_a.weight": self.lora_a.weight, "lora_b.weight": self.lora_b.weight}

    def delta_weight(self) -> dict[str, torch.Tensor]:
        """{"weight": s * B @ A in fp32, [out, in]}."""
        return {"weight": (self.lora_b.weight.float() @ self.lora_a.weight.float()) * self.scaling}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scaling={self.scaling:g}"


class _FrozenBaseLoRALinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with W and b frozen and no dropout: LoRALinear's training path.

    Autograd on that composition spends passes over the [N, out] output on scaling and adding the
    low-rank term, and more in the backward on scaling its gradient and summing the two input
    gradients. Here the low-rank terms are folded into the GEMMs instead (addmm with alpha = s, in
    place for the input gradient, the scaling applied to the [N, r] factors), and no gradient of W or
    b is formed. The LoRA factors may be in a wider dtype than W (fp32 adapter on a bf16 base): then
    their product is formed in that dtype and rounded once, as in the unfused form.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        out, h = frozen_base_lora_forward(x2, weight, bias, lora_a, lora_b, scaling)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, h)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        grad_x, grad_a, grad_b = frozen_base_lora_backward(
            grad_out, x2, lambda: weight, lora_a, lora_b, h, ctx.scaling, (need_x, need_a, need_b)
        )
        return None if grad_x is None else grad_x.view(ctx.x_shape), None, None, grad_a, grad_b, None


def frozen_base_lora_forward(x2, weight, bias, lora_a, lora_b, scaling):
    """x2 [N, in] -> (x2 W^T + b + s (x2 A^T) B^T [N, out], h = x2 A^T [N, r]): the low-rank term
    folded into the GEMMs (`_FrozenBaseLoRALinear`)."""
    out = packed_linear.linear(x2, weight, bias)  # [N, out]
    h = x2.to(lora_a.dtype) @ lora_a.t()  # [N, r]
    # Not in place: selective activation checkpointing keeps F.linear's output as it was made.
    if out.dtype == h.dtype:
        out = torch.addmm(out, h, lora_b.t(), alpha=scaling)
    else:
        out = out + (h @ lora_b.t() * scaling).to(out.dtype)
    return out, h


def frozen_base_lora_backward(grad_out, x2, weight_fn, lora_a, lora_b, h, scaling, needs):
    """Gradients (x2 [N, in], A [r, in], B [out, r]; None where `needs` = (x, A, B) says so) of
    `frozen_base_lora_forward`, for grad_out [..., out]. `weight_fn()` gives W [out, in], asked for
    only when x needs a gradient (a quantized base dequantizes it there)."""
    need_x, need_a, need_b = needs
    g = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
    g_lora = g.to(lora_b.dtype)
    grad_h = (g_lora @ lora_b).mul_(scaling)  # [N, r]: d/dh of s h B^T
    grad_x = grad_a = grad_b = None
    if need_x:
        grad_x = g @ weight_fn()  # [N, in]
        if grad_x.dtype == grad_h.dtype:
            grad_x.addmm_(grad_h, lora_a)
        else:
            grad_x += (grad_h @ lora_a).to(grad_x.dtype)
    if need_a:
        grad_a = grad_h.t() @ x2.to(lora_a.dtype)  # [r, in]
    if need_b:
        grad_b = (g_lora.t() @ h).mul_(scaling)  # [out, r]
    return grad_x, grad_a, grad_b


def linear(in_features: int, out_features: int, bias: bool, name: str, lora: LoRAConfig | None) -> nn.Linear:
    """A Linear (archon.packed_linear), or a LoRALinear when `lora` targets the HF module name `name`."""
    if lora is not None and lora.targets(name):
        return LoRALinear(in_features, out_features, bias, lora)
    return packed_linear.Linear(in_features, out_features, bias=bias)


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

    def reset_parameters(self) -> None:
        init_lora_factors(self.lora_a, self.lora_b)

    def task_of_rows(self, token_of_row: torch.Tensor) -> None:
        """The task of each row, for a multi-task layer (MultiExpertLoRA); one adapter serves every row here."""
        return None

    def forward(self, x: torch.Tensor, groups: ExpertGroups, task_of_row: torch.Tensor | None = None) -> torch.Tensor:
        """Low-rank update for rows x[N, in] sorted by expert: [N, out]. Two grouped matmuls over all
        experts, x @ A[e]^T then @ B[e]^T. `task_of_row` matters only to MultiExpertLoRA."""
        x = self.lora_dropout(x.to(self.lora_a.dtype))
        h = expert_matmul(x, self.lora_a.transpose(1, 2), groups) * self.scaling  # [N, r]: scaled while small
        return expert_matmul(h, self.lora_b.transpose(1, 2), groups)

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A per expert in fp32, shape [E, out, in]."""
        return torch.bmm(self.lora_b.float(), self.lora_a.float()) * self.scaling
