"""MiniMax-M2 (minimax_m2) against HF transformers and PEFT: q_norm / k_norm over the whole projection,
partial rotary (from rotary_dim or from partial_rotary_factor), sigmoid routing with a correction bias
used for the choice only and the chosen weights renormalised, stacked experts stored per expert in the
Mixtral layout, LoRA on attention and experts; the fields real configs carry beside HF's class.
The gate's failure with each feature switched off is in tests/models/test_feature_sensitivity.py."""

import json
import shutil

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_extra_layer_keys_are_skipped,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import randomised_lora_model
from transformers import AutoConfig

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import ADAPTER_CONFIG, load_peft_adapter, lora_config_from_peft, save_peft_adapter
from archon.models.minimax_m2.args import MinimaxM2Args

MODEL_TYPE = "minimax_m2"

CASES = {
    # The registered tiny config: head_dim 24 (q projection 96 wide, k 48), GQA, RoPE on 12 features
    # given as rotary_dim, default RoPE, 8 experts top-2, untied head.
    "gqa-rotary-dim": {},
    # HF's config class alone (no rotary_dim or scoring fields): MHA with head_dim = hidden / heads,
    # YaRN on a quarter of each head given as partial_rotary_factor, top-3, tied head.
    "mha-quarter-rotary-yarn-tied": dict(
        head_dim=16,
        num_key_value_heads=4,
        rotary_dim=None,
        scoring_func=None,
        use_routing_bias=None,
        use_qk_norm=None,
        qk_norm_type=None,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "partial_rotary_factor": 0.25,
        },
        num_experts_per_tok=3,
        tie_word_embeddings=True,
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case, dtype):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8, dtype=dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    """On HF's in-memory names (stacked experts, `mlp.e_score_correction_bias`); the round trip above
    checks the checkpoint's (`block_sparse_moe.experts.<e>.w1`, ...)."""
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def test_checkpoint_keeps_the_mixtral_layout(tiny_checkpoint):
    from safetensors import safe_open

    path = tiny_checkpoint(MODEL_TYPE)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.1.block_sparse_moe.e_score_correction_bias" in keys
    assert not any(".mlp." in key for key in keys)
    converter = build_model(path).converter
    assert [k for k, _ in converter.to_hf("layers.0.mlp.gate.e_score_correction_bias", torch.zeros(8))] == [
        "model.layers.0.block_sparse_moe.e_score_correction_bias"
    ]


def test_adapter_config_and_import_round_trip(tiny_checkpoint, tmp_path):
    """Attention LoRA goes to PEFT as target_modules, expert LoRA as the stacked experts'
    target_parameters under HF's in-memory module paths (`mlp.experts`)."""
    path = tiny_checkpoint(MODEL_TYPE)
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = randomised_lora_model(path, lora, seed=5)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(config["target_parameters"]) == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"]

    imported = lora_config_from_peft(tmp_path / "adapter")
    assert set(imported.target_modules) == {"k_proj", "o_proj", "q_proj", "v_proj", "experts"}
    fresh = build_model(path, lora=imported)
    load_peft_adapter(fresh.model, fresh.converter, tmp_path / "adapter")
    original, restored = lora_parameters(loaded.model), lora_parameters(fresh.model)
    assert original.keys() == restored.keys()
    assert any(".experts." in k for k in original)
    for name in original:
        assert torch.equal(original[name], restored[name]), name


@pytest.fixture(scope="module")
def tiny_checkpoint_path(tmp_path_factory):
    from archon.tools.align import make_tiny_hf_checkpoint

    return make_tiny_hf_checkpoint(MODEL_TYPE, tmp_path_factory.mktemp(MODEL_TYPE) / "hf", seed=0)


def test_multi_token_prediction_layers_are_skipped(tiny_checkpoint, tmp_path):
    """Released checkpoints carry `num_mtp_modules` MTP layers numbered from num_hidden_layers on; HF's
    causal LM and archon skip them. Any other stray key still fails the load, by name."""
    assert_extra_layer_keys_are_skipped(
        tiny_checkpoint(MODEL_TYPE),
        tmp_path,
        [
            f"model.layers.2.{suffix}"
            for suffix in ("self_attn.q_proj.weight", "block_sparse_moe.gate.weight", "enorm.weight")
        ],
        "model.layers.1.block_sparse_moe.stray",
    )


