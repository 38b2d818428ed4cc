"""LoRA-aware tensor-parallel styles and plan helpers.

A LoRALinear is y = W x + b + s * B(A(x)). Its TP layout follows the base weight:

    column-parallel base (W: Shard(0) on out):  A [r, in] replicated,  B [out, r] Shard(0)
    row-parallel base    (W: Shard(1) on in):   A [r, in] Shard(1),    B [out, r] replicated

so the adapter branch needs no communication of its own in the forward: the column-parallel branch
yields the same output shard as the base, and the row-parallel branch yields a partial sum that is
reduced together with the base output. Plain nn.Linear modules take the same styles (without the
LoRA entries), and a multi-task MultiLoRALinear gives every task's factors (`tasks.<task>.lora_a.weight`,
...) the layout of a single adapter's. Parameters that end up replicated but see sharded activations
get partial gradients; `reduce_partial_grads` (or FSDP2, when it manages the parameter) sums them.

Module names in plans are relative to the module the plan is applied to; `*` matches one level,
e.g. {"layers.*.self_attn.q_proj": colwise()}.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from archon.lora.utils import is_lora_param
from archon.quant.modules import QuantizedWeights


def _distribute_params(module: nn.Module, mesh, placements: Mapping[str, Placement]) -> None:
    """Replace `module`'s (nested) parameters named in `placements` by DTensors with that layout."""
    for path, placement in placements.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        param = getattr(owner, leaf, None)
        if param is None:
            continue
        if isinstance(param, DTensor):
            raise ValueError(f"parameter {path!r} of {type(module).__name__} is already distributed")
        dparam = nn.Parameter(distribute_tensor(param.data, mesh, [placement]), requires_grad=param.requires_grad)
        owner.register_parameter(leaf, dparam)


def _to_dtensor(x, mesh, layout: Placement, desired: Placement):
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, (layout,), run_check=False)
    if x.placements != (desired,):
        x = x.redistribute(mesh, (desired,))
    return x


class _LinearParallel(ParallelStyle):
    """Common machinery: distribute named parameters, convert the input, convert the output."""

    param_placements: dict[str, Placement]
    desired_input: Placement

    def __init__(self, input_layout: Placement, output_layout: Placement, use_local_output: bool = True) -> None:
        super().__init__()
        self.input_layout = input_layout
        self.output_layout = output_layout
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"{type(self).__name__} applies to nn.Linear / LoRALinear, not {type(module).__name__}")
        _distribute_params(module, device_mesh, self._placements(module))

        def input_fn(mod, inputs, mesh):
            return (_to_dtensor(inputs[0], mesh, self.input_layout, self.desired_input), *inputs[1:])

        def output_fn(mod, output, mesh):
            if output.placements != (self.output_layout,):
                output = output.redistribute(mesh, (self.output_layout,))
            return output.to_local() if self.use_local_output else output

        return distribute_module(module, device_mesh, None, input_fn, output_fn)

    def _placements(self, module: nn.Module) -> dict[str, Placement]:
        """Each parameter of `module` by name -> its placement: the base weight and bias by name, a
        LoRA factor (one adapter's `lora_a.weight`, or a task's `tasks.<task>.lora_a.weight`) by the
        factor it is."""
        placements = {}
        for name, _ in module.named_parameters():
            role = ".".join(name.split(".")[-2:]) if is_lora_param(name) else name
            role = role.removesuffix("_qdata").removesuffix("_qscale")  # a quantized weight's storage (archon.quant)
            if role not in self.param_placements:
                raise ValueError(
                    f"{type(self).__name__}: no placement for parameter {name!r} of {type(module).__name__}"
                )
            placements[name] = self.param_placements[role]
            if name.endswith("_qscale") and module._quantized[role].fmt.column_block is None:
                # one scale per row covers every input: each rank of a row-parallel split needs all of it
                placements[name] = Replicate() if placements[name] == Shard(1) else placements[name]
        return placements

    def __repr__(self) -> str:
        return f"{type(self).__name__}(input={self.input_layout}, output={self.output_layout})"


class ColwiseLoRAParallel(_LinearParallel):
    """Column-parallel (output-sharded) linear: input replicated, output sharded on the last dim."""

    param_placements = {
        "weight": Shard(0),
        "bias": Shard(0),
        "lora_a.weight": Replicate(),
        "lora_b.weight": Shard(0),
    }
    desired_input = Replicate()

    def __init__(
        self, input_layout: Placement = Replicate(), output_layout: Placement = Shard(-1), use_local_output: bool = True
    ) -> None:
        super().__init__(input_layout, output_layout, use_local_output)


