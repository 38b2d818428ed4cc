"""LoRA layers that are part of the model from construction on (meta device included).

Numerics follow PEFT: y = W x + b + s * B(A(dropout(x))), s = alpha/r (or alpha/sqrt(r) with rsLoRA),
A kaiming-uniform(a=sqrt(5)), B zeros. Base parameters keep their names (`q_proj.weight`), so plain
HF checkpoints load unchanged; adapter parameters are `lora_a` / `lora_b`.

A layer is built with the config's default rank and scaling; `configure_lora_modules`
(archon.lora.utils) then gives each module the rank and scaling that the config's patterns assign to
its HF path, while the model is still on the meta device.

Several tasks (multi-LoRA): `MultiLoRALinear` and `MultiExpertLoRA` hold one adapter per task on one
frozen base and apply each token's own adapter in a packed batch that mixes tasks. The tokens are
sorted by task once per forward (`AdapterRouting`), and every adapted layer then makes two grouped
matmuls over the tasks' stacked factors (ranks zero-padded to the largest), whatever the number of
tasks. A module that a task does not target adds nothing to that task's tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from archon.grouped_mm import ExpertGroups, expert_matmul, grouped_mm_unavailable
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
        if not self.lora_enabled or self.merged:
            return F.linear(x, self.weight, self.bias)
        frozen_base = not self.weight.requires_grad and (self.bias is None or not self.bias.requires_grad)
        if frozen_base and (isinstance(self.lora_dropout, nn.Identity) or not self.training):
            return _FrozenBaseLoRALinear.apply(x, self.weight, self.bias, self.lora_a.weight, self.lora_b.weight,
                                               self.scaling)  # fmt: skip
        out = F.linear(x, self.weight, self.bias)
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
        out = F.linear(x2, weight, bias)  # [N, out]
        h = x2.to(lora_a.dtype) @ lora_a.t()  # [N, r]
        # Not in place: selective activation checkpointing keeps F.linear's output as it was made.
        if out.dtype == h.dtype:
            out = torch.addmm(out, h, lora_b.t(), alpha=scaling)
        else:
            out = out + (h @ lora_b.t() * scaling).to(out.dtype)
        ctx.save_for_backward(x2, weight, lora_a, lora_b, h)
        ctx.scaling = scaling
        ctx.x_shape = x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, weight, lora_a, lora_b, h = ctx.saved_tensors
        need_x, _, _, need_a, need_b, _ = ctx.needs_input_grad
        g = grad_out.reshape(-1, grad_out.shape[-1])  # [N, out]
        g_lora = g.to(lora_b.dtype)
        grad_h = (g_lora @ lora_b).mul_(ctx.scaling)  # [N, r]: d/dh of s h B^T
        grad_x = grad_a = grad_b = None
        if need_x:
            grad_x = g @ weight  # [N, in]
            if grad_x.dtype == grad_h.dtype:
                grad_x.addmm_(grad_h, lora_a)
            else:
                grad_x += (grad_h @ lora_a).to(grad_x.dtype)
            grad_x = grad_x.view(ctx.x_shape)
        if need_a:
            grad_a = grad_h.t() @ x2.to(lora_a.dtype)  # [r, in]
        if need_b:
            grad_b = (g_lora.t() @ h).mul_(ctx.scaling)  # [out, r]
        return grad_x, None, None, grad_a, grad_b, None


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

    def forward(self, x: torch.Tensor, groups: ExpertGroups, token_of_row: torch.Tensor | None = None) -> torch.Tensor:
        """Low-rank update for rows x[N, in] sorted by expert: [N, out]. Two grouped matmuls over all
        experts, x @ A[e]^T then @ B[e]^T. `token_of_row` matters only to MultiExpertLoRA (one
        adapter serves every row here)."""
        x = self.lora_dropout(x.to(self.lora_a.dtype))
        h = expert_matmul(x, self.lora_a.transpose(1, 2), groups) * self.scaling  # [N, r]: scaled while small
        return expert_matmul(h, self.lora_b.transpose(1, 2), groups)

    def delta_weight(self) -> torch.Tensor:
        """s * B @ A per expert in fp32, shape [E, out, in]."""
        return torch.bmm(self.lora_b.float(), self.lora_a.float()) * self.scaling


# ---------------------------------------------------------------------------------------------
# Several adapters on one base (multi-LoRA)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterRouting:
    """Which task's adapter each token of a packed batch uses, and the tokens sorted by task.

    task_of_token: [T] long, an index into the model's tasks (their order in the config).
    order: [T] token indices sorted by task (stable); restore: its inverse permutation. Both None
        when the tokens already come task by task (a mixed batch packs each task's sequences
        together), so the layers need not move any rows.
    groups: the sorted tokens split among the tasks (one group per task, empty ones included).
    """

    task_of_token: torch.Tensor
    order: torch.Tensor | None
    restore: torch.Tensor | None
    groups: ExpertGroups

    @classmethod
    def from_task_ids(cls, task_of_token: torch.Tensor, num_tasks: int) -> AdapterRouting:
        if task_of_token.numel() and (int(task_of_token.min()) < 0 or int(task_of_token.max()) >= num_tasks):
            raise ValueError(
                f"task ids must lie in [0, {num_tasks}) for a model with {num_tasks} task adapters, got "
                f"{int(task_of_token.min())}..{int(task_of_token.max())}"
            )
        task_of_token = task_of_token.long()
        grouped = grouped_mm_unavailable(task_of_token.device, torch.float32) is None  # LoRA factors are fp32
        if bool((task_of_token[1:] >= task_of_token[:-1]).all()):
            return cls(task_of_token, None, None, ExpertGroups.from_sorted(task_of_token, num_tasks, grouped))
        order = torch.argsort(task_of_token, stable=True)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        return cls(task_of_token, order, restore, ExpertGroups.from_sorted(task_of_token[order], num_tasks, grouped))


def mixed_lora_delta(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    dropout: torch.Tensor | None,
    order: torch.Tensor | None,
    restore: torch.Tensor | None,
    groups: ExpertGroups,
) -> torch.Tensor:
    """Each row's own low-rank update, s_g * B_g A_g x, for rows x [N, in] of several groups.

    lora_a: [G, in, r], lora_b: [G, r, out], scaling: [G]; `order` sorts the rows by group, `groups`
    splits the sorted rows, `restore` puts them back (both None: the rows are sorted already).
    dropout: [G] drop probabilities (None: none). Returns [N, out] in the factors' dtype: one grouped
    matmul for A, one for B.
    """
    x_sorted = (x if order is None else x[order]).to(lora_a.dtype)  # [N, in]
    group_of_row = groups.expert_of_row
    if dropout is not None:
        keep = 1.0 - dropout[group_of_row, None]  # [N, 1]
        x_sorted = x_sorted * (torch.rand_like(x_sorted) < keep) / keep
    h = expert_matmul(x_sorted, lora_a, groups) * scaling[group_of_row, None]  # [N, r]: scaled while small
    out = expert_matmul(h, lora_b, groups)
    return out if restore is None else out[restore]


class TaskAdapter(nn.Module):
    """One task's factors for one linear: lora_a [r, in], lora_b [out, r] (as LoRALinear's)."""

    def __init__(self, in_features: int, out_features: int, rank: int, scaling: float, dropout: float) -> None:
        super().__init__()
        self.rank, self.scaling, self.dropout = rank, scaling, dropout
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)
        if self.lora_a.weight.device.type != "meta":
            self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.lora_a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_b.weight)


def _refuse_without_task(what: str):
    raise ValueError(
        f"{what} of a multi-task module has one value per task; take it for one task inside "
        "archon.lora.task_view(model, task)"
    )


def task_constants(module: nn.Module, scaling: list[float], dropout: list[float], like: torch.Tensor):
    """The tasks' scalings [K] and dropout probabilities [K] (None when no task drops) as tensors on
    `like`'s device and dtype, made once per device and kept on `module`: a tensor built from a host
    list at every forward is a host-to-device copy that waits for the device, in every layer."""
    key = (like.device, like.dtype)
    cached = module.task_constants
    if cached is None or cached[0] != key:
        scaling_t = torch.tensor(scaling, dtype=like.dtype, device=like.device)
        dropout_t = torch.tensor(dropout, dtype=like.dtype, device=like.device) if any(dropout) else None
        cached = module.task_constants = (key, scaling_t, dropout_t)
    return cached[1], cached[2]


class MultiLoRALinear(nn.Linear, LoRAModule):
    """nn.Linear plus one low-rank update per task; each token takes its task's update.

    task_settings: every task of the model in order, each with its (rank, scaling, dropout) here, or
    None when the task does not target this module. The forward needs the batch's `routing`, set by
    `archon.lora.adapter_routing`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        task_settings: dict[str, tuple[int, float, float] | None],
        device=None,
        dtype=None,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.task_names = tuple(task_settings)
        self.tasks = nn.ModuleDict({
            name: TaskAdapter(in_features, out_features, *settings)
            for name, settings in task_settings.items() if settings is not None
        })  # fmt: skip
        self.routing: AdapterRouting | None = None
        self.task_constants: tuple | None = None
        """(device and dtype, scaling [K], dropout [K] or None), made by `task_constants`."""
        self.lora_enabled = True
        self.merged = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if not self.lora_enabled:
            return out
        if self.routing is None:
            raise RuntimeError(
                "a multi-task model needs each token's task: run its forward inside "
                "archon.lora.adapter_routing(model, task_of_token)"
            )
        lora_a, lora_b, scaling, dropout = self._stacked_factors()
        x2 = x.reshape(-1, x.shape[-1])  # [T, in]
        r = self.routing
        delta = mixed_lora_delta(x2, lora_a, lora_b, scaling, dropout, r.order, r.restore, r.groups)
        return out + delta.view(*x.shape[:-1], delta.shape[-1]).to(out.dtype)

    def _stacked_factors(self):
        """The tasks' factors zero-padded to the largest rank r and stacked in task order: A [K, in, r],
        B [K, r, out], scaling [K], dropout [K] (None when no task drops or in eval mode). A task
        without an adapter here has zero factors."""
        rank = max(adapter.rank for adapter in self.tasks.values())
        like = next(iter(self.tasks.values())).lora_a.weight
        zeros_a = like.new_zeros(rank, self.in_features)
        zeros_b = like.new_zeros(self.out_features, rank)
        a, b, scaling, dropout = [], [], [], []
        for name in self.task_names:
            adapter = self.tasks[name] if name in self.tasks else None
            if adapter is None:
                a.append(zeros_a), b.append(zeros_b), scaling.append(0.0), dropout.append(0.0)
                continue
            pad = rank - adapter.rank
            a.append(F.pad(adapter.lora_a.weight, (0, 0, 0, pad)) if pad else adapter.lora_a.weight)
            b.append(F.pad(adapter.lora_b.weight, (0, pad)) if pad else adapter.lora_b.weight)
            scaling.append(adapter.scaling)
            dropout.append(adapter.dropout)
        scaling_t, dropout_t = task_constants(self, scaling, dropout, like)
        a_all, b_all = torch.stack(a).transpose(1, 2), torch.stack(b).transpose(1, 2)  # [K, in, r], [K, r, out]
        return a_all, b_all, scaling_t, dropout_t if self.training else None

    def single_task_module(self, task: str) -> nn.Linear:
        """This module as a single-adapter model for `task` has it: a LoRALinear (or, where the task
        has no adapter, an nn.Linear) sharing this module's parameters."""
        adapter = self.tasks[task] if task in self.tasks else None
        if adapter is None:
            view = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        else:
            view = LoRALinear(self.in_features, self.out_features, self.bias is not None,
                              LoRAConfig(rank=adapter.rank), device="meta")  # fmt: skip
            view.lora_a, view.lora_b, view.scaling = adapter.lora_a, adapter.lora_b, adapter.scaling
            view.lora_dropout = nn.Dropout(adapter.dropout) if adapter.dropout > 0 else nn.Identity()
            view.lora_enabled = self.lora_enabled
        view.weight, view.bias = self.weight, self.bias
        return view.train(self.training)

    @torch.no_grad()
    def reset_lora_parameters(self) -> None:
        for adapter in self.tasks.values():
            adapter.reset_parameters()

    def adapter_params(self) -> dict[str, nn.Parameter]:
        return dict(self.tasks.named_parameters(prefix="tasks"))

    def delta_weight(self) -> dict[str, torch.Tensor]:
        _refuse_without_task("delta_weight")

    def extra_repr(self) -> str:
        ranks = {name: adapter.rank for name, adapter in self.tasks.items()}
        return f"{super().extra_repr()}, task ranks={ranks}"


