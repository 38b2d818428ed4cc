"""Grouped-GEMM experts: one grouped matmul per projection (base and LoRA factors) over rows sorted by
expert, equal to the loop over experts, with no host sync in forward or backward, for every MoE family."""

import pytest
import torch
import torch.nn.functional as F

from archon.grouped_mm import ExpertGroups, expert_matmul
from archon.lora import LoRAConfig
from archon.models.common.moe import GroupedExperts

MOE_FAMILIES = ("qwen3_moe", "glm4_moe", "deepseek_v3", "gpt_oss", "qwen3_5_moe_text")


@pytest.mark.parametrize("in_features, out_features", [(8, 12), (5, 3), (2, 8)])
def test_expert_matmul_matches_per_expert_matmuls(in_features, out_features):
    """Sizes whose rows are not 16-byte aligned are padded; experts with no rows get no rows."""
    g = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 1, 0, 4]
    expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
    x = torch.randn(sum(counts), in_features, generator=g, requires_grad=True)
    weight = torch.randn(len(counts), out_features, in_features, generator=g, requires_grad=True)
    groups = ExpertGroups.from_sorted(expert_of_row, len(counts), grouped=True)

    out = expert_matmul(x, weight.transpose(1, 2), groups)
    expected = torch.stack([x[i] @ weight[e].t() for i, e in enumerate(expert_of_row.tolist())])
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)

    grad_out = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad(out, (x, weight), grad_out)
    expected_grads = torch.autograd.grad(expected, (x, weight), grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert grads[1][1].abs().max() == 0 and grads[1][4].abs().max() == 0  # experts without rows


def _set_grouped(model, grouped: bool) -> None:
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.grouped_mm = grouped


def _forward_backward(model, batch, monkeypatch=None):
    """Hidden states and gradients; with monkeypatch, the whole backward pass runs without host sync."""
    tokens, positions, cu_seqlens, max_seqlen = batch
    model.zero_grad(set_to_none=True)
    hidden = model(tokens, positions, cu_seqlens, max_seqlen)
    loss = hidden.pow(2).mean()
    if monkeypatch is None:
        loss.backward()
    else:
        with monkeypatch.context() as patch:
            _no_host_sync(patch)
            loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


def _no_host_sync(monkeypatch):
    """Make every .tolist() / .item() on a tensor fail while the experts run."""

    def refuse(*_args, **_kwargs):
        raise AssertionError("host sync in the experts")

    monkeypatch.setattr(torch.Tensor, "tolist", refuse)
    monkeypatch.setattr(torch.Tensor, "item", refuse)


@pytest.mark.parametrize("rank", [8, 2])  # rank 2: the LoRA factors' rows need padding to 16 bytes
@pytest.mark.parametrize("model_type", MOE_FAMILIES)
def test_grouped_experts_match_loop(model_type, rank, tiny_checkpoint, lora_model, monkeypatch):
    model = lora_model(tiny_checkpoint(model_type), LoRAConfig(rank=rank, alpha=16.0)).model
    experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
    assert experts and all(m.gate_up_proj_lora is not None for m in experts)
    g = torch.Generator().manual_seed(1)
    lens = [7, 1, 13]
    batch = (
        torch.randint(0, model.args.vocab_size, (sum(lens),), generator=g),
        torch.cat([torch.arange(n) for n in lens]),
        torch.tensor([0, 7, 8, 21], dtype=torch.int32),
        13,
    )
    _set_grouped(model, False)
    loop_hidden, loop_grads = _forward_backward(model, batch)

    _set_grouped(model, True)
    calls = []
    grouped_mm = F.grouped_mm
    monkeypatch.setattr(F, "grouped_mm", lambda *a, **k: calls.append(1) or grouped_mm(*a, **k))
    for module in experts:  # the router's top-k and the decoder around it are not under test
        monkeypatch.setattr(module, "forward", _guarded(module.forward, monkeypatch))
    hidden, grads = _forward_backward(model, batch, monkeypatch)

    assert len(calls) == 6 * len(experts)  # gate_up and down: base, x @ A, then @ B
    torch.testing.assert_close(hidden, loop_hidden, rtol=1e-5, atol=1e-5)
    assert grads.keys() == loop_grads.keys()
    assert any(".experts.gate_up_proj_lora." in name for name in grads)
    for name, grad in grads.items():
        scale = loop_grads[name].abs().max().clamp_min(1e-12)
        # 1e-4: the gradient contract against PEFT; the padded rank-2 factors sum in another order.
        assert (grad - loop_grads[name]).abs().max() / scale <= 1e-4, name


def _guarded(forward, monkeypatch):
    """forward, with host syncs refused while it runs."""

    def run(*args):
        with monkeypatch.context() as patch:
            _no_host_sync(patch)
            return forward(*args)

    return run


def test_grouped_mm_availability_is_explained():
    from archon.grouped_mm import grouped_mm_unavailable

    assert grouped_mm_unavailable(torch.device("cpu"), torch.float32) is None
    assert "'hpu'" in grouped_mm_unavailable(torch.device("hpu"), torch.bfloat16)

    compiled = torch.compile(lambda x: grouped_mm_unavailable(x.device, x.dtype) or "", backend="eager")
    assert "bf16 only" in compiled(torch.zeros(1))


def test_loop_path_where_grouped_mm_is_unavailable(monkeypatch, caplog):
    """Without grouped GEMM the experts loop over experts (one host read of the offsets per layer),
    say why once, and give the grouped result."""
    import archon.grouped_mm as grouped_mm

    torch.manual_seed(0)
    experts = GroupedExperts(6, 8, 12, LoRAConfig(rank=4, alpha=8.0))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(10, 8)
    top_indices = torch.stack([torch.randperm(6)[:2] for _ in range(10)])
    top_weights = torch.rand(10, 2)
    grouped = experts(x, top_weights, top_indices)

    monkeypatch.setattr(grouped_mm, "_grouped_mm_unavailable", lambda device_type, capability: "no kernel here")
    monkeypatch.setattr(F, "grouped_mm", None)  # must not be called
    with caplog.at_level("WARNING", logger="archon.grouped_mm"):
        looped = experts(x, top_weights, top_indices)
        experts(x, top_weights, top_indices)
    torch.testing.assert_close(looped, grouped, rtol=1e-6, atol=1e-6)
    assert [r.getMessage() for r in caplog.records] == ["MoE experts run as a loop over experts: no kernel here"]
