"""Qwen3-Next (qwen3_next) against HF transformers and PEFT: gated DeltaNet layers with the fused
in_proj_qkvz / in_proj_ba projections and gated attention layers mixed, several value heads per key
head, partial rotary, zero-centred norms, sparse layers (softmax top-k with or without
renormalisation, a gated shared expert) beside dense ones (mlp_only_layers, decoder_sparse_step),
LoRA on every projection, packed sequences longer than a delta-rule chunk, and refused configs."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import (
    assert_native_greedy_equals_hf_generate,
    assert_no_state_leaks_across_packed_sequences,
    randomise_lora,
)
from transformers import AutoConfig

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.models.common.linear_attention import DELTA_RULE_CHUNK_SIZE
from archon.models.qwen3_next.args import Qwen3NextArgs
from archon.tools.align import packed_batch, tiny_config_kwargs

# One sequence longer than a chunk of the chunked delta rule, one of a single token.
SEQ_LENS = (7, 1, 13, DELTA_RULE_CHUNK_SIZE + 6)

CASES = {
    # The registered tiny config: layers linear, full, linear; 2 value heads per key head; RoPE on a
    # quarter of each head; layers 0 and 2 sparse (8 experts, top-2 renormalised, gated shared
    # expert), layer 1 dense (mlp_only_layers).
    "registered": {},
    # Full attention first; every second layer sparse (decoder_sparse_step=2: layer 1 sparse, 0 and 2
    # dense); the top-k weights not renormalised; one value head per key head; RoPE on half of each
    # head; q/k/v/o bias; a tied head.
    "sparse-step-unnormalised-bias-tied": dict(
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        mlp_only_layers=[],
        decoder_sparse_step=2,
        norm_topk_prob=False,
        linear_num_value_heads=2,
        attention_bias=True,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case, dtype):
    assert_aligned("qwen3_next", CASES[case], lora_rank=8, seq_lens=SEQ_LENS, dtype=dtype)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(tiny_checkpoint, case):
    assert_state_dict_round_trip(tiny_checkpoint("qwen3_next", **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete("qwen3_next", CASES[case])


# The mutation checks (each feature switched off fails the gate) are the qwen3_next cases of
# tests/models/test_feature_sensitivity.py.


def test_no_state_leaks_across_packed_sequences(tiny_checkpoint):
    """A sequence's logits and gradients are the same alone and packed after another one (of a
    different content each time): the conv window and the recurrent state restart at each boundary."""
    model = build_model(tiny_checkpoint("qwen3_next"), lora=LoRAConfig(rank=4, alpha=8)).model
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    assert_no_state_leaks_across_packed_sequences(model, DELTA_RULE_CHUNK_SIZE + 9, (3, DELTA_RULE_CHUNK_SIZE + 20))


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_greedy_equals_hf_generate(tiny_checkpoint, case):
    """Greedy generation through the per-sequence cache (KV for attention layers, conv window and
    recurrent state for DeltaNet layers) gives HF's greedy tokens, for prompts of one token, a few,
    and more than a delta-rule chunk."""
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + DELTA_RULE_CHUNK_SIZE + 5))]
    assert_native_greedy_equals_hf_generate(tiny_checkpoint("qwen3_next", **CASES[case]), prompts)


def _config(**overrides):
    return AutoConfig.for_model("qwen3_next", **tiny_config_kwargs("qwen3_next", **overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]),
            r"layer_types holds \[.sliding_attention.\]",
        ),
        (dict(layer_types=["linear_attention", "full_attention"]), r"layer_types has 2 entries for 3 layers"),
        (dict(linear_num_key_heads=3, linear_num_value_heads=4), r"linear_num_value_heads \(4\) must be a multiple of"),
        (dict(attention_dropout=0.1), r"config\.attention_dropout=0\.1"),
        (dict(mlp_only_layers=[3]), r"config\.mlp_only_layers holds \[3\]"),
        (dict(decoder_sparse_step=0), r"config\.decoder_sparse_step=0"),
        (dict(intermediate_size=0), r"config\.intermediate_size=0"),
        (dict(num_experts_per_tok=9), r"config\.num_experts_per_tok=9"),
        (dict(hidden_act="gelu"), r"config\.hidden_act='gelu'"),
        (
            dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.1}),
            r"partial_rotary_factor=0\.1",
        ),
    ],
)
def test_unsupported_configs_are_refused(overrides, message):
    config = _config()
    for field, value in overrides.items():  # set after construction: HF's own checks refuse some of these
        setattr(config, field, value)
    with pytest.raises(ValueError, match=message):
        Qwen3NextArgs.from_hf_config(config)


def test_dense_and_sparse_layers_follow_the_config():
    """layer_types from full_attention_interval (HF's default 4); sparse layers every
    decoder_sparse_step-th layer but those in mlp_only_layers."""
    config = _config(num_hidden_layers=6, layer_types=None, mlp_only_layers=[3], decoder_sparse_step=2)
    args = Qwen3NextArgs.from_hf_config(config)
    assert [args.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert args.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 2


def test_merged_export_loads_in_hf_with_the_adapted_logits(tiny_checkpoint, lora_model, tmp_path):
    """The merged export (the vLLM merged mode's weights) writes HF's layout back, conv channels in
    q | k | v order included: it loads into HF's model with no missing or unexpected weight and gives
    the adapted model's logits."""
    from transformers import AutoModelForCausalLM

    from archon.checkpoint.hf_weights import save_merged_hf

    path = tiny_checkpoint("qwen3_next")
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8))
    save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    merged, info = AutoModelForCausalLM.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    seqs, tokens, positions, cu_seqlens = packed_batch((DELTA_RULE_CHUNK_SIZE + 6,), 256, seed=0)
    with torch.no_grad():
        expected = loaded.model.eval()(tokens, positions, cu_seqlens, DELTA_RULE_CHUNK_SIZE + 6)
        torch.testing.assert_close(merged.eval()(seqs[0][None]).logits[0], expected, rtol=0, atol=1e-4)
