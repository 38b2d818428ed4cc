"""LoRALinear's training path on a frozen base (the low-rank terms folded into the GEMMs, no base
weight gradient) gives the output and gradients of the plain composition x W^T + b + s B(A(x))."""

import pytest
import torch
import torch.nn.functional as F

from archon.lora import LoRAConfig, LoRALinear


def _reference(layer: LoRALinear, x: torch.Tensor) -> torch.Tensor:
    out = F.linear(x, layer.weight, layer.bias)
    low_rank = F.linear(F.linear(x.to(layer.lora_a.weight.dtype), layer.lora_a.weight), layer.lora_b.weight)
    return out + (low_rank * layer.scaling).to(out.dtype)


@pytest.mark.parametrize("base_dtype, tolerance", [(torch.float32, 1e-6), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
def test_frozen_base_lora_matches_plain_composition(base_dtype, tolerance, bias):
    torch.manual_seed(0)
    layer = LoRALinear(24, 40, bias=bias, lora=LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        layer.lora_b.weight.normal_(0, 0.5)
    layer.weight.requires_grad_(False)
    if bias:
        layer.bias.requires_grad_(False)
    layer.weight.data = layer.weight.data.to(base_dtype)  # LoRA factors stay fp32, as build_model keeps them
    if bias:
        layer.bias.data = layer.bias.data.to(base_dtype)
    x = torch.randn(3, 5, 24, dtype=base_dtype, requires_grad=True)
    grad_out = torch.randn(3, 5, 40, dtype=base_dtype)

    results = []
    for forward in (layer, lambda inp: _reference(layer, inp)):
        out = forward(x)
        params = (x, layer.lora_a.weight, layer.lora_b.weight)
        results.append((out, *torch.autograd.grad(out, params, grad_out)))
    assert results[0][0].dtype == base_dtype and results[0][0].shape == (3, 5, 40)
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    assert layer.weight.grad is None


def test_frozen_base_lora_makes_no_elementwise_pass_over_the_output():
    """Scaling and adding the low-rank term ride in the GEMMs: no mul/add runs on an [N, out] tensor
    in the forward or backward (the unfused form runs several)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = LoRALinear(32, 48, bias=False, lora=LoRAConfig(rank=4, alpha=8.0))
    layer.weight.requires_grad_(False)
    x = torch.randn(16, 32, requires_grad=True)
    grad_out = torch.randn(16, 48)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        layer(x).backward(grad_out)
    elementwise = ("aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::div")
    over_output = [e.name for e in prof.events() if e.name in elementwise and [16, 48] in e.input_shapes]
    assert over_output == []
    assert layer.weight.grad is None and layer.lora_a.weight.grad is not None
