"""Gemma 3 (gemma3_text, and the language model of the gemma3 vision-language composite) against HF
transformers and PEFT: scaled embeddings, zero-centred sandwich norms, per-head QK-norm, the GeGLU
MLP, the query_pre_attn_scalar softmax scale, sliding and full layers with RoPE per layer type, tied
and untied heads, attention bias, the composite's checkpoint layout, and the config values archon
refuses. The gate failing with each feature switched off: tests/models/test_feature_sensitivity.py."""

import json

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from transformers import AutoConfig

from archon.models.gemma3.args import Gemma3Args
from archon.tools.align import packed_batch, tiny_config_kwargs

MODEL_TYPE = "gemma3_text"

CASES = {
    # The registered tiny config: layers sliding (window 8), full, sliding; theta 1e4 on sliding layers,
    # 1e6 with linear scaling x8 on the full one; head_dim 24, query_pre_attn_scalar 32; tied head.
    "tiny": (MODEL_TYPE, {}),
    # The vision-language composite as HF saves it (language_model.model.*, vision_tower.*,
    # multi_modal_projector.*), tied as released and untied (language_model.lm_head).
    "vision-language": ("gemma3", {}),
    "vision-language-untied": ("gemma3", dict(tie_word_embeddings=False)),
    # A config.json as released: layer_types derived from sliding_window_pattern, RoPE from the legacy
    # rope_theta / rope_local_base_freq / rope_scaling; plus q/k/v/o bias, an untied head, GQA 4:1 and
    # a window of 3.
    "legacy-rope-pattern-bias-untied": (
        MODEL_TYPE,
        dict(
            layer_types=None,
            sliding_window_pattern=2,
            sliding_window=3,
            rope_parameters=None,
            rope_theta=10_000.0,
            rope_local_base_freq=100.0,
            rope_scaling={"rope_type": "linear", "factor": 4.0},
            attention_bias=True,
            tie_word_embeddings=False,
            num_key_value_heads=1,
            head_dim=16,
            query_pre_attn_scalar=16,
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    model_type, overrides = CASES[case]
    assert_aligned(model_type, overrides, lora_rank=8)


@pytest.mark.parametrize("case", ["legacy-rope-pattern-bias-untied", "vision-language"])
def test_parity_float64(case):
    model_type, overrides = CASES[case]
    assert_aligned(model_type, overrides, lora_rank=8, dtype="float64")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    model_type, overrides = CASES[case]
    assert_state_dict_round_trip(tiny_checkpoint(model_type, **overrides))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    model_type, overrides = CASES[case]
    assert_meta_weights_complete(model_type, overrides)


def test_vision_language_export_keys_and_merged_checkpoint(tiny_checkpoint, lora_model, tmp_path):
    """From the composite: the adapter names the language model's modules by path (the vision tower's
    q/k/v_proj stay unadapted), and the merged export keeps the vision tower and projector as they
    were, loads into HF's composite with no missing or unexpected weight and gives the adapted logits."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from archon.checkpoint.hf_weights import save_merged_hf
    from archon.lora import LoRAConfig
    from archon.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter

    path = tiny_checkpoint("gemma3")
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = lora_model(path, lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys), keys[:3]
    targets = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())["target_modules"]
    assert "model.language_model.layers.0.self_attn.q_proj" in targets and "q_proj" not in targets

    save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    original = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    merged, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    kept = dict(original.model.vision_tower.named_parameters()) | dict(
        original.model.multi_modal_projector.named_parameters()
    )
    for name, param in [
        *merged.model.vision_tower.named_parameters(),
        *merged.model.multi_modal_projector.named_parameters(),
    ]:
        assert torch.equal(param, kept[name]), name
    seqs, tokens, positions, cu_seqlens = packed_batch((9,), 256, seed=0)
    with torch.no_grad():
        expected = loaded.model.eval()(tokens, positions, cu_seqlens, 9)
        torch.testing.assert_close(merged.eval()(seqs[0][None]).logits[0], expected, rtol=0, atol=1e-4)


def test_legacy_config_resolves_as_hf_does():
    config = AutoConfig.for_model(
        MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **CASES["legacy-rope-pattern-bias-untied"][1])
    )
    args = Gemma3Args.from_hf_config(config)
    assert args.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert args.rope_parameters["sliding_attention"]["rope_theta"] == 100.0
    assert args.rope_parameters["full_attention"] == {"rope_type": "linear", "factor": 4.0, "rope_theta": 10_000.0}


# The fields of Gemma 3 1B's config.json (google/gemma-3-1b-it), in the legacy RoPE form it ships.
RELEASED_1B_CONFIG = dict(
    architectures=["Gemma3ForCausalLM"],
    attention_bias=False,
    attention_dropout=0.0,
    attn_logit_softcapping=None,
    bos_token_id=2,
    cache_implementation="hybrid",
    eos_token_id=[1, 106],
    final_logit_softcapping=None,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    hidden_size=1152,
    initializer_range=0.02,
    intermediate_size=6912,
    max_position_embeddings=32768,
    model_type=MODEL_TYPE,
    num_attention_heads=4,
    num_hidden_layers=26,
    num_key_value_heads=1,
    pad_token_id=0,
    query_pre_attn_scalar=256,
    rms_norm_eps=1e-06,
    rope_local_base_freq=10000,
    rope_scaling=None,
    rope_theta=1000000,
    sliding_window=512,
    sliding_window_pattern=6,
    torch_dtype="bfloat16",
    use_cache=True,
    vocab_size=262144,
)


def test_released_config_resolves_and_every_field_is_accounted_for():
    from transformers import Gemma3TextConfig

    from archon.config_coverage import unaccounted_fields
    from archon.spec import get_spec

    config = Gemma3TextConfig.from_dict(RELEASED_1B_CONFIG)
    args = Gemma3Args.from_hf_config(config)
    assert args.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2
    assert args.rope_parameters == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000},
        "full_attention": {"rope_type": "default", "rope_theta": 1000000},
    }
    assert (args.sliding_window, args.query_pre_attn_scalar, args.tie_word_embeddings) == (512, 256, True)
    assert unaccounted_fields(get_spec(MODEL_TYPE), config) == []


REFUSED = {
    "attn_logit_softcapping": dict(attn_logit_softcapping=50.0),
    "final_logit_softcapping": dict(final_logit_softcapping=30.0),
    "use_bidirectional_attention": dict(use_bidirectional_attention=True),
    "hidden_activation": dict(hidden_activation="gelu"),
    "attention_dropout": dict(attention_dropout=0.1),
    r"rope_parameters\['full_attention'\]\['rope_type'\]": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            "full_attention": {"rope_type": "dynamic", "rope_theta": 1_000_000.0, "factor": 2.0},
        }
    ),
    r"layer_types\[1\]='chunked_attention'": dict(
        layer_types=["sliding_attention", "chunked_attention", "full_attention"],
        rope_parameters={
            layer_type: {"rope_type": "default", "rope_theta": 10_000.0}
            for layer_type in ("sliding_attention", "chunked_attention", "full_attention")
        },
    ),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_config_values_name_the_field(field):
    config = AutoConfig.for_model(MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **REFUSED[field]))
    with pytest.raises(ValueError, match=field):
        Gemma3Args.from_hf_config(config)


def test_composite_refusals_read_the_text_config():
    config = AutoConfig.for_model("gemma3", **tiny_config_kwargs("gemma3", final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        Gemma3Args.from_hf_config(config)