class RowwiseLoRAParallel(_LinearParallel):
    """Row-parallel (input-sharded) linear: input sharded on the last dim, output summed to replicated."""

    param_placements = {
        "weight": Shard(1),
        "bias": Replicate(),
        "lora_a.weight": Shard(1),
        "lora_b.weight": Replicate(),
    }
    desired_input = Shard(-1)

    def __init__(
        self, input_layout: Placement = Shard(-1), output_layout: Placement = Replicate(), use_local_output: bool = True
    ) -> None:
        super().__init__(input_layout, output_layout, use_local_output)


class ReplicatedParallel(ParallelStyle):
    """Replicated parameters applied to activations sharded as `input_layout` (e.g. per-head QK
    norms on head-sharded q/k: Shard(1) of [T, H, D]; a gated norm takes two such inputs). The
    output keeps the input's layout and is returned as a local tensor; the parameters' gradients
    are partial sums over the shards."""

    def __init__(self, input_layout: Placement) -> None:
        super().__init__()
        self.input_layout = input_layout

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def input_fn(mod, inputs, mesh):
            return tuple(
                _to_dtensor(x, mesh, self.input_layout, self.input_layout) if isinstance(x, torch.Tensor) else x
                for x in inputs
            )

        def output_fn(mod, output, mesh):
            return output.to_local()

        # partition_fn=None: distribute_module replicates every parameter and buffer.
        return distribute_module(module, device_mesh, None, input_fn, output_fn)

    def __repr__(self) -> str:
        return f"ReplicatedParallel(input={self.input_layout})"


class ShardedParameters(ParallelStyle):
    """Shard named parameters without touching the module's inputs or outputs.

    For weights that code outside the module's own forward uses: a vocab-parallel unembedding
    (`{"weight": Shard(0)}`), or per-head parameters such as attention sinks, which the family's
    forward reads through `local_tensor`.
    """

    def __init__(self, placements: Mapping[str, Placement]) -> None:
        super().__init__()
        self.placements = dict(placements)

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        missing = [p for p in self.placements if not _has_param(module, p)]
        if missing:
            raise KeyError(f"ShardedParameters: {type(module).__name__} has no parameter(s) {missing}")
        _distribute_params(module, device_mesh, self.placements)
        return module


def _has_param(module: nn.Module, path: str) -> bool:
    owner_path, _, leaf = path.rpartition(".")
    try:
        owner = module.get_submodule(owner_path) if owner_path else module
    except AttributeError:
        return False
    return isinstance(getattr(owner, leaf, None), torch.Tensor)


def colwise() -> ParallelStyle:
    return ColwiseLoRAParallel()


def rowwise() -> ParallelStyle:
    return RowwiseLoRAParallel()


def vocab_parallel_embedding() -> ParallelStyle:
    """Embedding rows (the vocabulary) sharded; token ids replicated in, hidden states replicated out."""
    return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def vocab_parallel_head() -> ParallelStyle:
    """Unembedding [V, D] sharded on V. The engine's chunked head reads it; it is never called."""
    return ShardedParameters({"weight": Shard(0)})


def head_sharded_qk_norm() -> ParallelStyle:
    """Per-head RMSNorm on q or k laid out [T, heads, head_dim] with heads sharded."""
    return ReplicatedParallel(Shard(1))


def attention_plan(
    prefix: str = "self_attn",
    q: str = "q_proj",
    k: str = "k_proj",
    v: str = "v_proj",
    o: str = "o_proj",
    qk_norm: tuple[str, str] | None = None,
    sinks: str | None = None,
) -> dict[str, ParallelStyle]:
    """Heads sharded: q/k/v column-parallel, o row-parallel, optional per-head q/k norms replicated.

    sinks: the name of a per-head parameter [H] of the attention module itself (GPT-OSS's
    attention sinks), sharded with the q heads; the forward reads it through `local_tensor`.
    """
    plan = {
        f"{prefix}.{q}": colwise(),
        f"{prefix}.{k}": colwise(),
        f"{prefix}.{v}": colwise(),
        f"{prefix}.{o}": rowwise(),
    }
    if qk_norm is not None:
        for name in qk_norm:
            plan[f"{prefix}.{name}"] = head_sharded_qk_norm()
    if sinks is not None:
        plan[prefix] = ShardedParameters({sinks: Shard(0)})
    return plan


