"""GPT-OSS against HF transformers and PEFT: attention sinks, sliding window on alternating layers,
YaRN RoPE, biased top-k router, clamped SwiGLU experts with interleaved gate/up, and LoRA on the
attention projections and on the experts (PEFT `target_parameters`)."""

import json

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import randomised_lora_model

from archon.build import build_model
from archon.checkpoint.hf_weights import save_merged_hf
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, load_peft_adapter, save_peft_adapter
from archon.models.common.rope import RotaryEmbedding
from archon.tools.align import packed_batch

MODEL_TYPE = "gpt_oss"

CASES = {
    # The registered tiny config: GQA 2:1, window 8 on even layers (sequences up to 33 tokens),
    # GPT-OSS's YaRN (factor 32, no truncation), attention bias, clamp limit 7.
    "tiny-default": {},
    # Full attention first, then two layers with a window of 3; one KV head; no attention bias; a
    # tied head; top-3 routing; clamps that bite (limit 1) with another alpha; YaRN with truncation.
    "mqa-window3-clamped": dict(
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=3,
        num_key_value_heads=1,
        attention_bias=False,
        tie_word_embeddings=True,
        num_experts_per_tok=3,
        swiglu_limit=1.0,
        swiglu_alpha=1.2,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            beta_fast=16.0,
            beta_slow=2.0,
            original_max_position_embeddings=16,
        ),
        max_position_embeddings=64,
    ),
}


def _randomised_lora_model(path, lora):
    loaded = randomised_lora_model(path, lora, seed=3)
    return loaded.model.eval(), loaded


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip_and_meta_completeness(case, tiny_checkpoint):
    """Every key is a rename (experts, their biases, sinks, router bias included), both ways."""
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def test_parity_cases_exercise_sinks_window_clamp_and_yarn(tiny_checkpoint):
    """Each feature a tiny config might not reach moves the logits of the parity batch, so parity
    depends on it."""
    model = build_model(tiny_checkpoint(MODEL_TYPE, **CASES["mqa-window3-clamped"])).model.eval()
    assert [layer.self_attn.sliding_window for layer in model.layers] == [None, 3, 3]
    assert model.layers[0].self_attn.q_proj.bias is None and model.lm_head is None
    _, tokens, positions, cu_seqlens = packed_batch((33, 13), 256, seed=0)

    def logits():
        with torch.no_grad():
            return model(tokens, positions, cu_seqlens, 33)

    reference = logits()
    changes = {}
    with torch.no_grad():
        saved_sinks = [layer.self_attn.sinks.clone() for layer in model.layers]
        for layer in model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink that takes no probability mass
        changes["sinks"] = (logits() - reference).abs().max().item()
        for layer, sinks in zip(model.layers, saved_sinks):
            layer.self_attn.sinks.copy_(sinks)
    for layer in model.layers:
        layer.self_attn.sliding_window = None
    changes["window"] = (logits() - reference).abs().max().item()
    for layer in model.layers:
        layer.self_attn.sliding_window = 3 if layer is not model.layers[0] else None
        layer.mlp.experts.limit = float("inf")
    changes["clamp"] = (logits() - reference).abs().max().item()
    for layer in model.layers:
        layer.mlp.experts.limit = 1.0
    model.rotary = RotaryEmbedding({"rope_type": "default", "rope_theta": 10000.0}, 16, 64)
    changes["yarn"] = (logits() - reference).abs().max().item()
    assert all(change > 1e-3 for change in changes.values()), changes


def test_expert_lora_export_format_and_peft_logits(tiny_checkpoint, tmp_path):
    """Expert LoRA alone goes to PEFT target_parameters: gate_up_proj's factors on the inner wrapper
    (`experts.base_layer`), down_proj's on the outer one; lora_A [E*r, in], lora_B [out, r*E].
    (Attention plus experts is the parity tests' all-linear adapter.)"""
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(MODEL_TYPE)
    lora = LoRAConfig(rank=4, alpha=8, target_modules=("experts",))
    model, loaded = _randomised_lora_model(path, lora)
    save_peft_adapter(model, loaded.converter, lora, tmp_path / "adapter", str(path))

    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    assert config["target_modules"] == []
    args = loaded.args
    experts, dim, hidden = args.num_local_experts, args.hidden_size, args.intermediate_size
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    layer = "base_model.model.model.layers.1.mlp.experts"
    assert shapes[f"{layer}.base_layer.lora_A.weight"] == (experts * 4, dim)
    assert shapes[f"{layer}.base_layer.lora_B.weight"] == (2 * hidden, 4 * experts)
    assert shapes[f"{layer}.lora_A.weight"] == (experts * 4, hidden)
    assert shapes[f"{layer}.lora_B.weight"] == (dim, 4 * experts)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    in_model = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    assert in_model == set(shapes)
    seqs, tokens, positions, cu = packed_batch((21, 5), 256, seed=1)
    with torch.no_grad():
        ours = model(tokens, positions, cu, 21)
        theirs = torch.cat([peft_model(s[None]).logits[0] for s in seqs])
        with peft_model.disable_adapter():
            base = torch.cat([peft_model(s[None]).logits[0] for s in seqs])
    assert (theirs - base).abs().max() > 1e-2  # the adapter loaded as something
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)

    fresh = build_model(path, lora=lora)
    load_peft_adapter(fresh.model, fresh.converter, tmp_path / "adapter")
    restored = lora_parameters(fresh.model)
    for name, param in lora_parameters(model).items():
        assert torch.equal(param, restored[name]), name


def test_merged_export_matches_lora_model(tiny_checkpoint, tmp_path):
    """Merging folds each expert's B @ A into the input-major stacked weights ([E, in, out])."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint(MODEL_TYPE)
    model, loaded = _randomised_lora_model(path, LoRAConfig(rank=4, alpha=8))
    out = save_merged_hf(model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    seqs, tokens, positions, cu = packed_batch((17, 6), 256, seed=2)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        with_lora = model(tokens, positions, cu, 17)
        hf_merged = torch.cat([hf(s[None]).logits[0] for s in seqs])
    torch.testing.assert_close(hf_merged, with_lora, rtol=1e-4, atol=1e-4)


def test_config_errors_name_the_field():
    from transformers import AutoConfig

    from archon.models.gpt_oss.args import GptOssArgs

    config = AutoConfig.for_model(MODEL_TYPE, num_hidden_layers=2, sliding_window=None)
    with pytest.raises(ValueError, match="sliding_window"):
        GptOssArgs.from_hf_config(config)
    config = AutoConfig.for_model(MODEL_TYPE, num_hidden_layers=2, layer_types=["full_attention", "chunked_attention"])
    with pytest.raises(ValueError, match="chunked_attention"):
        GptOssArgs.from_hf_config(config)


def test_tp_degree_must_divide_the_heads():
    """The TP plan shards q heads (with their sinks) and kv heads; an MQA model cannot take tp=2."""
    from transformers import AutoConfig

    from archon.parallel import ParallelConfig, ParallelDims
    from archon.spec import get_spec

    spec = get_spec(MODEL_TYPE)
    config = AutoConfig.for_model(MODEL_TYPE, **dict(spec.tiny_hf_config[MODEL_TYPE], num_key_value_heads=1))
    with torch.device("meta"):
        model = spec.model_cls(spec.args_cls.from_hf_config(config), None)
    dims = ParallelDims(world_size=2, dp_shard=1, tp=2)  # its mesh is never built
    with pytest.raises(ValueError, match=r"tp=2 does not divide num_key_value_heads=1 of this gpt_oss model"):
        spec.parallelize_fn(model, dims, ParallelConfig(tp=2))
