"""LoRA layers against PEFT, and the whole-model LoRA utilities."""

import pytest
import torch
from helpers import randomise_lora
from torch import nn

from archon.build import build_model
from archon.lora import (
    LoRAConfig,
    LoRALinear,
    adapter_disabled,
    lora_parameters,
    mark_only_lora_trainable,
    merge_lora,
    unmerge_lora,
)


@pytest.mark.parametrize("use_rslora,bias", [(False, False), (True, True)])
def test_lora_linear_matches_peft_forward_and_backward(use_rslora, bias):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(24, 40, bias=bias))
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=12, target_modules=["0"], use_rslora=use_rslora))
    peft_layer = peft_model.base_model.model[0]
    with torch.no_grad():
        peft_layer.lora_B["default"].weight.normal_()

    ours = LoRALinear(24, 40, bias, LoRAConfig(rank=4, alpha=12, use_rslora=use_rslora))
    with torch.no_grad():
        ours.weight.copy_(peft_layer.base_layer.weight)
        if bias:
            ours.bias.copy_(peft_layer.base_layer.bias)
        ours.lora_a.weight.copy_(peft_layer.lora_A["default"].weight)
        ours.lora_b.weight.copy_(peft_layer.lora_B["default"].weight)
    assert ours.scaling == peft_layer.scaling["default"]

    x = torch.randn(5, 24)
    y_ours, y_peft = ours(x), peft_model(x)
    torch.testing.assert_close(y_ours, y_peft, rtol=1e-6, atol=1e-6)
    grad_out = torch.randn_like(y_ours)
    y_ours.backward(grad_out)
    y_peft.backward(grad_out)
    torch.testing.assert_close(ours.lora_a.weight.grad, peft_layer.lora_A["default"].weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.lora_b.weight.grad, peft_layer.lora_B["default"].weight.grad, rtol=1e-5, atol=1e-6)


def test_lora_init_matches_peft_distribution():
    """A kaiming-uniform(a=sqrt(5)) bounded by 1/sqrt(in), B zeros: the same init PEFT uses."""
    layer = LoRALinear(64, 32, False, LoRAConfig(rank=8))
    assert layer.lora_a.weight.abs().max() <= 1 / 64**0.5
    assert layer.lora_a.weight.abs().max() > 0.5 / 64**0.5
    assert torch.count_nonzero(layer.lora_b.weight) == 0


def test_dropout_acts_on_lora_input_only():
    torch.manual_seed(0)
    layer = LoRALinear(16, 16, False, LoRAConfig(rank=4, dropout=0.5)).train()
    with torch.no_grad():
        layer.lora_b.weight.normal_()
    x = torch.randn(3, 16)
    base = x @ layer.weight.t()
    a, b = layer(x), layer(x)
    assert not torch.allclose(a, b)  # dropout is live in training mode
    layer.eval()
    expected = base + (x @ layer.lora_a.weight.t() @ layer.lora_b.weight.t()) * layer.scaling
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_meta_build_materialises_everything_and_freezes_base(tiny_checkpoint, model_type):
    path = tiny_checkpoint(model_type)
    loaded = build_model(path, lora=LoRAConfig(rank=4, alpha=8))
    model = loaded.model
    for name, param in model.named_parameters():
        assert param.device.type == "cpu", name
        assert torch.isfinite(param).all(), name
        assert param.requires_grad == ("lora_a" in name or "lora_b" in name), name
    lora = lora_parameters(model)
    assert lora and all(p.dtype == torch.float32 for p in lora.values())
    assert all(
        torch.count_nonzero(p) == 0 for n, p in lora.items() if n.endswith("lora_b.weight") or n.endswith(".lora_b")
    )
    if model_type == "qwen3_moe":
        assert any("experts.gate_up_proj_lora" in n for n in lora)
    assert mark_only_lora_trainable(model) == sum(p.numel() for p in lora.values())


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_merge_unmerge_restores_bit_exactly_and_disable_gives_base(tiny_checkpoint, model_type):
    from archon.tools.align import packed_batch

    path = tiny_checkpoint(model_type)
    base_model = build_model(path).model.eval()
    model = build_model(path, lora=LoRAConfig(rank=4, alpha=8)).model.eval()
    randomise_lora(lora_parameters(model), 0.1)
    _, tokens, positions, cu = packed_batch((5, 8), 256, seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        with_lora = model(tokens, positions, cu, 8)
        merge_lora(model)
        merged = model(tokens, positions, cu, 8)
        unmerge_lora(model)
        with adapter_disabled(model):
            disabled = model(tokens, positions, cu, 8)
        base = base_model(tokens, positions, cu, 8)
        again = model(tokens, positions, cu, 8)
    for name, param in model.named_parameters():
        assert torch.equal(param, before[name]), name
    torch.testing.assert_close(merged, with_lora, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(disabled, base, rtol=0, atol=0)
    torch.testing.assert_close(again, with_lora, rtol=0, atol=0)
    assert (with_lora - base).abs().max() > 1e-3
