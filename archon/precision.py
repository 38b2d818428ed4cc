"""Float64 runs of code written for float32: the arithmetic that equality tests compare in.

A test whose claim is "the same math gives the same numbers" (a layout against one process, a kept
cache against a re-prefill, a resume against an uninterrupted run) runs both sides in float64 inside
`fp32_islands_in_fp64`, so what is left between them is float64 rounding (about 1e-14 on the tiny
models) and no CPU's vector width, AMX tiles or thread count can move it past 1e-9.
"""

from __future__ import annotations

import contextlib

import torch


def _fp64_for_fp32(value):
    return torch.float64 if value is torch.float32 else value


@contextlib.contextmanager
def fp32_islands_in_fp64():
    """While active, fp64 tensors are not cast down to fp32: `t.float()`, `t.to(torch.float32, ...)`,
    `t.type(torch.float32)` and `softmax(..., dtype=torch.float32)` of an fp64 tensor stay fp64.

    Both HF's modeling code and archon's compute some steps in fp32 whatever the model dtype (RMSNorm
    statistics, attention softmax, the recurrence of linear attention). In an fp64 comparison those
    islands would round each side differently and bound the agreement at fp32 precision; with them
    kept in fp64 the two sides compute the same math in fp64, and any difference above fp64 rounding
    is a difference of the math."""
    tensor_to, tensor_float, tensor_type = torch.Tensor.to, torch.Tensor.float, torch.Tensor.type
    softmax, torch_softmax, tensor_softmax = torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(_fp64_for_fp32(a) for a in args)
            kwargs = {k: _fp64_for_fp32(v) for k, v in kwargs.items()}
        return tensor_to(self, *args, **kwargs)

    def to_type(self, *args, **kwargs):
        if self.dtype == torch.float64 and (args or kwargs):
            args = tuple(_fp64_for_fp32(a) for a in args)
            kwargs = {k: _fp64_for_fp32(v) for k, v in kwargs.items()}
        return tensor_type(self, *args, **kwargs)

    def to_float(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else tensor_float(self, *args, **kwargs)

    def keeping_fp64(function):
        def wrapped(input, *args, **kwargs):
            if input.dtype == torch.float64:
                args = tuple(_fp64_for_fp32(a) for a in args)
                kwargs = {k: _fp64_for_fp32(v) for k, v in kwargs.items()}
            return function(input, *args, **kwargs)

        return wrapped

    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = to, to_float, to_type
    torch.nn.functional.softmax, torch.softmax = keeping_fp64(softmax), keeping_fp64(torch_softmax)
    torch.Tensor.softmax = keeping_fp64(tensor_softmax)
    try:
        yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = tensor_to, tensor_float, tensor_type
        torch.nn.functional.softmax, torch.softmax, torch.Tensor.softmax = softmax, torch_softmax, tensor_softmax