REFUSED = {
    "router_jitter_noise": dict(router_jitter_noise=0.1),
    "attention_dropout": dict(attention_dropout=0.1),  # refused for every family
    "use_qk_norm": dict(use_qk_norm=False),
    "qk_norm_type": dict(qk_norm_type="per_head"),
    "scoring_func": dict(scoring_func="softmax"),
    "use_routing_bias": dict(use_routing_bias=False),
    "shared_intermediate_size": dict(shared_intermediate_size=64),
    r"attn_type_list\[1\]": dict(attn_type_list=[1, 0]),
    "attn_type_list has 1 entries": dict(attn_type_list=[1]),
    "sliding_window": dict(sliding_window=8),
    "rotary_dim=8 disagrees": dict(
        rotary_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}
    ),
    "partial_rotary_factor=0.5 with head_dim=10 gives 5": dict(
        head_dim=10,
        rotary_dim=None,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    ),
    "num_experts_per_tok=9": dict(num_experts_per_tok=9),
    "hidden_act": dict(hidden_act="gelu"),
}


@pytest.mark.parametrize("match", sorted(REFUSED))
def test_unimplemented_config_values_are_refused_by_name(match):
    from archon.tools.align import tiny_config_kwargs

    config = AutoConfig.for_model(MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **REFUSED[match]))
    with pytest.raises(ValueError, match=match):
        MinimaxM2Args.from_hf_config(config)


def test_real_config_fields_are_accepted():
    """The fields released MiniMax-M2 configs set beside HF's class, at their released values."""
    from archon.tools.align import tiny_config_kwargs

    config = AutoConfig.for_model(
        MODEL_TYPE,
        **tiny_config_kwargs(
            MODEL_TYPE,
            attn_type_list=[1, 1],
            shared_intermediate_size=0,
            num_mtp_modules=3,
            mtp_transformer_layers=1,
            use_mtp=True,
        ),
    )
    args = MinimaxM2Args.from_hf_config(config)
    assert args.rotary_dim == 12 and args.num_experts == 8


def test_fp8_release_layout_kept_quantized_matches_hf(tmp_path):
    """Released MiniMax-M2 checkpoints store the attention projections and every expert's w1 / w2 / w3
    in fp8 with block scales (router, correction bias, norms, embeddings and head plain). Blocks of
    16x24 leave partial blocks at the tiny widths; the per-expert scales are stacked with their experts."""
    from archon.quant import QuantFormat
    from archon.quant.export import quantize_checkpoint
    from archon.tools.align import AlignArgs, make_tiny_hf_checkpoint, run_alignment

    source = make_tiny_hf_checkpoint(MODEL_TYPE, tmp_path / "hf")
    released = r"\.layers\.\d+\.(self_attn\.[qkvo]_proj|block_sparse_moe\.experts\.\d+\.w[123])\.weight$"
    quantized = quantize_checkpoint(source, tmp_path / "fp8", QuantFormat("fp8", (16, 24)), pattern=released)
    report = run_alignment(AlignArgs(hf_path=str(quantized), lora_rank=8))
    assert report["pass"], report
    assert report["quantized_tensors"] == 2 * (4 + 8 * 3)
    assert report["archon_quantized_weights"] == 2 * (4 + 2)  # the experts stacked, quantized as stored


def test_qk_norm_rounds_as_hf_in_bf16(tiny_checkpoint_path):
    """HF's MiniMax-M2 RMSNorm casts back to bf16 before the weight; the model's q_norm does the same
    (OLMo's whole-projection norm scales in fp32 instead), bit for bit."""
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

    q_norm = build_model(tiny_checkpoint_path).model.layers[0].self_attn.q_norm
    reference = MiniMaxM2RMSNorm(96, q_norm.eps)
    with torch.no_grad():
        reference.weight.copy_(q_norm.weight)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(0)).bfloat16()
    q_norm, reference = q_norm.bfloat16(), reference.bfloat16()
    with torch.no_grad():
        assert torch.equal(q_norm(x), reference(x))


def test_a_checkpoint_in_hf_in_memory_layout_loads_the_same(tiny_checkpoint_path, tmp_path):
    """A checkpoint written from HF's in-memory state dict (`mlp.experts.gate_up_proj` stacked,
    `mlp.e_score_correction_bias`) loads to the same archon model as the Mixtral-layout one."""
    from safetensors.torch import save_file

    from archon.tools.align import hf_model_class

    hf_model = hf_model_class(AutoConfig.from_pretrained(tiny_checkpoint_path)).from_pretrained(tiny_checkpoint_path)
    in_memory = tmp_path / "in_memory"
    shutil.copytree(tiny_checkpoint_path, in_memory)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state and "model.layers.0.mlp.e_score_correction_bias" in state
    save_file(state, str(in_memory / "model.safetensors"), metadata={"format": "pt"})
    reference = build_model(tiny_checkpoint_path).model.state_dict()
    loaded = build_model(in_memory).model.state_dict()
    assert reference.keys() == loaded.keys()
    for name, tensor in reference.items():
        assert torch.equal(tensor, loaded[name]), name
