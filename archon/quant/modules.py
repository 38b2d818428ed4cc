"""A frozen quantized base in the model: weights stay in their stored format and are dequantized
per GEMM, in the forward and again in the backward, with LoRA on top in the training dtype.

`quantize_base_weights` turns chosen base weights of a (meta-device) model into storage
parameters `<name>_qdata` and `<name>_qscale` (archon.quant.formats); the module's class becomes
its quantized variant, which still answers `module.<name>` with the dequantized weight (so every
reader of the weight keeps working) and runs its GEMMs through `_DequantizedLinear` /
`_DequantizedExpertMatmul`, which keep no dequantized weight between the forward and the backward.

Under tensor parallelism the linear's GEMM takes the DTensor path (the dequantized local shard,
wrapped as a DTensor with the storage's layout, which autograd then keeps for the backward).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from archon.dtensor import full_tensor
from archon.grouped_mm import ExpertGroups, StackedExperts, expert_matmul
from archon.lora.layers import LoRALinear, frozen_base_lora_backward, frozen_base_lora_forward
from archon.quant.formats import QuantFormat, dequantize


@dataclass(frozen=True)
class QuantizedWeight:
    """What a storage pair holds: `rows_shape` [..., out, in] of the whole weight in format `fmt`;
    `transposed` when the module's weight is [..., in, out] (input-major experts); `dtype` of the
    dequantized weight read as `module.<name>`."""

    fmt: QuantFormat
    rows_shape: tuple[int, ...]
    transposed: bool
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The module weight's shape."""
        if self.transposed:
            return (*self.rows_shape[:-2], self.rows_shape[-1], self.rows_shape[-2])
        return self.rows_shape


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class QuantizedWeights:
    """Mixin of a module some of whose base weights are stored quantized (`_quantized`: name ->
    QuantizedWeight)."""

    _quantized: dict[str, QuantizedWeight]

    def share_quantized_weight(self, view: nn.Module, name: str) -> None:
        """Make `view` hold this module's quantized weight `name` (see `share_quantized_weight`)."""
        share_quantized_weight(self, view, name)

    def __getattr__(self, name: str):
        quantized = self.__dict__.get("_quantized")
        if quantized is not None and name in quantized:
            return self.dequantized(name)
        return super().__getattr__(name)

    def storage(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(data, scale) parameters of quantized weight `name`."""
        return getattr(self, f"{name}_qdata"), getattr(self, f"{name}_qscale")

    def dequantized(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Weight `name` in the module's layout and `dtype` (default: the build dtype). Storage
        sharded as DTensors (FSDP2, TP, EP) gives a DTensor of the same layout."""
        info = self._quantized[name]
        data, scale = self.storage(name)
        weight = dequantize(info.fmt, _local(data), _local(scale), dtype or info.dtype)
        if info.transposed:
            weight = weight.transpose(-1, -2)
        if not isinstance(data, DTensor):
            return weight
        placements = []
        for p in data.placements:
            if isinstance(p, Shard) and info.transposed and p.dim % len(info.rows_shape) >= len(info.rows_shape) - 2:
                p = Shard(2 * len(info.rows_shape) - 3 - p.dim % len(info.rows_shape))
            placements.append(p)
        return DTensor.from_local(
            weight,
            data.device_mesh,
            placements,
            run_check=False,
            shape=torch.Size(info.shape),
            stride=torch.empty(info.shape, device="meta").stride(),
        )

    def merge_lora(self) -> None:
        raise ValueError(
            f"{type(self).__name__}: a quantized base cannot take the adapter in place; merged exports and "
            "merged weight sync add it to a dequantized copy (archon.quant.dense_base_tensors)"
        )


class _GemmWorkspace(threading.local):
    """Per thread, a flat buffer per (device, dtype) that a weight dequantized for one GEMM is written
    into. Only on the CPU: there every fresh allocation of a large weight is mapped in page by page
    on first touch, which costs about as much as dequantizing it (an accelerator's caching allocator
    reuses its blocks). The buffer grows to the largest such weight and is kept."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


_WORKSPACE = _GemmWorkspace()


def _dequantized_for_gemm(
    fmt: QuantFormat, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The weight of storage (data, scale) in `dtype`, for a GEMM that consumes it at once: on the
    CPU, in eager mode, it lives in this thread's workspace and is overwritten by the next one."""
    if data.device.type != "cpu" or torch.compiler.is_compiling():
        return dequantize(fmt, data, scale, dtype)
    shape = (*data.shape[:-1], fmt.in_features(data.shape[-1]))
    numel = math.prod(shape)
    key = (data.device, dtype)
    buffer = _WORKSPACE.buffers.get(key)
    # a buffer made under torch.inference_mode cannot be written outside it
    stale = buffer is not None and buffer.is_inference() and not torch.is_inference_mode_enabled()
    if buffer is None or buffer.numel() < numel or stale:
        buffer = _WORKSPACE.buffers[key] = torch.empty(numel, dtype=dtype, device=data.device)
    return dequantize(fmt, data, scale, dtype, out=buffer[:numel].view(shape))


class _DequantizedLinear(torch.autograd.Function):
    """x W^T + b with W dequantized from its storage in the forward and again in the backward (W is
    frozen: x, and b when it is trained, get gradients), so no dequantized weight outlives its GEMM."""

    @staticmethod
    def forward(ctx, x, data, scale, bias, fmt):
        ctx.save_for_backward(data, scale)
        ctx.fmt = fmt
        return F.linear(x, _dequantized_for_gemm(fmt, data, scale, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        data, scale = ctx.saved_tensors
        grad_x = grad_out @ _dequantized_for_gemm(ctx.fmt, data, scale, grad_out.dtype)
        grad_bias = grad_out.reshape(-1, grad_out.shape[-1]).sum(0) if ctx.needs_input_grad[3] else None
        return grad_x, None, None, grad_bias, None


class _DequantizedExpertMatmul(torch.autograd.Function):
    """Rows x [N, in] sorted by expert times their expert's dequantized weight: [N, out]; this
    rank's experts are dequantized together, in the forward and again in the backward."""

    @staticmethod
    def forward(ctx, x, data, scale, fmt, groups):
        ctx.save_for_backward(data, scale)
        ctx.fmt, ctx.groups = fmt, groups
        weight = _dequantized_for_gemm(fmt, data, scale, x.dtype)  # [E, out, in]
        return expert_matmul(x, weight.transpose(1, 2), groups)

    @staticmethod
    def backward(ctx, grad_out):
        data, scale = ctx.saved_tensors
        weight = _dequantized_for_gemm(ctx.fmt, data, scale, grad_out.dtype)  # [E, out, in]
        return expert_matmul(grad_out, weight, ctx.groups), None, None, None, None


def _quantized_linear(module: QuantizedWeights, x: torch.Tensor) -> torch.Tensor:
    """x W^T + b for a module whose `weight` is quantized."""
    data, scale = module.storage("weight")
    if isinstance(data, DTensor):  # tensor parallel: a DTensor GEMM on the dequantized local shard
        return F.linear(x, module.weight, module.bias)
    return _DequantizedLinear.apply(x, data, scale, module.bias, module._quantized["weight"].fmt)


class QuantizedLinear(QuantizedWeights, nn.Linear):
    """nn.Linear with a quantized frozen weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _quantized_linear(self, x)


class _DequantizedLoRALinear(torch.autograd.Function):
    """y = x W^T + b + s (x A^T) B^T with W dequantized from its storage in the forward and again in
    the backward, W and b frozen, no dropout. The GEMMs are those of LoRALinear's training path
    (archon.lora.layers._FrozenBaseLoRALinear), in the same order, so a kept-quantized base gives
    the numbers of the same base dequantized at load, bit for bit."""

    @staticmethod
    def forward(ctx, x, data, scale, fmt, bias, lora_a, lora_b, scaling):
        x2 = x.reshape(-1, x.shape[-1])  # [N, in]
        weight = _dequantized_for_gemm(fmt, data, scale, x.dtype)
        out, h = frozen_base_lora_forward(x2, weight, bias, lora_a, lora_b, scaling)
        ctx.save_for_backward(x2, data, scale, lora_a, lora_b, h)
        ctx.fmt, ctx.scaling, ctx.x_shape = fmt, scaling, x.shape
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x2, data, scale, lora_a, lora_b, h = ctx.saved_tensors
        need_x, _, _, _, _, need_a, need_b, _ = ctx.needs_input_grad
        grad_x, grad_a, grad_b = frozen_base_lora_backward(
            grad_out,
            x2,
            lambda: _dequantized_for_gemm(ctx.fmt, data, scale, grad_out.dtype),
            lora_a,
            lora_b,
            h,
            ctx.scaling,
            (need_x, need_a, need_b),
        )
        grad_x = None if grad_x is None else grad_x.view(ctx.x_shape)
        return grad_x, None, None, None, None, grad_a, grad_b, None


class QuantizedLoRALinear(QuantizedWeights, LoRALinear):
    """LoRALinear on a quantized frozen weight: y = deq(W) x + b + s B A dropout(x)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        data, scale = self.storage("weight")
        frozen_bias = self.bias is None or not self.bias.requires_grad
        no_dropout = isinstance(self.lora_dropout, nn.Identity) or not self.training
        if self.lora_enabled and frozen_bias and no_dropout and not isinstance(data, DTensor):
            return _DequantizedLoRALinear.apply(
                x,
                data,
                scale,
                self._quantized["weight"].fmt,
                self.bias,
                self.lora_a.weight,
                self.lora_b.weight,
                self.scaling,
            )
        out = _quantized_linear(self, x)
        if not self.lora_enabled:
            return out
        h = self.lora_a(self.lora_dropout(x.to(self.lora_a.weight.dtype)))  # [..., r]
        fused = isinstance(self.lora_dropout, nn.Identity) or not self.training
        if fused and out.dtype == h.dtype:
            # Base and adapter summed in one rounding, as LoRALinear does on a dense frozen base, so
            # a bf16 forward (FSDP2's param_dtype) matches the base dequantized at load.
            out2 = torch.addmm(
                out.reshape(-1, out.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_b.weight.t(), alpha=self.scaling
            )
            return out2.view(*out.shape)
        return out + (self.lora_b(h) * self.scaling).to(out.dtype)


class QuantizedExperts(QuantizedWeights):
    """Mixin of stacked experts whose `gate_up_proj` / `down_proj` are quantized."""

    def _expert_matmul(self, x: torch.Tensor, weight_name: str, groups: ExpertGroups) -> torch.Tensor:
        if weight_name not in self._quantized:
            return super()._expert_matmul(x, weight_name, groups)
        data, scale = (_local(t) for t in self.storage(weight_name))
        return _DequantizedExpertMatmul.apply(x, data, scale, self._quantized[weight_name].fmt, groups)


_QUANTIZED_CLASSES: dict[type, type] = {nn.Linear: QuantizedLinear, LoRALinear: QuantizedLoRALinear}


def quantized_class(cls: type, key: str) -> type:
    """The quantized variant of module class `cls` (made once per class); an error naming the
    parameter `key` for a module that cannot hold a quantized weight."""
    if cls not in _QUANTIZED_CLASSES:
        if issubclass(cls, StackedExperts):
            mixin = QuantizedExperts
        elif issubclass(cls, nn.Linear):  # other linears (a multi-task LoRA linear) dequantize via `weight`
            mixin = QuantizedWeights
        else:
            raise TypeError(
                f"checkpoint stores {key!r} quantized, but archon's {cls.__name__} cannot hold a quantized weight "
                "(linear layers and stacked experts can); load it with model.quantized_base='dequantize'"
            )
        _QUANTIZED_CLASSES[cls] = type(f"Quantized{cls.__name__}", (mixin, cls), {"__doc__": cls.__doc__})
    return _QUANTIZED_CLASSES[cls]


def quantize_base_weights(model: nn.Module, keys: dict[str, QuantFormat], dtype: torch.dtype) -> None:
    """Replace each base parameter `keys` names (archon key -> its checkpoint's format) by empty
    storage parameters, frozen; `dtype` is what reading `module.<name>` dequantizes to."""
    for key, fmt in keys.items():
        path, _, name = key.rpartition(".")
        module = model.get_submodule(path)
        param = module._parameters.get(name)
        if param is None:
            raise KeyError(f"{key!r} is not a parameter of the model")
        cls = type(module) if isinstance(module, QuantizedWeights) else quantized_class(type(module), key)
        transposed = isinstance(module, StackedExperts) and module.input_major and name in ("gate_up_proj", "down_proj")
        shape = tuple(param.shape)
        rows_shape = (*shape[:-2], shape[-1], shape[-2]) if transposed else shape
        if fmt.method == "mxfp4" and rows_shape[-1] % 32:
            raise ValueError(f"{key!r}: mxfp4 needs a multiple of 32 inputs, the model has {rows_shape[-1]}")
        data_shape, scale_shape = fmt.storage_shapes(rows_shape)
        del module._parameters[name]
        for suffix, storage_shape, storage_dtype in (
            ("qdata", data_shape, torch.uint8),
            ("qscale", scale_shape, fmt.scale_dtype()),
        ):
            storage = torch.empty(storage_shape, dtype=storage_dtype, device=param.device)
            module.register_parameter(f"{name}_{suffix}", nn.Parameter(storage, requires_grad=False))
        module.__dict__.setdefault("_quantized", {})[name] = QuantizedWeight(fmt, rows_shape, transposed, dtype)
        module.__class__ = cls


def share_quantized_weight(owner: QuantizedWeights, view: nn.Module, name: str) -> None:
    """Make `view` hold `owner`'s quantized weight `name` (the same storage parameters) in place of
    its own parameter `name`, as a quantized module (a multi-task layer's single-task view)."""
    view._parameters.pop(name, None)
    for suffix in ("qdata", "qscale"):
        view.register_parameter(f"{name}_{suffix}", owner._parameters[f"{name}_{suffix}"])
    view.__dict__.setdefault("_quantized", {})[name] = owner._quantized[name]
    if not isinstance(view, QuantizedWeights):
        view.__class__ = quantized_class(type(view), name)


def quantized_weights(model: nn.Module) -> dict[str, tuple[QuantizedWeights, str]]:
    """archon key of every quantized weight -> (its module, its name there)."""
    out = {}
    for path, module in model.named_modules():
        for name in getattr(module, "_quantized", {}) if isinstance(module, QuantizedWeights) else ():
            out[f"{path}.{name}" if path else name] = (module, name)
    return out


def is_quantized_storage(key: str) -> bool:
    return key.endswith(("_qdata", "_qscale"))


def dense_base_tensors(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of `module`'s parameters, one at a time, each quantized weight's storage pair
    replaced by the weight dequantized in its build dtype (whole: DTensor shards gathered)."""
    for path, sub in module.named_modules(prefix=prefix):
        for name, param in sub.named_parameters(recurse=False):
            if name.endswith("_qscale"):
                continue
            if name.endswith("_qdata"):
                name = name.removesuffix("_qdata")
                info = sub._quantized[name]
                data, scale = (full_tensor(t.detach()) for t in sub.storage(name))
                param = dequantize(info.fmt, data, scale, info.dtype)
                param = param.transpose(-1, -2) if info.transposed else param
            yield f"{path}.{name}" if path else name, param
