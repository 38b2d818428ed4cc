"""Llama 3 against HF transformers and PEFT: llama3 RoPE, attention/MLP bias, head_dim != hidden/heads,
tied and untied heads."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)

from archon.models.llama.spec import TINY_LLAMA3_ROPE

MODEL_TYPE = "llama"

CASES = {
    # llama3 RoPE, head_dim 24 with hidden 64 / 4 heads, biases everywhere, untied head.
    "llama3-rope-bias-headdim": dict(rope_parameters=TINY_LLAMA3_ROPE, head_dim=24, attention_bias=True, mlp_bias=True),
    # Tied head, multi-head (no GQA), plain RoPE, head_dim derived from hidden/heads.
    "tied-mha-default-rope": dict(
        tie_word_embeddings=True,
        num_key_value_heads=4,
        head_dim=None,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
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


def test_llama3_rope_scaling_changes_the_output(tiny_checkpoint):
    """The parity case exercises llama3 scaling: plain RoPE at the same theta gives other logits."""
    from archon.build import build_model
    from archon.models.common.rope import RotaryEmbedding
    from archon.tools.align import packed_batch

    model = build_model(tiny_checkpoint(MODEL_TYPE, **CASES["llama3-rope-bias-headdim"])).model.eval()
    assert model.args.head_dim == 24 and model.layers[0].self_attn.q_proj.out_features == 4 * 24
    _, tokens, positions, cu_seqlens = packed_batch((33, 13), 256, seed=0)
    with torch.no_grad():
        scaled = model(tokens, positions, cu_seqlens, 33)
        model.rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, 24, 512)
        plain = model(tokens, positions, cu_seqlens, 33)
    assert (scaled - plain).abs().max() > 1e-3


def test_sliding_window_config_is_refused():
    from transformers import LlamaConfig

    from archon.models.llama.args import LlamaArgs

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=1)
    config.sliding_window = 16
    with pytest.raises(ValueError, match="sliding_window"):
        LlamaArgs.from_hf_config(config)
