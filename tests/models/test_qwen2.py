"""Qwen2 against HF transformers and PEFT: q/k/v bias without o_proj bias, and the sliding window as
HF applies it (use_sliding_window, max_window_layers, layer_types)."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)

MODEL_TYPE = "qwen2"

CASES = {
    # Layer 1 slides over 8 tokens (layers >= max_window_layers slide); sequences up to 33 tokens.
    "window-from-max-window-layers": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # No window, tied head, GQA 4:1.
    "full-attention-tied": dict(use_sliding_window=False, tie_word_embeddings=True, num_key_value_heads=1),
}
# Layer types listed in the config win over max_window_layers; a window of 3 on the first layer.
EXPLICIT_LAYER_TYPES = dict(
    use_sliding_window=True,
    sliding_window=3,
    max_window_layers=2,
    num_hidden_layers=3,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)


def test_parity_explicit_layer_types():
    assert_aligned(MODEL_TYPE, EXPLICIT_LAYER_TYPES, lora_rank=None)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def test_window_is_per_layer_and_changes_the_output(tiny_checkpoint):
    """The parity cases exercise the window: removing it from the sliding layer changes the logits."""
    from archon.build import build_model
    from archon.tools.align import packed_batch

    model = build_model(tiny_checkpoint(MODEL_TYPE, **EXPLICIT_LAYER_TYPES)).model.eval()
    assert [layer.self_attn.sliding_window for layer in model.layers] == [3, None, 3]
    assert model.layers[0].self_attn.o_proj.bias is None and model.layers[0].self_attn.q_proj.bias is not None
    _, tokens, positions, cu_seqlens = packed_batch((13, 5), 256, seed=0)
    with torch.no_grad():
        windowed = model(tokens, positions, cu_seqlens, 13)
        for layer in model.layers:
            layer.self_attn.sliding_window = None
        full = model(tokens, positions, cu_seqlens, 13)
    assert (windowed - full).abs().max() > 1e-3


def test_packed_attention_window_bounds():
    """Window 1 sees only the token itself; a window as long as the sequence equals plain causal."""
    from archon.models.common.attention import packed_attention

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(12, 4, 8, generator=g), torch.randn(12, 2, 8, generator=g)
    v = torch.randn(12, 2, 8, generator=g)
    cu_seqlens = torch.tensor([0, 5, 12])
    self_only = packed_attention(q, k, v, cu_seqlens, 7, 8**-0.5, sliding_window=1)
    torch.testing.assert_close(self_only, v.repeat_interleave(2, dim=1), rtol=0, atol=1e-6)
    causal = packed_attention(q, k, v, cu_seqlens, 7, 8**-0.5)
    torch.testing.assert_close(packed_attention(q, k, v, cu_seqlens, 7, 8**-0.5, sliding_window=7), causal)
    assert (packed_attention(q, k, v, cu_seqlens, 7, 8**-0.5, sliding_window=3) - causal).abs().max() > 1e-3


def test_bad_layer_types_name_the_field():
    from transformers import Qwen2Config

    from archon.models.qwen2.args import Qwen2Args

    small = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
    no_window = Qwen2Config(**small, use_sliding_window=False, layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ValueError, match=r"layer_types\[1\].*sliding_window is None"):
        Qwen2Args.from_hf_config(no_window)
    unknown = Qwen2Config(**small, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match=r"layer_types\[1\]='chunked_attention'"):
        Qwen2Args.from_hf_config(unknown)
