"""One matmul per expert over rows sorted by expert, as a single grouped GEMM (`F.grouped_mm`).

MoE experts and their LoRA factors are stacked weights W[E, in, out]. The token slots routed to them
are sorted by expert, so expert e owns rows offsets[e-1]:offsets[e]. `expert_matmul` multiplies every
expert's rows by its own W[e] in one kernel, forward and backward, with no host sync. Where grouped
GEMM has no kernel (an old torch, an accelerator without one) it loops over the experts instead, and
says why once.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExpertGroups:
    """How rows sorted by expert split among the experts.

    offsets: int32 [E], the end of each expert's rows (the running sum of its row counts).
    expert_of_row: [N], the expert of each row (non-decreasing).
    host_offsets: None for grouped GEMM; for the loop over experts, `offsets` read on the host (once
        per layer, shared by its matmuls).
    """

    offsets: torch.Tensor
    expert_of_row: torch.Tensor
    host_offsets: list[int] | None

    @classmethod
    def from_sorted(cls, expert_of_row: torch.Tensor, num_experts: int, grouped: bool) -> ExpertGroups:
        """expert_of_row: [N] expert ids in non-decreasing order."""
        offsets = torch.bincount(expert_of_row, minlength=num_experts).cumsum(0).to(torch.int32)
        return cls(offsets, expert_of_row, None if grouped else offsets.tolist())


class StackedExperts:
    """What archon knows of a module holding its experts' weights stacked: [E, out, in], or
    [E, in, out] when `input_major`, multiplied with rows sorted by expert through
    `_expert_matmul(x, weight_name, groups)`. The MoE layers of the families implement it; a
    quantized base subclasses them (archon.quant)."""

    input_major = False


def grouped_mm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why grouped GEMM cannot run on `device` in `dtype` (logged once), or None when it can."""
    if torch.compiler.is_compiling() and dtype != torch.bfloat16:
        # torch.compile traces grouped_mm through its meta kernel, which accepts bf16 only.
        return f"under torch.compile, grouped_mm takes bf16 only, not {dtype}"
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    reason = _grouped_mm_unavailable(device.type, capability)
    if reason is not None:
        _log_once(reason)
    return reason


@functools.cache
def _grouped_mm_unavailable(device_type: str, capability: tuple[int, int] | None) -> str | None:
    if not hasattr(F, "grouped_mm"):
        return f"torch {torch.__version__} has no torch.nn.functional.grouped_mm"
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if capability < (8, 0):
            return f"grouped_mm needs CUDA capability 8.0 or newer, this device has {capability}"
        return None
    return f"torch has no grouped_mm kernel for device type {device_type!r}"


@functools.cache
def _log_once(reason: str) -> None:
    log.warning("MoE experts run as a loop over experts: %s", reason)


def expert_matmul(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """x [N, in] (rows sorted by expert) times each row's expert's weight[e] [in, out] -> [N, out].

    `weight` [E, in, out] may be a transposed view of a stacked [E, out, in] weight, or an
    expert-parallel DTensor (`local_expert_weight`), whose local experts the groups then index.
    """
    weight = local_expert_weight(weight, x.dtype)
    if groups.host_offsets is not None:
        return _looped_matmul(x, weight, groups.host_offsets)
    if x.dtype == torch.float64:  # grouped GEMM has no fp64 kernel (fp64 runs check alignment with HF)
        return _looped_matmul(x, weight, groups.offsets.tolist())
    # Grouped GEMM wants every matrix's leading stride to be a multiple of 16 bytes. Zero padding of
    # the contraction dimension leaves the product unchanged; padded output columns are cut off.
    align = 16 // x.element_size()
    in_features, out_features = weight.shape[1:]
    pad_in, pad_out = -in_features % align, -out_features % align
    if pad_in:
        x = F.pad(x, (0, pad_in))
        weight = F.pad(weight, (0, 0, 0, pad_in))
    if pad_out:
        weight = F.pad(weight, (0, pad_out))
    out = F.grouped_mm(x.contiguous(), weight, offs=groups.offsets)
    return out[:, :out_features] if pad_out else out


def local_part(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (autograd-aware), for a computation on local tensors; a plain
    tensor unchanged. Over the mesh dimensions where `t` is replicated, each rank's computation saw
    only its own part of the work (its tokens, its shard of the other operand), so the gradient
    leaves as a partial sum there, which `archon.parallel.reduce_partial_grads` (for parameters) or
    the DTensor layer (for activations) sums."""
    if not isinstance(t, DTensor):
        return t
    return t.to_local(grad_placements=[Partial() if p.is_replicate() else p for p in t.placements])


def local_expert_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """This rank's experts of an expert-parallel weight (a DTensor sharded over `ep` and replicated
    over the data-parallel ranks that hold the same experts) in `dtype`, the dtype of the activations
    it meets; a plain weight unchanged.

    The replicas saw other tokens, so over their mesh dimensions the gradient is a partial sum
    (`local_part`); `archon.parallel.reduce_partial_grads` sums it once after the backward passes.
    FSDP2 leaves expert-parallel weights alone, so its mixed-precision cast
    (`ParallelConfig.param_dtype`, which also casts the activations) happens here; the gradient
    comes back in the weight's own dtype."""
    if not isinstance(weight, DTensor):
        return weight
    return local_part(weight).to(dtype)


def _looped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: list[int]) -> torch.Tensor:
    """Reference path: one matmul per expert. `split` (not slicing) so that the backward pass
    concatenates the row gradients once instead of adding one full-size gradient per expert."""
    counts = [end - start for start, end in zip([0, *offsets[:-1]], offsets)]
    chunks = x[: offsets[-1]].split(counts)
    return torch.cat([chunk @ weight[expert] for expert, chunk in enumerate(chunks)], dim=0)
