"""OLMo 3 against HF transformers and PEFT: post-norm layers, QK-norms over the whole projections,
sliding windows and RoPE (YaRN on full-attention layers) per layer type, biases, tied and untied heads;
OLMo 2 (the same layers, every one full attention, one set of rope parameters) from the same family."""

import pytest
from family_checks import assert_aligned, assert_meta_weights_complete, assert_state_dict_round_trip

MODEL_TYPE = "olmo3"
# Tiny-config overrides (on top of the ModelSpec's tiny_hf_config) that exercise the family's features.
CASES = {
    # The registered tiny config: a sliding layer (window 8, theta 1e4) then a full one (YaRN, theta 5e5),
    # head_dim 24 != hidden / heads, GQA 2:1, untied head.
    "yarn-full-layers": {},
    # HF's default layer pattern (three sliding layers, then a full one), YaRN with an explicit
    # attention_factor as the released configs have it, q/k/v/o biases, multi-head, tied head.
    "default-pattern-bias-tied": dict(
        num_hidden_layers=4,
        layer_types=None,
        sliding_window=5,
        head_dim=16,
        num_key_value_heads=4,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
            "full_attention": {
                "rope_type": "yarn",
                "rope_theta": 500000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "attention_factor": 1.5,
            },
        },
    ),
    # The rope fields as the released config.json files write them: rope_theta and a YaRN rope_scaling,
    # which HF applies to the full-attention layers only.
    "released-rope-scaling-format": dict(
        rope_parameters=None,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "yarn",
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.2079441541679836,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
}


# OLMo 2's registered tiny config: YaRN, head_dim 24, GQA, untied; then biases and a tied head.
OLMO2_CASES = {"yarn": {}, "bias-tied": dict(attention_bias=True, tie_word_embeddings=True)}
ALL_CASES = [(MODEL_TYPE, case) for case in sorted(CASES)] + [("olmo2", case) for case in sorted(OLMO2_CASES)]


def _overrides(model_type, case):
    return (CASES if model_type == MODEL_TYPE else OLMO2_CASES)[case]


@pytest.mark.parametrize("model_type, case", ALL_CASES)
def test_parity_lora_and_peft_export(model_type, case):
    assert_aligned(model_type, _overrides(model_type, case), lora_rank=8)


@pytest.mark.parametrize("model_type", [MODEL_TYPE, "olmo2"])
def test_parity_in_fp64(model_type):
    assert_aligned(model_type, {}, lora_rank=8, dtype="float64")


@pytest.mark.parametrize("model_type, case", ALL_CASES)
def test_state_dict_round_trip(model_type, case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(model_type, **_overrides(model_type, case)))


@pytest.mark.parametrize("model_type, case", ALL_CASES)
def test_meta_weights_complete(model_type, case):
    assert_meta_weights_complete(model_type, _overrides(model_type, case))


def test_config_is_read_as_hf_resolves_it():
    from transformers import AutoConfig

    from archon.models.olmo3.args import Olmo3Args
    from archon.tools.align import tiny_config_kwargs

    config = AutoConfig.for_model(MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **CASES["default-pattern-bias-tied"]))
    args = Olmo3Args.from_hf_config(config)
    assert args.layer_types == ["sliding_attention"] * 3 + ["full_attention"]
    assert [args.layer_sliding_window(i) for i in range(4)] == [5, 5, 5, None]
    assert args.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert args.rope_parameters["sliding_attention"]["rope_type"] == "default"
    assert args.attention_bias and args.tie_word_embeddings and args.head_dim == 16


def test_released_rope_scaling_reaches_the_full_attention_layers_only():
    from transformers import AutoConfig

    from archon.models.olmo3.args import Olmo3Args
    from archon.tools.align import tiny_config_kwargs

    overrides = CASES["released-rope-scaling-format"]
    args = Olmo3Args.from_hf_config(AutoConfig.for_model(MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **overrides)))
    assert args.rope_parameters["full_attention"]["rope_type"] == "yarn"
    assert args.rope_parameters["sliding_attention"] == {"rope_type": "default", "rope_theta": 500000.0}


def test_olmo2_config_is_read_as_full_attention_with_one_rope():
    from transformers import AutoConfig

    from archon.models.olmo3.args import Olmo3Args
    from archon.tools.align import tiny_config_kwargs

    args = Olmo3Args.from_hf_config(AutoConfig.for_model("olmo2", **tiny_config_kwargs("olmo2")))
    assert args.layer_types == ["full_attention"] * 2 and args.sliding_window is None
    assert (
        list(args.rope_parameters) == ["full_attention"]
        and args.rope_parameters["full_attention"]["rope_type"] == "yarn"
    )


# The mutation checks (each feature switched off fails the gate) are the olmo3 and olmo2 cases of
# tests/models/test_feature_sensitivity.py.


def _config(model_type=MODEL_TYPE, **overrides):
    from transformers import AutoConfig

    from archon.tools.align import tiny_config_kwargs

    return AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, **overrides))


REFUSED = {
    "attention_dropout": dict(attention_dropout=0.1),
    "hidden_act": dict(hidden_act="gelu"),
    r"rope_parameters\['full_attention'\]\['rope_type'\]": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            "full_attention": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
        }
    ),
    r"rope_parameters\['sliding_attention'\]\['partial_rotary_factor'\]": dict(
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
            "full_attention": {"rope_type": "default", "rope_theta": 1e4},
        }
    ),
    r"layer_types\[1\]": dict(layer_types=["sliding_attention", "chunked_attention"]),
}


@pytest.mark.parametrize("field", sorted(REFUSED))
def test_unsupported_config_values_are_refused_by_name(field):
    from archon.models.olmo3.args import Olmo3Args

    config = _config()
    for name, value in REFUSED[field].items():
        setattr(config, name, value)
    with pytest.raises(ValueError, match=field):
        Olmo3Args.from_hf_config(config)


def test_olmo2_rope_type_is_refused_by_name():
    from archon.models.olmo3.args import Olmo3Args

    config = _config("olmo2")
    config.rope_parameters = {"rope_type": "longrope", "rope_theta": 1e4}
    with pytest.raises(ValueError, match=r"config.rope_parameters\['rope_type'\]"):
        Olmo3Args.from_hf_config(config)


def test_a_sliding_layer_without_a_window_is_refused():
    from archon.models.olmo3.args import Olmo3Args

    config = _config()
    config.sliding_window = None
    with pytest.raises(ValueError, match=r"layer_types\[0\].*sliding_window"):
        Olmo3Args.from_hf_config(config)
