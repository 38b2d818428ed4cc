"""Mixture-of-experts pieces: routers and stacked experts (SwiGLU, or non-gated) with grouped-expert LoRA."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from archon.grouped_mm import (
    ExpertGroups,
    StackedExperts,
    expert_matmul,
    grouped_mm_unavailable,
    local_expert_weight,
)
from archon.load_balance import Router
from archon.lora import ExpertLoRA, LoRAConfig, LoRAModule, linear
from archon.models.common.args import GroupLimitedMoEArgs
from archon.models.common.mlp import SwiGLUMLP
from archon.routing_replay import (  # noqa: F401 - at their old path for one release
    moe_routers,
    recorded_routing,
    replayed_routing,
    take_recorded,
)


def choose_experts(router: Router, own_indices: torch.Tensor) -> torch.Tensor:
    """The expert ids [T, k] a router's forward uses: its own top-k `own_indices` [T, k], or, under
    `replayed_routing`, the replayed ids (a token whose replayed row is -1 keeps its own). Under
    `recorded_routing` the ids used are appended to `router.chosen_experts`. Every router computes
    its gate weights at the ids this returns, so a replayed choice gets the weights (and the
    gradient) the router gives those experts."""
    chosen = own_indices
    replay = router.replayed_experts
    if replay is not None:
        if replay.shape != own_indices.shape:
            raise ValueError(
                f"replayed expert ids have shape {tuple(replay.shape)}, the router's forward chooses "
                f"{tuple(own_indices.shape)} ([tokens, num_experts_per_tok])"
            )
        replay = replay.to(device=own_indices.device, dtype=own_indices.dtype)
        chosen = torch.where(replay[:, :1] >= 0, replay, own_indices)
    if router.chosen_experts is not None:
        router.chosen_experts.append(chosen)
    return chosen


class SoftmaxTopKRouter(Router):
    """softmax(x W^T) in fp32, top-k, optionally renormalised over the chosen k (`norm_topk_prob`)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__(num_experts)
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> (weights [T, k] in x's dtype, expert indices [T, k])."""
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_weights, top_indices = torch.topk(probs, self.top_k, dim=-1)
        chosen = choose_experts(self, top_indices)
        if chosen is not top_indices:
            top_weights, top_indices = probs.gather(1, chosen), chosen
        if self.training:
            self.routing.record(probs, top_indices)
        if self.norm_topk_prob:
            top_weights = top_weights / top_weights.sum(dim=-1, keepdim=True)
        return top_weights.to(logits.dtype), top_indices


class TopKSoftmaxRouter(Router):
    """Top-k of the router logits (x W^T, plus a bias when `bias`), then softmax over those k (GPT-OSS).

    The weights of the chosen experts sum to one, as with `SoftmaxTopKRouter(norm_topk_prob=True)`,
    but an expert's weight depends only on the k chosen logits. The load-balance statistics use the
    softmax over all the logits, as HF's auxiliary loss does.
    """

    def __init__(self, dim: int, num_experts: int, top_k: int, bias: bool) -> None:
        super().__init__(num_experts)
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.bias = nn.Parameter(torch.empty(num_experts)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> (weights [T, k] in x's dtype, expert indices [T, k])."""
        logits = F.linear(x, self.weight, self.bias)
        top_logits, top_indices = torch.topk(logits, self.top_k, dim=-1)
        chosen = choose_experts(self, top_indices)
        if chosen is not top_indices:
            top_logits, top_indices = logits.gather(1, chosen), chosen
        if self.training:
            self.routing.record(torch.softmax(logits, dim=-1, dtype=torch.float32), top_indices)
        top_weights = torch.softmax(top_logits, dim=-1, dtype=torch.float32)
        return top_weights.to(logits.dtype), top_indices


class GroupedExperts(nn.Module, LoRAModule, StackedExperts):
    """SwiGLU experts stored stacked, in HF's in-memory layout.

    gate_up_proj: [E, 2*hidden, dim] (gate rows, then up rows); down_proj: [E, dim, hidden].
    With LoRA on "experts", each stacked weight gets an ExpertLoRA (per-expert A and B).

    The token slots are sorted by expert and every projection is one grouped matmul over all experts
    (`expert_matmul`), with no host sync. `grouped_mm = False` (or a device without grouped GEMM)
    takes the reference loop over experts instead. Under expert parallelism
    (`archon.parallel.shard_experts` sets `expert_parallel`) this rank holds only its experts' slices
    of every parameter and the slots travel to their experts' ranks and back (`compute` runs on the
    received slots).

    Subclasses change the layout with `input_major` (weights stored [E, in, out]), add
    `gate_up_proj_bias` / `down_proj_bias`, and override `_activation`. A non-gated subclass names its
    input projection `up_proj` ([E, hidden, dim]) with `input_projection` and `input_rows_per_hidden`.
    """

    input_major = False
    # The stacked projection the tokens enter by, and its output rows per hidden unit (gate and up: 2).
    input_projection = "gate_up_proj"
    input_rows_per_hidden = 2

    def __init__(self, num_experts: int, dim: int, hidden_dim: int, lora: LoRAConfig | None) -> None:
        super().__init__()
        self.num_experts = num_experts
        in_rows = self.input_rows_per_hidden * hidden_dim
        stacked_in = nn.Parameter(torch.empty(num_experts, *self._stacked_shape(dim, in_rows)))
        self.register_parameter(self.input_projection, stacked_in)
        self.down_proj = nn.Parameter(torch.empty(num_experts, *self._stacked_shape(hidden_dim, dim)))
        setattr(self, f"{self.input_projection}_bias", None)
        self.down_proj_bias = None
        in_lora = down_lora = None
        if lora is not None and lora.targets("experts"):
            in_lora = ExpertLoRA(num_experts, dim, in_rows, lora)
            down_lora = ExpertLoRA(num_experts, hidden_dim, dim, lora)
        setattr(self, f"{self.input_projection}_lora", in_lora)
        self.down_proj_lora = down_lora
        self.grouped_mm = True
        self.expert_parallel = None
        self.lora_enabled = True
        self.merged = False

    def _stacked_shape(self, in_features: int, out_features: int) -> tuple[int, int]:
        return (in_features, out_features) if self.input_major else (out_features, in_features)

    @property
    def _input_lora(self) -> ExpertLoRA | None:
        return getattr(self, f"{self.input_projection}_lora")

    @property
    def _lora_active(self) -> bool:
        return self._input_lora is not None and self.lora_enabled and not self.merged

    def _project(
        self,
        x: torch.Tensor,
        weight_name: str,
        bias: torch.Tensor | None,
        lora: ExpertLoRA | None,
        groups: ExpertGroups,
        task_of_row: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Rows x[N, in], sorted by expert, through their expert's slice of the stacked weight
        `weight_name` (plus bias and LoRA): [N, out]. `task_of_row` picks each row's task adapter in
        a multi-task model."""
        out = self._expert_matmul(x, weight_name, groups)
        if bias is not None:
            out = out + local_expert_weight(bias, out.dtype)[groups.expert_of_row]
        if self._lora_active:
            out = out + lora(x, groups, task_of_row).to(out.dtype)
        return out

    def _expert_matmul(self, x: torch.Tensor, weight_name: str, groups: ExpertGroups) -> torch.Tensor:
        """x [N, in] (rows sorted by expert) times each row's expert's slice of `weight_name`: [N, out].
        A quantized base (archon.quant) dequantizes here instead."""
        weight = getattr(self, weight_name)
        weight_in_out = weight if self.input_major else weight.transpose(1, 2)  # [E, in, out]
        return expert_matmul(x, weight_in_out, groups)

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[n, 2*hidden] -> [n, hidden]: silu(gate) * up."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def compute(
        self, x_sorted: torch.Tensor, groups: ExpertGroups, task_of_row: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The experts on rows sorted by expert: x_sorted [N, dim] -> [N, dim] (unweighted); task_of_row
        [N]: each row's task in a multi-task model (None otherwise)."""
        name = self.input_projection
        projected = self._project(x_sorted, name, getattr(self, f"{name}_bias"), self._input_lora, groups, task_of_row)
        h = self._activation(projected)
        return self._project(h, "down_proj", self.down_proj_bias, self.down_proj_lora, groups, task_of_row)

    def forward(self, x: torch.Tensor, top_weights: torch.Tensor, top_indices: torch.Tensor) -> torch.Tensor:
        """x: [T, dim], top_weights/top_indices: [T, k] -> [T, dim]."""
        k = top_indices.shape[1]
        flat_experts = top_indices.reshape(-1)  # [T*k]
        order = torch.argsort(flat_experts, stable=True)  # slots sorted by expert
        token_of_slot = order // k
        x_sorted, expert_of_slot = x[token_of_slot], flat_experts[order]
        task_of_slot = self._input_lora.task_of_rows(token_of_slot) if self._lora_active else None
        if self.expert_parallel is None:
            groups = ExpertGroups.from_sorted(expert_of_slot, self.num_experts, self._use_grouped_mm(x))
            y_sorted = self.compute(x_sorted, groups, task_of_slot)
        else:
            y_sorted = self.expert_parallel.run_experts(
                self.compute, x_sorted, expert_of_slot, self._use_grouped_mm(x), task_of_slot
            )
        y_sorted = y_sorted * top_weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token_of_slot, y_sorted.to(x.dtype))

    def _use_grouped_mm(self, x: torch.Tensor) -> bool:
        return self.grouped_mm and grouped_mm_unavailable(x.device, x.dtype) is None

    def reset_lora_parameters(self) -> None:
        for lora in self._expert_loras().values():
            lora.reset_parameters()

    def _expert_loras(self) -> dict[str, ExpertLoRA]:
        """Stacked weight name -> its ExpertLoRA ({} without LoRA on the experts)."""
        if self._input_lora is None:
            return {}
        return {self.input_projection: self._input_lora, "down_proj": self.down_proj_lora}

    def adapter_params(self) -> dict[str, nn.Parameter]:
        return {
            f"{weight}_lora.{factor}": getattr(lora, factor)
            for weight, lora in self._expert_loras().items()
            for factor in ("lora_a", "lora_b")
        }

    def delta_weight(self) -> dict[str, torch.Tensor]:
        """Per stacked weight: s * B @ A per expert in fp32, in the weight's layout ([E, out, in], or
        [E, in, out] when input-major)."""
        deltas = {}
        for weight, lora in self._expert_loras().items():
            delta = lora.delta_weight()  # [E, out, in]
            deltas[weight] = delta.transpose(1, 2) if self.input_major else delta
        return deltas


def routed_experts(model: nn.Module) -> list[GroupedExperts]:
    """Every MoE layer's routed experts, in layer order."""
    return [module for module in model.modules() if isinstance(module, GroupedExperts)]


class ClampedSwiGLUExperts(GroupedExperts):
    """GPT-OSS experts, stored as HF stores them:

    gate_up_proj: [E, dim, 2*hidden] (input-major; gate and up interleaved, gate in the even
    columns), gate_up_proj_bias: [E, 2*hidden], down_proj: [E, hidden, dim], down_proj_bias: [E, dim].
    Activation: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
    """

    input_major = True

    def __init__(
        self, num_experts: int, dim: int, hidden_dim: int, alpha: float, limit: float, lora: LoRAConfig | None
    ) -> None:
        super().__init__(num_experts, dim, hidden_dim, lora)
        self.alpha = alpha
        self.limit = limit
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, dim))

    def _activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class NonGatedExperts(GroupedExperts):
    """Experts down(act(up(x))) without a gate, stored as HF stores Nemotron-H's:
    up_proj: [E, hidden, dim], down_proj: [E, dim, hidden]. `activation` maps [n, hidden] -> [n, hidden]."""

    input_projection = "up_proj"
    input_rows_per_hidden = 1

    def __init__(
        self,
        num_experts: int,
        dim: int,
        hidden_dim: int,
        activation: Callable[[torch.Tensor], torch.Tensor],
        lora: LoRAConfig | None,
    ) -> None:
        super().__init__(num_experts, dim, hidden_dim, lora)
        self.activation = activation

    def _activation(self, up: torch.Tensor) -> torch.Tensor:
        return self.activation(up)


class SparseMoE(nn.Module):
    """Router (`gate`, HF's name) plus stacked experts."""

    def __init__(self, router: nn.Module, experts: GroupedExperts) -> None:
        super().__init__()
        self.gate = router
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_weights, top_indices = self.gate(x)
        return self.experts(x, top_weights, top_indices)


class SigmoidGroupTopKRouter(Router):
    """Group-limited sigmoid routing (DeepSeek-V3, Kimi K2, GLM-4.5; one group: MiniMax-M2), in fp32.

    scores = sigmoid(x W^T). The choice uses scores + e_score_correction_bias: the experts form
    `n_group` equal groups, each scored by the sum of its two best biased scores; only experts in the
    `topk_group` best groups compete for the top k. The weights are the unbiased scores of the chosen
    experts, renormalised to sum to one when `norm_topk_prob`, times `routed_scaling_factor`.
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__(num_experts)
        if n_group < 1 or num_experts % n_group:
            raise ValueError(f"n_group ({n_group}) must divide the number of routed experts ({num_experts})")
        if num_experts // n_group < 2:
            raise ValueError(
                f"n_group ({n_group}) leaves fewer than 2 experts per group; a group is scored by its two best experts"
            )
        if not 1 <= topk_group <= n_group:
            raise ValueError(f"topk_group ({topk_group}) must be between 1 and n_group ({n_group})")
        if not 1 <= top_k <= topk_group * (num_experts // n_group):
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be between 1 and the {topk_group * (num_experts // n_group)} "
                f"experts that topk_group ({topk_group}) groups hold"
            )
        self.top_k = top_k
        self.n_group = n_group
        self.topk_group = topk_group
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, dim))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    @property
    def correction_bias(self) -> torch.Tensor:
        return self.e_score_correction_bias

    def _apply(self, fn, recurse=True):
        # HF keeps e_score_correction_bias in fp32 whatever the model dtype: the expert choice turns on
        # differences in it that bf16 would round away. Device moves still apply.
        bias = self._buffers.pop("e_score_correction_bias")
        super()._apply(fn, recurse)
        moved = fn(bias)
        if moved.dtype != torch.float32:
            moved = bias.to(device=moved.device, dtype=torch.float32)
        self._buffers["e_score_correction_bias"] = moved
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, dim] -> (weights [T, k] in fp32, expert indices [T, k])."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        candidates = biased if self.n_group == 1 else self._in_top_groups(biased)
        top_indices = choose_experts(self, candidates.topk(self.top_k, dim=-1, sorted=False).indices)
        if self.training:
            self.routing.record(scores / scores.sum(dim=-1, keepdim=True), top_indices)
        top_weights = scores.gather(1, top_indices)
        if self.norm_topk_prob:
            top_weights = top_weights / (top_weights.sum(dim=-1, keepdim=True) + 1e-20)
        return top_weights * self.routed_scaling_factor, top_indices

    def _in_top_groups(self, biased: torch.Tensor) -> torch.Tensor:
        """biased [T, E] with the experts outside each token's `topk_group` best groups set to -inf."""
        per_group = biased.view(biased.shape[0], self.n_group, -1)  # [T, G, E/G]
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        top_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_groups, True)
        expert_mask = group_mask.repeat_interleave(per_group.shape[-1], dim=1)  # [T, E]
        return biased.masked_fill(~expert_mask, float("-inf"))


