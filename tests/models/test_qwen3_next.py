"""Qwen3-Next (qwen3_next) against HF transformers and PEFT: gated DeltaNet layers with the fused
in_proj_qkvz / in_proj_ba projections and gated attention layers mixed, several value heads per key
head, partial rotary, zero-centred norms, sparse layers (softmax top-k with or without
renormalisation, a gated shared expert) beside dense ones (mlp_only_layers, decoder_sparse_step),
LoRA on every projection, packed sequences longer than a delta-rule chunk, and refused configs."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_gate_fails,
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
from archon.models.common import linear_attention
from archon.models.common.attention import GatedAttention
from archon.models.common.hybrid import HybridDecoderLM
from archon.models.common.linear_attention import DELTA_RULE_CHUNK_SIZE
from archon.models.common.moe import SharedExpertMoE
from archon.models.common.norms import GatedRMSNorm, OffsetRMSNorm, RMSNorm
from archon.models.common.rope import RotaryEmbedding
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


def _after_init(monkeypatch, cls, mutate) -> None:
    """Every `cls` built from now on is mutated by `mutate(module)` after its __init__ (hooks and
    attributes survive the checkpoint load that follows)."""
    original = cls.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        mutate(self)

    monkeypatch.setattr(cls, "__init__", init)


def _constant_output(value: float):
    """A forward hook replacing a module's output with `value` everywhere (30: a sigmoid gate of ~1)."""
    return lambda module, inputs, output: torch.full_like(output, value)


def _attention_gate_off(monkeypatch):
    def open_gate(module, inputs, output):  # q_proj: [T, H * 2 hd], each head's query then its gate
        out = output.view(output.shape[0], -1, 2, module.head_dim).clone()
        out[:, :, 1] = 30.0
        return out.view_as(output)

    def mutate(attention):
        attention.q_proj.head_dim = attention.head_dim
        attention.q_proj.register_forward_hook(open_gate)

    _after_init(monkeypatch, GatedAttention, mutate)


def _qk_norm_off(monkeypatch):
    def mutate(attention):
        for norm in (attention.q_norm, attention.k_norm):
            norm.register_forward_hook(lambda module, inputs, output: inputs[0])

    _after_init(monkeypatch, GatedAttention, mutate)


def _full_rotary(monkeypatch):
    def mutate(model):
        args = model.args
        model.rotary = RotaryEmbedding(args.rope_parameters, args.head_dim, args.max_position_embeddings)

    _after_init(monkeypatch, HybridDecoderLM, mutate)


def _conv_window_off(monkeypatch):  # each channel sees its own token only
    conv = linear_attention.causal_conv1d

    def last_tap_only(x, weight, lengths, window):
        mask = torch.zeros_like(weight)
        mask[..., -1] = 1.0
        return conv(x, weight * mask, lengths, window)

    monkeypatch.setattr(linear_attention, "causal_conv1d", last_tap_only)


def _decay_off(monkeypatch):  # g = 0: the state is never decayed
    rule = linear_attention.gated_delta_rule
    monkeypatch.setattr(
        linear_attention, "gated_delta_rule", lambda q, k, v, g, *rest: rule(q, k, v, torch.zeros_like(g), *rest)
    )


def _value_heads_tiled(monkeypatch):
    """Value head h reads key head h % Hk instead of h // r (archon's [T, H, d] DeltaNet q and k only;
    HF repeats [B, L, H, d] tensors on dim 2)."""
    original = torch.Tensor.repeat_interleave

    def tiled(self, repeats, dim=None, **kwargs):
        if isinstance(repeats, int) and dim == 1 and self.dim() == 3:
            return self.repeat(1, repeats, 1)
        return original(self, repeats, dim=dim, **kwargs)

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", tiled)


def _shared_expert_gate_off(monkeypatch):
    _after_init(monkeypatch, SharedExpertMoE, lambda moe: moe.shared_expert_gate.register_forward_hook(_constant_output(30.0)))


def _shared_expert_off(monkeypatch):
    _after_init(monkeypatch, SharedExpertMoE, lambda moe: moe.shared_expert.register_forward_hook(_constant_output(0.0)))


def _top_k_not_renormalised(monkeypatch):
    _after_init(monkeypatch, SharedExpertMoE, lambda moe: setattr(moe.gate, "norm_topk_prob", False))


# Each feature the registered tiny config turns on, switched off in archon's model (HF's is untouched).
MUTATIONS = {
    "attention-output-gate": _attention_gate_off,
    "zero-centred-norms": lambda monkeypatch: monkeypatch.setattr(OffsetRMSNorm, "forward", RMSNorm.forward),
    "deltanet-output-gate": lambda monkeypatch: monkeypatch.setattr(
        GatedRMSNorm, "forward", lambda self, x, gate: RMSNorm.forward(self, x)
    ),
    "qk-norm": _qk_norm_off,
    "partial-rotary": _full_rotary,
    "conv-window": _conv_window_off,
    "decay": _decay_off,
    "value-heads-per-key-head": _value_heads_tiled,
    "shared-expert-gate": _shared_expert_gate_off,
    "shared-expert": _shared_expert_off,
    "norm-topk-prob": _top_k_not_renormalised,
}


@pytest.mark.parametrize("feature", sorted(MUTATIONS))
def test_the_gate_fails_with_each_feature_switched_off(monkeypatch, feature):
    """The registered tiny config reaches every feature: with one switched off in archon's model the
    gate fails (logits off by more than 1e-3)."""
    MUTATIONS[feature](monkeypatch)
    assert_gate_fails("qwen3_next", {}, seq_lens=SEQ_LENS)


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
        (dict(layer_types=["linear_attention", "sliding_attention", "full_attention"]), r"layer_types holds \[.sliding_attention.\]"),
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

    from archon.lora.peft import save_merged_hf

    path = tiny_checkpoint("qwen3_next")
    loaded = lora_model(path, LoRAConfig(rank=4, alpha=8))
    save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    merged, info = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    seqs, tokens, positions, cu_seqlens = packed_batch((DELTA_RULE_CHUNK_SIZE + 6,), 256, seed=0)
    with torch.no_grad():
        expected = loaded.model.eval()(tokens, positions, cu_seqlens, DELTA_RULE_CHUNK_SIZE + 6)
        torch.testing.assert_close(merged.eval()(seqs[0][None]).logits[0], expected, rtol=0, atol=1e-4)
