"""Sync payloads and the bucketed broadcast, without a rollout server.

The merged and full payloads are checked against the merged HF export (itself checked against
PEFT-merged HF logits in test_peft_export.py); the buckets go over a real gloo group between two
threads."""

import threading

import pytest
import torch
from safetensors.torch import load_file

from archon.build import build_model
from archon.lora import LoRAConfig
from archon.lora.peft import save_merged_hf
from archon.sync import (
    StatelessGroup,
    full_payload,
    merged_payload,
    receive_tensors,
    send_tensors,
)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _broadcast(named_tensors, bucket_bytes: int) -> tuple[dict, list]:
    """Rank 0 sends in one thread, rank 1 receives in another; returns (send stats, received)."""
    port = _free_port()
    received, errors = [], []

    def receiver() -> None:
        try:
            group = StatelessGroup("127.0.0.1", port, 1, 2, "gloo", timeout_s=60)
            received.extend((name, t.clone()) for name, t in receive_tensors(group))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    thread = threading.Thread(target=receiver)
    thread.start()
    group = StatelessGroup("127.0.0.1", port, 0, 2, "gloo", timeout_s=60)
    stats = send_tensors(group, named_tensors, bucket_bytes)
    thread.join(timeout=60)
    if errors:
        raise errors[0]
    return stats, received


def test_buckets_carry_every_tensor_whole_in_order():
    g = torch.Generator().manual_seed(0)
    tensors = {
        "big": torch.randn(40, 33, generator=g),  # 5280 bytes: spans several 1 KiB buckets
        "half": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "ids": torch.arange(-3, 9, dtype=torch.int64).reshape(3, 4),
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
        "strided": torch.randn(6, 10, generator=g).t(),  # not contiguous
    }
    stats, received = _broadcast(tensors.items(), bucket_bytes=1024)
    assert [name for name, _ in received] == list(tensors)
    for name, tensor in received:
        assert tensor.dtype == tensors[name].dtype and tensor.shape == tensors[name].shape, name
        assert torch.equal(tensor, tensors[name]), name
    assert stats["tensors"] == len(tensors)
    assert stats["bytes"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert stats["buckets"] >= stats["bytes"] // 1024


@pytest.mark.parametrize(
    "model_type, targets, units, changed_names",
    [
        ("qwen3", ("q_proj", "v_proj", "gate_proj"), ("self_attn", "mlp"), {"q_proj", "v_proj", "gate_proj"}),
        # per-expert HF keys; the router (mlp.gate) stays behind
        ("qwen3_moe", ("o_proj", "experts"), ("self_attn", "mlp.experts"), {"o_proj", "gate_proj", "up_proj", "down_proj"}),
        # shared experts (and the first, dense, layer's MLP) without the routed experts
        ("glm4_moe", ("gate_proj",), ("mlp.shared_experts", "0.mlp"), {"gate_proj"}),
    ],
)
def test_merged_payload_sends_the_modules_holding_lora(tiny_checkpoint, lora_model, tmp_path, model_type, targets, units, changed_names):
    path = tiny_checkpoint(model_type)
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8, target_modules=targets))
    before = {n: p.detach().clone() for n, p in loaded.model.named_parameters()}
    merged_dir = save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict())
    merged = load_file(str(merged_dir / "model.safetensors"))
    original = load_file(str(path / "model.safetensors"))

    payload = dict(merged_payload(loaded.model, loaded.converter))
    # every tensor of each attention / MLP / MoE part that carries LoRA, e.g. k_proj beside q_proj
    expected = {k for k in merged if any(f".{unit}." in k for unit in units)}
    assert set(payload) == expected
    changed = set()
    for key, tensor in payload.items():
        torch.testing.assert_close(tensor, merged[key], rtol=0, atol=1e-6, msg=key)
        if not torch.equal(tensor, original[key]):
            changed.add(key.split(".")[-2] if key.endswith("weight") else key.split(".")[-1])
    assert changed == changed_names
    for name, param in loaded.model.named_parameters():
        assert torch.equal(param, before[name]), f"{name} changed by the merged payload"


def test_full_payload_is_the_merged_checkpoint(tiny_checkpoint, lora_model, tmp_path):
    path = tiny_checkpoint("qwen3")
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8))
    merged = load_file(str(save_merged_hf(loaded.model, loaded.converter, tmp_path / "m", loaded.hf_config.to_dict())
                           / "model.safetensors"))  # fmt: skip
    payload = dict(full_payload(loaded.model, loaded.converter))
    assert set(payload) == set(merged)
    for key, tensor in payload.items():
        torch.testing.assert_close(tensor, merged[key], rtol=0, atol=1e-6, msg=key)
    plain = build_model(path)  # without LoRA: the checkpoint as it is
    original = load_file(str(path / "model.safetensors"))
    sent = dict(full_payload(plain.model, plain.converter))
    assert set(sent) == set(original)
    for key, tensor in sent.items():
        assert torch.equal(tensor, original[key]), key
