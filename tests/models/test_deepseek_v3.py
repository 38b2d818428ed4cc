"""DeepSeek-V3 / Kimi K2 (deepseek_v3) against HF transformers and PEFT: MLA with and without the
query bottleneck (q_lora_rank), interleaved or half-split RoPE, YaRN whose mscale_all_dim scales the
softmax, dense first layers, group-limited sigmoid routing, shared experts, and LoRA on the MLA
projections, dense MLP, shared experts and experts."""

import json

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)

from archon.build import build_model
from archon.lora import LoRAConfig
from archon.lora.peft import ADAPTER_CONFIG, save_peft_adapter
from archon.tools.align import packed_batch

MODEL_TYPE = "deepseek_v3"

CASES = {
    # The registered tiny config: q_lora_rank 32, kv_lora_rank 24, nope 16 + rope 8, v 12;
    # interleaved YaRN (factor 4, mscale 1, mscale_all_dim 0.8); 4 groups of 2 experts, 2 groups
    # allowed, top-3, routed_scaling_factor 2.5; one dense layer.
    "q-lora-interleaved-yarn": {},
    # Kimi-K2-like routing (one group) and no query bottleneck: q_proj straight from the hidden
    # state; half-split plain RoPE; biased kv_a_proj_with_mqa and o_proj; two dense layers, top-2
    # without renormalisation, two shared experts, tied head, rms_norm_eps apart from the latent norms'.
    "no-q-lora-plain-rope-bias": dict(
        q_lora_rank=None,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        attention_bias=True,
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        n_shared_experts=2,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


@pytest.mark.parametrize("case", sorted(CASES))
def test_adapter_targets_name_the_mla_projections(case, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint(MODEL_TYPE, **CASES[case])
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = build_model(path, lora=lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    query = ["q_a_proj", "q_b_proj"] if loaded.args.q_lora_rank else ["q_proj"]
    assert config["target_modules"] == sorted(["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", *query])
    assert sorted(config["target_parameters"]) == [
        "down_proj.weight",
        "gate_proj.weight",
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "up_proj.weight",
    ]


def test_interleave_and_softmax_mscale_change_the_output(tiny_checkpoint):
    """The parity cases would catch a half-split RoPE on interleaved weights or a softmax scale
    without YaRN's mscale: each changes the logits of the tiny model."""
    model = build_model(tiny_checkpoint(MODEL_TYPE)).model.eval()
    attention = [layer.self_attn for layer in model.layers]
    plain_scale = attention[0].qk_head_dim ** -0.5
    assert attention[0].scale == pytest.approx(plain_scale * (0.1 * 0.8 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    _, tokens, positions, cu_seqlens = packed_batch((33, 13), 256, seed=0)

    def logits():
        with torch.no_grad():
            return model(tokens, positions, cu_seqlens, 33)

    reference = logits()
    for attn in attention:
        attn.interleaved = False
    assert (logits() - reference).abs().max() > 1e-3
    for attn in attention:
        attn.interleaved, attn.scale = True, plain_scale
    assert (logits() - reference).abs().max() > 1e-3


@pytest.mark.parametrize(
    "hf_router, n_group, topk_group, top_k, norm",
    [
        ("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", 4, 2, 3, True),
        ("deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter", 8, 3, 4, False),
        ("glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter", 1, 1, 2, True),
        ("glm4_moe.modeling_glm4_moe.Glm4MoeTopkRouter", 2, 1, 4, True),
    ],
)
def test_group_limited_router_matches_hf(hf_router, n_group, topk_group, top_k, norm):
    import importlib

    from transformers import AutoConfig

    from archon.models.common.moe import SigmoidGroupTopKRouter

    module_name, class_name = hf_router.rsplit(".", 1)
    hf_cls = getattr(importlib.import_module(f"transformers.models.{module_name}"), class_name)
    config = AutoConfig.for_model(
        module_name.split(".")[0],
        hidden_size=32,
        n_routed_experts=16,
        num_experts_per_tok=top_k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=2.0,
    )
    g = torch.Generator().manual_seed(0)
    hf = hf_cls(config)
    ours = SigmoidGroupTopKRouter(32, 16, top_k, n_group, topk_group, norm, 2.0)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(16, 32, generator=g) / 32**0.5)
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.1)
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
        x = torch.randn(64, 32, generator=g)
        _, hf_weights, hf_indices = hf(x)
        weights, indices = ours(x)
    hf_order, order = hf_indices.argsort(dim=-1), indices.argsort(dim=-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order), rtol=0, atol=1e-6)


def test_score_correction_bias_stays_fp32_in_a_bf16_model(tiny_checkpoint):
    model = build_model(tiny_checkpoint(MODEL_TYPE), dtype=torch.bfloat16).model
    router = model.layers[1].mlp.gate
    assert router.weight.dtype == torch.bfloat16
    assert router.e_score_correction_bias.dtype == torch.float32
    expected = build_model(tiny_checkpoint(MODEL_TYPE)).model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(router.e_score_correction_bias, expected)


def test_generation_with_kv_cache_equals_full_forward(tiny_checkpoint):
    """MLA keeps its expanded keys/values in the rollout KV cache: greedy tokens and log-probs equal
    those of step-by-step full forwards."""
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    model = build_model(tiny_checkpoint(MODEL_TYPE, q_lora_rank=None)).model.eval()
    prompts = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106]]
    samples = NativeRolloutEngine(model).generate(prompts, SamplingParams(max_new_tokens=5, temperature=0))
    with torch.no_grad():
        for sample in samples:
            ids = list(sample.prompt_ids)
            for token, logprob in zip(sample.completion_ids, sample.logprobs):
                seq = torch.tensor(ids)
                logits = model(seq, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))[-1]
                assert token == int(logits.argmax())
                assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
                ids.append(token)