class MultiExpertLoRA(nn.Module):
    """One ExpertLoRA per task on a stacked expert weight; each token slot takes its task's adapter.

    task_configs: every task of the model in order, with its LoRAConfig, or None when the task does
    not adapt the experts. The forward needs the batch's `routing` (set by `adapter_routing`) and the
    token of each row.
    """

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, task_configs: dict[str, LoRAConfig | None]
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.task_names = tuple(task_configs)
        self.tasks = nn.ModuleDict({
            name: ExpertLoRA(num_experts, in_features, out_features, lora)
            for name, lora in task_configs.items() if lora is not None
        })  # fmt: skip
        self.routing: AdapterRouting | None = None
        self.task_constants: tuple | None = None
        """(device and dtype, scaling [K], dropout [K] or None), made by `task_constants`."""

    def reset_parameters(self) -> None:
        for adapter in self.tasks.values():
            adapter.reset_parameters()

    def forward(self, x: torch.Tensor, groups: ExpertGroups, token_of_row: torch.Tensor | None = None) -> torch.Tensor:
        """Low-rank update for rows x [N, in] sorted by expert, row i from token token_of_row[i]:
        [N, out]. The rows are grouped by (task, expert) for two grouped matmuls over all pairs."""
        if self.routing is None or token_of_row is None:
            raise RuntimeError(
                "multi-task expert LoRA needs each token's task: run the model's forward inside "
                "archon.lora.adapter_routing(model, task_of_token)"
            )
        E, K = self.num_experts, len(self.task_names)
        pair = self.routing.task_of_token[token_of_row] * E + groups.expert_of_row  # [N]: task * E + expert
        order = torch.argsort(pair, stable=True)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        pair_groups = ExpertGroups.from_sorted(pair[order], K * E, grouped=groups.host_offsets is None)
        lora_a, lora_b, scaling, dropout = self._stacked_factors()
        scaling = scaling.repeat_interleave(E)  # [K*E]
        dropout = None if dropout is None else dropout.repeat_interleave(E)
        return mixed_lora_delta(x, lora_a, lora_b, scaling, dropout, order, restore, pair_groups)

    def _stacked_factors(self):
        """A [K*E, in, r], B [K*E, r, out] (task-major, ranks zero-padded to the largest r),
        scaling [K], dropout [K] or None."""
        rank = max(adapter.rank for adapter in self.tasks.values())
        like = next(iter(self.tasks.values())).lora_a
        E, _, in_features = like.shape
        out_features = next(iter(self.tasks.values())).lora_b.shape[1]
        a, b, scaling, dropout = [], [], [], []
        for name in self.task_names:
            adapter = self.tasks[name] if name in self.tasks else None
            if adapter is None:
                a.append(like.new_zeros(E, rank, in_features)), b.append(like.new_zeros(E, out_features, rank))
                scaling.append(0.0), dropout.append(0.0)
                continue
            pad = rank - adapter.rank
            a.append(F.pad(adapter.lora_a, (0, 0, 0, pad)))
            b.append(F.pad(adapter.lora_b, (0, pad)))
            scaling.append(adapter.scaling)
            dropout.append(adapter.lora_dropout.p if isinstance(adapter.lora_dropout, nn.Dropout) else 0.0)
        a_all = torch.cat(a).transpose(1, 2)  # [K*E, in, r]
        b_all = torch.cat(b).transpose(1, 2)  # [K*E, r, out]
        scaling_t, dropout_t = task_constants(self, scaling, dropout, like)
        return a_all, b_all, scaling_t, dropout_t if self.training else None

    def delta_weight(self) -> torch.Tensor:
        _refuse_without_task("delta_weight")