def swiglu_plan(
    prefix: str = "mlp", gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
) -> dict[str, ParallelStyle]:
    """Intermediate dimension sharded: gate/up column-parallel, down row-parallel."""
    return {f"{prefix}.{gate}": colwise(), f"{prefix}.{up}": colwise(), f"{prefix}.{down}": rowwise()}


def _plan_matches(module: nn.Module, plan: Mapping[str, ParallelStyle]) -> list[tuple[str, ParallelStyle]]:
    """(submodule name, style) for every submodule each plan key names; a key that matches nothing
    is an error."""
    names = [name for name, _ in module.named_modules() if name]
    out = []
    for pattern, style in plan.items():
        if any(ch in pattern for ch in "*?["):
            parts = pattern.split(".")
            matches = [n for n in names if len(n.split(".")) == len(parts) and fnmatch.fnmatchcase(n, pattern)]
        else:
            matches = [pattern] if pattern in names else []
        if not matches:
            raise KeyError(f"tensor-parallel plan entry {pattern!r} matches no submodule of {type(module).__name__}")
        out.extend((name, style) for name in matches)
    return out


def apply_tp_plan(module: nn.Module, tp_mesh, plan: Mapping[str, ParallelStyle]) -> nn.Module:
    """Apply each style to the submodule(s) its key names; a key that matches nothing is an error."""
    for name, style in _plan_matches(module, plan):
        style._apply(module.get_submodule(name), tp_mesh)
    return module


def _whole_scale_blocks_per_rank(fmt, in_features: int, tp: int) -> bool:
    """Whether splitting a quantized weight's storage on its input dim over `tp` ranks (DTensor's
    Shard: chunks of ceil(n / tp), data and scale each) starts every rank's columns on the scale
    block its scale shard starts with."""
    if fmt.column_block is None:  # a scale per row (or tensor) covers every column: replicated
        return True
    data_columns, scale_columns = fmt.data_columns(in_features), fmt.scale_columns(in_features)
    inputs_per_byte = in_features // data_columns
    data_chunk, scale_chunk = math.ceil(data_columns / tp), math.ceil(scale_columns / tp)
    for rank in range(1, tp):
        first_input = min(rank * data_chunk, data_columns) * inputs_per_byte
        first_block = min(rank * scale_chunk, scale_columns)
        if first_input != min(first_block * fmt.column_block, in_features):
            return False
    return True


def require_whole_scale_blocks(module: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, prefix: str = "") -> None:
    """Refuse a plan that splits a quantized weight (archon.quant) through its scale blocks: a
    row-parallel linear shards the weight's input features, and each rank must hold the scales of
    exactly its columns. Column-parallel linears split rows, which the storage allows anywhere.
    `prefix`: `module`'s name in the model, for the error."""
    for name, style in _plan_matches(module, plan):
        sub = module.get_submodule(name)
        if not isinstance(style, _LinearParallel) or style.param_placements["weight"] != Shard(1):
            continue
        info = sub._quantized.get("weight") if isinstance(sub, QuantizedWeights) else None
        if info is None:
            continue
        in_features, block = info.rows_shape[-1], info.fmt.column_block
        if not _whole_scale_blocks_per_rank(info.fmt, in_features, tp):
            raise ValueError(
                f"{prefix}{name}: tensor parallelism (tp={tp}) splits its {in_features} input features inside a "
                f"block of {block} columns that shares one scale ({info.fmt}); keep the weight quantized with a tp "
                f"for which {in_features} is a multiple of tp x {block}, or load the base dequantized "
                "(model.quantized_base='dequantize')"
            )


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (autograd-aware), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def reduce_partial_grads(model: nn.Module) -> None:
    """Make each DTensor parameter's gradient take the parameter's own layout.

    Replicated parameters that act on sharded activations (LoRA A of a column-parallel linear,
    LoRA B of a row-parallel one, per-head norms) receive Partial gradients; this sums them across
    the tensor-parallel group. FSDP2 does the same for the parameters it manages.
    """
    for param in model.parameters():
        grad = param.grad
        if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
            param.grad = grad.redistribute(param.device_mesh, param.placements)


__all__ = [
    "ColwiseLoRAParallel",
    "ReplicatedParallel",
    "RowwiseLoRAParallel",
    "ShardedParameters",
    "apply_tp_plan",
    "attention_plan",
    "colwise",
    "head_sharded_qk_norm",
    "local_tensor",
    "reduce_partial_grads",
    "require_whole_scale_blocks",
    "rowwise",
    "swiglu_plan",
    "vocab_parallel_embedding",
    "vocab_parallel_head",
]
