"""GLM-4.5 (glm4_moe) against HF transformers and PEFT: partial rotary, QK-norm and q/k/v bias on or
off, dense first layers, group-limited sigmoid routing with score-correction bias and routed scaling,
shared experts, and LoRA on attention, dense MLP, shared experts and experts."""

import json

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_extra_layer_keys_are_skipped,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import randomised_lora_model

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import (
    ADAPTER_CONFIG,
    load_peft_adapter,
    lora_config_from_peft,
    save_peft_adapter,
)
from archon.tools.align import packed_batch

MODEL_TYPE = "glm4_moe"

CASES = {
    # The registered tiny config: QK-norm, q/k/v bias, RoPE on half of each head, 1 dense layer,
    # 2 groups of 4 experts with one group allowed per token, routed_scaling_factor 1.5.
    "qknorm-bias-half-rotary": {},
    # GLM-4.5's own routing shape (one group), no QK-norm and no bias, YaRN on a quarter of each
    # head, two dense layers, top-3 without renormalisation, two shared experts, tied head.
    "plain-attn-quarter-rotary-yarn": dict(
        use_qk_norm=False,
        attention_bias=False,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "partial_rotary_factor": 0.25,
        },
        first_k_dense_replace=2,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        n_shared_experts=2,
        tie_word_embeddings=True,
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


def test_adapter_config_and_import_round_trip(tiny_checkpoint, tmp_path):
    """Dense-MLP and shared-expert LoRA go to PEFT as `<name>.weight` target_parameters, beside the
    stacked experts: as target_modules PEFT would refold gate/up/down_proj into expert LoRA."""
    path = tiny_checkpoint(MODEL_TYPE)
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = randomised_lora_model(path, lora, seed=5)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(config["target_parameters"]) == [
        "down_proj.weight",
        "gate_proj.weight",
        "mlp.experts.down_proj",
        "mlp.experts.gate_up_proj",
        "up_proj.weight",
    ]

    imported = lora_config_from_peft(tmp_path / "adapter")
    assert set(imported.target_modules) == {
        "k_proj",
        "o_proj",
        "q_proj",
        "v_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "experts",
    }
    fresh = build_model(path, lora=imported)
    load_peft_adapter(fresh.model, fresh.converter, tmp_path / "adapter")
    original, restored = lora_parameters(loaded.model), lora_parameters(fresh.model)
    assert original.keys() == restored.keys()
    assert any(".shared_experts." in k for k in original) and any("layers.0.mlp.gate_proj" in k for k in original)
    for name in original:
        assert torch.equal(original[name], restored[name]), name


def test_partial_rotary_and_routing_features_change_the_output(tiny_checkpoint):
    """The parity cases would catch a wrong rotary width, a dropped score-correction bias or a
    dropped group limit: each changes the logits of the tiny model."""
    from archon.models.common.rope import RotaryEmbedding

    model = build_model(tiny_checkpoint(MODEL_TYPE)).model.eval()
    assert model.rotary.rotary_dim == 8 and model.layers[0].self_attn.head_dim == 16
    _, tokens, positions, cu_seqlens = packed_batch((33, 13), 256, seed=0)

    def logits():
        with torch.no_grad():
            return model(tokens, positions, cu_seqlens, 33)

    reference = logits()
    rotary = model.rotary
    model.rotary = RotaryEmbedding(model.args.rope_parameters, 16, model.args.max_position_embeddings)
    assert (logits() - reference).abs().max() > 1e-3
    model.rotary = rotary

    router = model.layers[1].mlp.gate
    bias = router.e_score_correction_bias.clone()
    router.e_score_correction_bias.zero_()
    assert (logits() - reference).abs().max() > 1e-3
    router.e_score_correction_bias.copy_(bias)

    for layer in model.layers[1:]:
        layer.mlp.gate.topk_group = layer.mlp.gate.n_group
    assert (logits() - reference).abs().max() > 1e-3


def test_multi_token_prediction_layers_are_skipped(tiny_checkpoint, tmp_path):
    """Real GLM-4.5 checkpoints carry an MTP layer numbered num_hidden_layers; HF and archon skip it.
    Any other stray key still fails the load, by name."""
    assert_extra_layer_keys_are_skipped(
        tiny_checkpoint(MODEL_TYPE),
        tmp_path,
        [f"model.layers.3.{suffix}" for suffix in ("eh_proj.weight", "enorm.weight", "mlp.gate.weight")],
        "model.layers.1.mlp.gate.stray",
    )


def test_odd_rotary_width_is_refused():
    from transformers import AutoConfig

    from archon.models.glm4_moe.args import Glm4MoeArgs

    config = AutoConfig.for_model(
        MODEL_TYPE,
        head_dim=10,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
    )
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5 with head_dim=10 gives 5"):
        Glm4MoeArgs.from_hf_config(config)