class SharedExpertsMoE(SparseMoE):
    """Routed experts plus `shared_experts`, an MLP every token goes through, added to their output."""

    def __init__(self, router: nn.Module, experts: GroupedExperts, shared_experts: nn.Module) -> None:
        super().__init__(router, experts)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.shared_experts(x)


def group_limited_moe_mlp(args: GroupLimitedMoEArgs, layer_idx: int, lora: LoRAConfig | None) -> nn.Module:
    """Layer `layer_idx`'s MLP: dense for the first `first_k_dense_replace` layers, else routed + shared experts."""
    if not args.is_moe_layer(layer_idx):
        return SwiGLUMLP(args.hidden_size, args.intermediate_size, bias=False, lora=lora)
    return SharedExpertsMoE(
        SigmoidGroupTopKRouter(
            args.hidden_size,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.n_group,
            args.topk_group,
            args.norm_topk_prob,
            args.routed_scaling_factor,
        ),
        GroupedExperts(args.n_routed_experts, args.hidden_size, args.moe_intermediate_size, lora),
        SwiGLUMLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts, bias=False, lora=lora),
    )


class SharedExpertMoE(nn.Module):
    """Routed experts (softmax top-k, renormalised over the k unless `norm_topk_prob` is False) plus
    one shared expert scaled per token by sigmoid(shared_expert_gate(x)); HF names gate, experts,
    shared_expert, shared_expert_gate. `args` needs the HF fields hidden_size, num_experts,
    num_experts_per_tok, moe_intermediate_size and shared_expert_intermediate_size (Qwen3.5 MoE,
    which always renormalises, and Qwen3-Next, whose config says)."""

    def __init__(self, args, lora: LoRAConfig | None, norm_topk_prob: bool = True) -> None:
        super().__init__()
        dim = args.hidden_size
        self.gate = SoftmaxTopKRouter(dim, args.num_experts, args.num_experts_per_tok, norm_topk_prob)
        self.experts = GroupedExperts(args.num_experts, dim, args.moe_intermediate_size, lora)
        self.shared_expert = SwiGLUMLP(dim, args.shared_expert_intermediate_size, bias=False, lora=lora)
        self.shared_expert_gate = linear(dim, 1, False, "shared_expert_gate", lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top_weights, top_indices = self.gate(x)
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.experts(x, top_weights, top_indices) + shared