def test_missing_latent_rank_is_refused():
    from transformers import AutoConfig

    from archon.models.deepseek_v3.args import DeepseekV3Args

    config = AutoConfig.for_model(MODEL_TYPE, hidden_size=64, kv_lora_rank=0)
    with pytest.raises(ValueError, match="config.kv_lora_rank=0"):
        DeepseekV3Args.from_hf_config(config)


def test_flash_path_gets_one_head_size(tiny_checkpoint, monkeypatch):
    """On CUDA, packed attention runs torch's varlen flash kernel, which takes one head size for q, k
    and v. MLA's values (12) are narrower than its queries/keys (24): a stand-in kernel that
    enforces that contract must give the same logits as the CPU path."""
    import torch.nn.attention.varlen as varlen
    import torch.nn.functional as F

    import archon.models.common.attention as attention

    calls = []

    def one_head_size_kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale, window_size, enable_gqa):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], (q.shape, k.shape, v.shape)
        calls.append(v.shape)
        bounds = cu_q.tolist()
        return torch.cat(
            [
                F.scaled_dot_product_attention(
                    *(t[s:e].transpose(0, 1) for t in (q, k, v)), is_causal=True, scale=scale
                ).transpose(0, 1)
                for s, e in zip(bounds[:-1], bounds[1:])
            ]
        )

    model = build_model(tiny_checkpoint(MODEL_TYPE)).model.eval()
    _, tokens, positions, cu_seqlens = packed_batch((7, 1, 13), 256, seed=0)
    with torch.no_grad():
        reference = model(tokens, positions, cu_seqlens, 13)
        monkeypatch.setattr(attention, "_flash_varlen_usable", lambda q: True)
        monkeypatch.setattr(varlen, "varlen_attn", one_head_size_kernel)
        flash = model(tokens, positions, cu_seqlens, 13)
    assert len(calls) == 3 and calls[0][-1] == 24
    torch.testing.assert_close(flash, reference, rtol=0, atol=1e-5)
