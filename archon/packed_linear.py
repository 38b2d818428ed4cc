"""fp32 linears on oneDNN-prepacked weights, for generation on the CPU.

At the few rows of a decode step (one per sequence), PyTorch's fp32 `F.linear` on the CPU is
slower than oneDNN's linear on a weight reordered once into oneDNN's blocked layout (at one row
it is not, and `linear` keeps F.linear there). The built-in engine on packed weights against the
same engine on F.linear: docs/performance.md, "Prepacked linears" (`benchmarks/rollout.py
--engines native native_unpacked`).

`PackedWeights` holds the packed copies of a model's weights. Inside `packs.active()`, on that
thread only, `linear` computes with them. The linears that go through it: `Linear` (what
`archon.lora.linear` builds where LoRA does not reach), the base of `LoRALinear` and
`MultiLoRALinear`, and the output head; a few plain nn.Linear layers (Mamba2's out_proj, the MTP
projection, DeepSeek-V3.2's indexer) compute with F.linear.

A weight is packed on its first use and the copy is used while the weight is unchanged: the same
tensor, storage and version counter (an in-place write, such as a LoRA merge or a `copy_` under
no_grad, moves the counter; a write through `.data` does not: call `clear()` after one). Only
frozen weights are packed (`requires_grad` False: the base of a LoRA run, an inference model), of
at least MIN_PACKED_ELEMENTS elements, and only plain fp32 CPU tensors: a smaller weight (all of
the demo's), a DTensor shard, a float64 equality run, bf16 or a quantized weight computes with
`F.linear` as before, as does every other thread (a trainer's forward while a producer generates).

The copies cost a second copy of the weights they pack.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

_scope = threading.local()
"""`packs`: the PackedWeights active on this thread, if any."""

_PLAIN = (torch.Tensor, nn.Parameter)


def packing_supported(device: torch.device | str) -> bool:
    """Whether linears on `device` can run on prepacked weights (the CPU, with oneDNN)."""
    return (
        torch.device(device).type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


MIN_PACKED_ELEMENTS = 1 << 17
"""The smallest weight packed. oneDNN's call costs more than F.linear's (35-50 us against 10-30 at
[128, 128] to [384, 128], 2 threads): for smaller weights that overhead outweighs the faster
product. Measured 2026-12-07 on a 2-core AMD EPYC at 2 to 256 rows: packed / F.linear 0.23-0.8x
at 16K-49K elements (the demo's model), 0.52-1.0x at 64K, 0.84-1.2x at 128K-196K, 1.06-1.9x at
256K and up."""


class PackedWeights:
    """Packed copies of the frozen fp32 CPU weights of at least `min_elements` elements that
    `linear` meets inside `active()`."""

    def __init__(self, min_elements: int = MIN_PACKED_ELEMENTS) -> None:
        self.min_elements = min_elements
        # id(weight) -> (weakref to it, its data_ptr, its version counter, the packed copy)
        self._packed: dict[int, tuple[weakref.ref, int, int, torch.Tensor]] = {}

    def __len__(self) -> int:
        return len(self._packed)

    def clear(self) -> None:
        self._packed.clear()

    @contextlib.contextmanager
    def active(self) -> Iterator[PackedWeights]:
        """`linear` computes with these packs on this thread until the block ends."""
        outer = getattr(_scope, "packs", None)
        _scope.packs = self
        try:
            yield self
        finally:
            _scope.packs = outer

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of `weight` [out, in], made now if it has none or it changed since."""
        key = id(weight)
        entry = self._packed.get(key)
        if entry is not None:
            ref, data_ptr, version, packed = entry
            if ref() is weight and data_ptr == weight.data_ptr() and version == weight._version:
                return packed
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 32)  # 32: the rows it is tuned for
        packs = self._packed
        ref = weakref.ref(weight, lambda _, k=key: packs.pop(k, None))  # a freed weight frees its copy
        packs[key] = (ref, weight.data_ptr(), weight._version, packed)
        return packed


def _packable(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, min_elements: int) -> bool:
    return (
        type(weight) in _PLAIN
        and weight.numel() >= min_elements
        and type(x) in _PLAIN
        and not weight.requires_grad
        and not weight.is_inference()  # no version counter to tell a write by
        and weight.dtype == torch.float32
        and x.dtype == torch.float32
        and weight.dim() == 2
        and weight.device.type == "cpu"
        and x.device.type == "cpu"
        and x.numel() >= 2 * x.shape[-1]  # at one row F.linear is faster
        and (bias is None or (type(bias) in _PLAIN and bias.dtype == torch.float32 and not bias.requires_grad))
        and not (torch.is_grad_enabled() and x.requires_grad)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x [..., in], weight [out, in], bias [out]) -> [..., out]; inside a
    `PackedWeights.active()` block on this thread, on the weight's packed copy when it has one
    (see the module docstring)."""
    packs = getattr(_scope, "packs", None)
    if packs is None or not _packable(x, weight, bias, packs.min_elements):
        return F.linear(x, weight, bias)
    x2 = x.reshape(-1, x.shape[-1])  # [N, in]
    out = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), packs.packed(weight), bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


class Linear(nn.Linear):
    """nn.Linear whose product goes through `linear` (prepacked during generation on the CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
