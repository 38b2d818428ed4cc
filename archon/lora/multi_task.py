"""Several LoRA adapters on one frozen base (multi-LoRA), one per task.

`MultiLoRALinear` and `MultiExpertLoRA` hold one adapter per task on one frozen base and apply each
token's own adapter in a packed batch that mixes tasks. The tokens are sorted by task once per
forward (`AdapterRouting`), and every adapted layer then makes two grouped matmuls over the tasks'
stacked factors (ranks zero-padded to the largest), whatever the number of tasks. A module that a
task does not target adds nothing to that task's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from archon import packed_linear
from archon.grouped_mm import ExpertGroups, expert_matmul, grouped_mm_unavailable, local_part
from archon.lora.config import LoRAConfig
from archon.lora.layers import ExpertLoRA, LoRALinear, LoRAModule, init_lora_factors


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
        # fp32 LoRA factors (fp64 ones, in equality tests, take grouped_mm's own loop)
        grouped = grouped_mm_unavailable(task_of_token.device, torch.float32) is None
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

    def reset_parameters(self) -> None:
        init_lora_factors(self.lora_a.weight, self.lora_b.weight)


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


class FactorCache:
    """The stacked factors of a multi-task layer, kept between no-grad forwards (see
    `archon.lora.cached_task_factors`): valid while the factors are the same tensors at the same
    versions (an in-place update, such as an optimizer step or a load, bumps a tensor's version)."""

    def __init__(self) -> None:
        self.factors: tuple[torch.Tensor, ...] = ()
        self.versions: tuple[tuple[int, int], ...] = ()
        self.stacked: tuple[torch.Tensor, torch.Tensor] | None = None

    @staticmethod
    def _versions(factors: tuple[torch.Tensor, ...]) -> tuple[tuple[int, int], ...]:
        # A DTensor's shard is written through its local tensor (copy_local_into), which has its own counter.
        return tuple((t._version, (t._local_tensor if isinstance(t, DTensor) else t)._version) for t in factors)

    def get(self, factors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.stacked is None or len(factors) != len(self.factors):
            return None
        if any(a is not b for a, b in zip(factors, self.factors)) or self._versions(factors) != self.versions:
            return None
        return self.stacked

    def put(self, factors: tuple[torch.Tensor, ...], stacked: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.factors, self.versions, self.stacked = factors, self._versions(factors), stacked


def stacked_task_factors(
    module: nn.Module, factors: list[tuple[torch.Tensor, torch.Tensor] | None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tasks' factors zero-padded to the largest rank r and stacked in task order.

    factors: each task's (A [L, r_k, in], B [L, out, r_k]) in task order, L experts or none
        (A [r_k, in], B [out, r_k] of a linear), or None for a task without an adapter here (zero
        factors). DTensors (TP, EP) are stacked from this rank's parts (`local_part`).
    Returns A [K*L, in, r], B [K*L, r, out] (task-major; L = 1 for a linear).

    While `module.factor_cache` is set (`archon.lora.cached_task_factors`) and no gradient flows to
    the factors, the stacks are made once and reused for as long as the factors are unchanged.
    """
    params = tuple(t for pair in factors if pair is not None for t in pair)
    cache: FactorCache | None = module.factor_cache
    if cache is not None and (torch.is_grad_enabled() and any(t.requires_grad for t in params)):
        cache = None
    if cache is not None and (stacked := cache.get(params)) is not None:
        return stacked
    local = [None if pair is None else tuple(local_part(t) for t in pair) for pair in factors]
    a_like, b_like = next(pair for pair in local if pair is not None)
    rank = max(pair[0].shape[-2] for pair in local if pair is not None)
    lead = a_like.shape[:-2].numel()  # L
    in_features, out_features = a_like.shape[-1], b_like.shape[-2]
    a, b = [], []
    for pair in local:
        if pair is None:
            a.append(a_like.new_zeros(lead, rank, in_features))
            b.append(b_like.new_zeros(lead, out_features, rank))
            continue
        lora_a, lora_b = pair[0].reshape(lead, -1, in_features), pair[1].reshape(lead, out_features, -1)
        pad = rank - lora_a.shape[1]
        a.append(F.pad(lora_a, (0, 0, 0, pad)) if pad else lora_a)
        b.append(F.pad(lora_b, (0, pad)) if pad else lora_b)
    stacked = torch.cat(a).transpose(1, 2), torch.cat(b).transpose(1, 2)  # [K*L, in, r], [K*L, r, out]
    if cache is not None:
        cache.put(params, stacked)
    return stacked


class MultiLoRALinear(nn.Linear, LoRAModule):
    """nn.Linear plus one low-rank update per task; each token takes its task's update.

    task_settings: every task of the model in order, each with its (rank, scaling, dropout) here, or
    None when the task does not target this module. The forward needs the batch's `routing`, set by
    `archon.lora.adapter_routing`.

    Under tensor parallelism the tasks' factors take a single adapter's layouts (see
    archon/parallel/tensor_parallel.py) and the low-rank updates are computed on this rank's parts:
    column-parallel, this rank's output columns; row-parallel, a partial sum reduced with the base
    output.
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
        self.tasks = nn.ModuleDict(
            {
                name: TaskAdapter(in_features, out_features, *settings)
                for name, settings in task_settings.items()
                if settings is not None
            }
        )
        self.routing: AdapterRouting | None = None
        self.task_constants: tuple | None = None
        """(device and dtype, scaling [K], dropout [K] or None), made by `task_constants`."""
        self.factor_cache: FactorCache | None = None
        """Set while stacked factors may be reused (`archon.lora.cached_task_factors`)."""
        self.lora_enabled = True
        self.merged = False

    def forward(self, x: torch.Tensor, task_view: nn.Linear | None = None) -> torch.Tensor:
        """x [..., in] -> [..., out]. `task_view`: the call comes from that single-task view's forward
        (`single_task_module`), which computes the output on this module's weights as they are now
        (FSDP2 gathers them for the forward; this module's TP hooks lay out the input and output)."""
        if isinstance(task_view, LoRALinear):
            return task_view.forward_with_base(x, self.weight, self.bias)
        out = packed_linear.linear(x, self.weight, self.bias)
        if not self.lora_enabled or task_view is not None:
            return out
        if self.routing is None:
            raise RuntimeError(
                "a multi-task model needs each token's task: run its forward inside "
                "archon.lora.adapter_routing(model, task_of_token)"
            )
        lora_a, lora_b, scaling, dropout = self._stacked_factors()
        x_local = local_part(x)  # under TP: replicated (column-parallel) or this rank's input columns
        x2 = x_local.reshape(-1, x_local.shape[-1])  # [T, in]
        r = self.routing
        delta = mixed_lora_delta(x2, lora_a, lora_b, scaling, dropout, r.order, r.restore, r.groups)
        delta = delta.view(*x_local.shape[:-1], delta.shape[-1]).to(out.dtype)
        if isinstance(out, DTensor):  # this rank's output columns, or its partial sum (row-parallel)
            delta = DTensor.from_local(delta, out.device_mesh, out.placements, run_check=False)
        return out + delta

    def _stacked_factors(self):
        """The tasks' factors zero-padded to the largest rank r and stacked in task order: A [K, in, r],
        B [K, r, out], scaling [K], dropout [K] (None when no task drops or in eval mode). A task
        without an adapter here has zero factors."""
        adapters = [self.tasks[name] if name in self.tasks else None for name in self.task_names]
        lora_a, lora_b = stacked_task_factors(
            self, [None if t is None else (t.lora_a.weight, t.lora_b.weight) for t in adapters]
        )
        scaling = [0.0 if t is None else t.scaling for t in adapters]
        dropout = [0.0 if t is None else t.dropout for t in adapters]
        scaling_t, dropout_t = task_constants(self, scaling, dropout, lora_a)
        return lora_a, lora_b, scaling_t, dropout_t if self.training else None

    def single_task_module(self, task: str) -> nn.Linear:
        """This module as a single-adapter model for `task` has it: a LoRALinear (or, where the task
        has no adapter, an nn.Linear) sharing this module's parameters. Its parameters are this
        module's as they are at the call (under FSDP2, outside a forward: the sharded ones, which
        exports, loads and checkpoints use); its forward runs this module's forward, which reads the
        base weights when it runs."""
        adapter = self.tasks[task] if task in self.tasks else None
        if adapter is None:
            view = _PlainTaskView(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        else:
            view = _LoRATaskView(
                self.in_features, self.out_features, self.bias is not None, LoRAConfig(rank=adapter.rank), device="meta"
            )
            view.lora_a, view.lora_b, view.scaling = adapter.lora_a, adapter.lora_b, adapter.scaling
            view.lora_dropout = nn.Dropout(adapter.dropout) if adapter.dropout > 0 else nn.Identity()
            view.lora_enabled = self.lora_enabled
        if "weight" in self.__dict__.get("_quantized", {}):  # a quantized base: the view shares its storage
            self.share_quantized_weight(view, "weight")  # archon.quant.modules.QuantizedWeights
        else:
            view.weight = self.weight
        view.bias = self.bias
        object.__setattr__(view, "owner", self)  # not a submodule: its parameters are not the view's
        return view.train(self.training)

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


class _PlainTaskView(nn.Linear):
    """A MultiLoRALinear seen by a task it does not adapt (`MultiLoRALinear.single_task_module`)."""

    owner: MultiLoRALinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner(x, task_view=self)


class _LoRATaskView(LoRALinear):
    """A MultiLoRALinear seen by one task that adapts it (`MultiLoRALinear.single_task_module`)."""

    owner: MultiLoRALinear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.owner(x, task_view=self)


class MultiExpertLoRA(nn.Module):
    """One ExpertLoRA per task on a stacked expert weight; each token slot takes its task's adapter.

    task_configs: every task of the model in order, with its LoRAConfig, or None when the task does
    not adapt the experts. The forward needs the task of each row (`task_of_rows`, from the batch's
    `routing`, set by `adapter_routing`). Under expert parallelism the factors are sharded on the
    expert dimension like the experts, and the rows' tasks travel with them to their experts' ranks.
    """

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, task_configs: dict[str, LoRAConfig | None]
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.task_names = tuple(task_configs)
        self.tasks = nn.ModuleDict(
            {
                name: ExpertLoRA(num_experts, in_features, out_features, lora)
                for name, lora in task_configs.items()
                if lora is not None
            }
        )
        self.routing: AdapterRouting | None = None
        self.task_constants: tuple | None = None
        """(device and dtype, scaling [K], dropout [K] or None), made by `task_constants`."""
        self.factor_cache: FactorCache | None = None
        """Set while stacked factors may be reused (`archon.lora.cached_task_factors`)."""

    def reset_parameters(self) -> None:
        for adapter in self.tasks.values():
            adapter.reset_parameters()

    def task_of_rows(self, token_of_row: torch.Tensor) -> torch.Tensor:
        """[N] the task index of each row, from the token it came from."""
        if self.routing is None:
            raise RuntimeError(
                "multi-task expert LoRA needs each token's task: run the model's forward inside "
                "archon.lora.adapter_routing(model, task_of_token)"
            )
        return self.routing.task_of_token[token_of_row]

    def forward(self, x: torch.Tensor, groups: ExpertGroups, task_of_row: torch.Tensor | None = None) -> torch.Tensor:
        """Low-rank update for rows x [N, in] sorted by (this rank's) expert, row i of task
        task_of_row[i]: [N, out]. The rows are grouped by (task, expert) for two grouped matmuls over
        all pairs."""
        if task_of_row is None:
            raise RuntimeError("MultiExpertLoRA needs the task of each row (task_of_rows)")
        K = len(self.task_names)
        lora_a, lora_b, scaling, dropout = self._stacked_factors()
        E = lora_a.shape[0] // K  # this rank's experts
        pair = task_of_row * E + groups.expert_of_row  # [N]: task * E + expert
        order = torch.argsort(pair, stable=True)
        restore = torch.empty_like(order)
        restore[order] = torch.arange(order.numel(), device=order.device)
        pair_groups = ExpertGroups.from_sorted(pair[order], K * E, grouped=groups.host_offsets is None)
        scaling = scaling.repeat_interleave(E)  # [K*E]
        dropout = None if dropout is None else dropout.repeat_interleave(E)
        return mixed_lora_delta(x, lora_a, lora_b, scaling, dropout, order, restore, pair_groups)

    def _stacked_factors(self):
        """A [K*E, in, r], B [K*E, r, out] (task-major, ranks zero-padded to the largest r; E: this
        rank's experts), scaling [K], dropout [K] or None."""
        adapters = [self.tasks[name] if name in self.tasks else None for name in self.task_names]
        lora_a, lora_b = stacked_task_factors(self, [None if t is None else (t.lora_a, t.lora_b) for t in adapters])
        scaling = [0.0 if t is None else t.scaling for t in adapters]
        dropout = [
            t.lora_dropout.p if t is not None and isinstance(t.lora_dropout, nn.Dropout) else 0.0 for t in adapters
        ]
        scaling_t, dropout_t = task_constants(self, scaling, dropout, lora_a)
        return lora_a, lora_b, scaling_t, dropout_t if self.training else None

    def delta_weight(self) -> torch.Tensor:
        _refuse_without_task("delta_weight")
