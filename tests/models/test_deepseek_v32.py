"""DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) against HF transformers and PEFT: DeepSeek
sparse attention (MLA reading only the lightning indexer's top-k keys per query, the indexer's RoPE
half-split or interleaved, GLM-5's layers that share an earlier layer's selection), interleaved YaRN
MLA, dense and sparse MLP layers, group-limited sigmoid routing, shared experts, and LoRA on the MLA
projections, MLPs, shared experts and experts (the indexer is frozen). The mutation checks of these
features (the gate fails with each switched off) are in tests/models/test_feature_sensitivity.py."""

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

CASES = {
    # The registered tiny configs: q_lora_rank 32, kv_lora_rank 24, nope 16 + rope 8, v 12;
    # interleaved YaRN (factor 4, mscale_all_dim 0.8); an indexer of 16 heads of 16 keeping 4 keys;
    # 4 groups of 2 experts, 2 groups allowed, top-3; one dense layer. GLM-5's middle layer shares
    # the first layer's selection, and its indexer's rotary features are interleaved.
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa": ("glm_moe_dsa", {}),
    # Plain RoPE, biased latent projections and o_proj, a dense layer between sparse ones (listed in
    # mlp_layer_types), one expert group, top-2 without renormalisation, two shared experts, tied
    # head, 9 keys per query.
    "deepseek_v32-plain-rope-bias": (
        "deepseek_v32",
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
            attention_bias=True,
            mlp_layer_types=["sparse", "dense", "sparse"],
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            n_shared_experts=2,
            tie_word_embeddings=True,
            index_topk=9,
            rms_norm_eps=1e-5,
        ),
    ),
    # GLM-5 with the shared layer last, after two full ones, and plain RoPE.
    "glm_moe_dsa-shared-last": (
        "glm_moe_dsa",
        dict(indexer_types=["full", "full", "shared"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    model_type, overrides = CASES[case]
    assert_aligned(model_type, overrides, lora_rank=8)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_parity_lora_and_peft_export_in_float64(model_type):
    assert_aligned(model_type, {}, lora_rank=8, dtype="float64")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    model_type, overrides = CASES[case]
    assert_state_dict_round_trip(tiny_checkpoint(model_type, **overrides))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    model_type, overrides = CASES[case]
    assert_meta_weights_complete(model_type, overrides)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_indexer_weights_load_and_are_no_lora_target(model_type, tiny_checkpoint, tmp_path):
    """The indexer's weights load from the checkpoint (GLM-5's shared layer has none), are not
    wrapped by LoRA, and the exported adapter names the MLA projections and MLPs only."""
    from safetensors.torch import load_file

    path = tiny_checkpoint(model_type)
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = build_model(path, lora=lora)
    checkpoint = load_file(str(path / "model.safetensors"))
    for i, layer in enumerate(loaded.model.layers):
        indexer = layer.self_attn.indexer
        assert (indexer is None) == (loaded.args.indexer_types[i] == "shared")
        if indexer is not None:
            for name, param in indexer.named_parameters():
                assert torch.equal(param, checkpoint[f"model.layers.{i}.self_attn.indexer.{name}"]), name
                assert not name.startswith("lora"), name
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == sorted(["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"])
    assert sorted(config["target_parameters"]) == [
        "down_proj.weight",
        "gate_proj.weight",
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "up_proj.weight",
    ]


def test_selection_binds_and_stays_causal_within_each_sequence(tiny_checkpoint):
    """Each query reads min(index_topk, position + 1) keys, all at or before it in its own sequence;
    and the indexer gets no gradient (its top-k is not differentiable, as in HF)."""
    model = build_model(tiny_checkpoint("deepseek_v32")).model
    for layer in model.layers:
        layer.self_attn.keeps_selection = True
    lengths = (7, 1, 13, 33)
    _, tokens, positions, cu_seqlens = packed_batch(lengths, 256, seed=0)
    model(tokens, positions, cu_seqlens, 33).logsumexp(-1).sum().backward()
    for layer in model.layers:
        masks = layer.self_attn.selection
        assert [m.shape for m in masks] == [(n, n) for n in lengths]
        for mask in masks:
            assert not mask.triu(1).any()
            assert torch.equal(mask.sum(-1), (torch.arange(mask.shape[0]) + 1).clamp(max=4))
        assert all(p.grad is None for p in layer.self_attn.indexer.parameters())
        assert layer.self_attn.q_a_proj.weight.grad is not None


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa"])
def test_generation_with_kv_cache_equals_full_forward(model_type, tiny_checkpoint):
    """The cache keeps each layer's indexer keys; a decode step selects over them: greedy tokens and
    log-probs equal those of step-by-step full forwards (contexts up to 19 tokens, 4 selected)."""
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    model = build_model(tiny_checkpoint(model_type)).model.eval()
    prompts = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112]]
    samples = NativeRolloutEngine(model).generate(prompts, SamplingParams(max_new_tokens=6, temperature=0))
    with torch.no_grad():
        for sample in samples:
            ids = list(sample.prompt_ids)
            for token, logprob in zip(sample.completion_ids, sample.logprobs):
                logits = model(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))[-1]
                assert token == int(logits.argmax())
                assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
                ids.append(token)


@pytest.mark.parametrize(
    "model_type, overrides, field",
    [
        ("deepseek_v32", dict(q_lora_rank=0), "config.q_lora_rank"),
        ("deepseek_v32", dict(index_topk=0), "config.index_topk"),
        ("deepseek_v32", dict(index_head_dim=4), "config.index_head_dim"),
        (
            "deepseek_v32",
            dict(layer_types=["indexed_attention", "full_attention", "indexed_attention"]),
            "config.layer_types",
        ),
        ("glm_moe_dsa", dict(indexer_types=["shared", "full", "full"]), r"config.indexer_types\[0\]"),
        ("glm_moe_dsa", dict(indexer_types=["full", "sparse", "full"]), "config.indexer_types"),
        ("deepseek_v32", dict(kv_lora_rank=0), "config.kv_lora_rank"),
    ],
)
def test_unsupported_config_values_are_refused_by_name(model_type, overrides, field):
    from transformers import AutoConfig

    from archon.models.deepseek_v32.args import DeepseekV32Args
    from archon.tools.align import tiny_config_kwargs

    config = AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, **overrides))
    with pytest.raises(ValueError, match=field):
        DeepseekV32Args.from_hf_config(config)


def test_selection_in_query_blocks_equals_one_block(tiny_checkpoint, monkeypatch):
    """Long sequences select in blocks of queries (bounded scores): the masks are those of one block."""
    import archon.models.deepseek_v32.model as dsa

    model = build_model(tiny_checkpoint("deepseek_v32")).model.eval()
    _, tokens, positions, cu_seqlens = packed_batch((33, 70), 256, seed=0)
    with torch.no_grad():
        whole = model(tokens, positions, cu_seqlens, 70)
        monkeypatch.setattr(
            dsa, "SELECTION_SCORE_ELEMENTS", 16 * 70 * 5
        )  # 5 queries of the 70-token sequence at a time
        blocked = model(tokens, positions, cu_seqlens, 70)
    torch.testing.assert_close(blocked, whole, rtol=0, atol=1e-6)


def test_context_parallelism_is_refused_by_name(tiny_checkpoint):
    from archon.models.deepseek_v32.parallelize import parallelize_deepseek_v32
    from archon.parallel import ParallelConfig, ParallelDims

    model = build_model(tiny_checkpoint("deepseek_v32")).model
    with pytest.raises(ValueError, match="context parallelism"):
        parallelize_deepseek_v32(model, ParallelDims(world_size=2, cp=2), ParallelConfig())
