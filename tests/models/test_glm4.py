"""GLM-4-0414 (glm4) against HF transformers and PEFT: q/k/v bias without o_proj bias, partial RoPE
on interleaved pairs, the fused gate_up_proj (LoRA on it as PEFT puts it), four norms per layer;
TP, FSDP and context parallelism against one process, and generation with the cache."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_gate_fails,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from torch import nn

import archon.tools.align as align
from archon.models.common.attention import Attention
from archon.models.common.rope import apply_rotary

MODEL_TYPE = "glm4"

CASES = {
    # The registered tiny config: q/k/v bias, 12 of 24 head features rotate, untied head.
    "default": dict(),
    # Tied head, no attention bias, MQA, a quarter of the features rotating under linear RoPE scaling.
    "tied-no-bias-quarter-rotary": dict(
        tie_word_embeddings=True,
        attention_bias=False,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "rope_theta": 10_000.0, "factor": 4.0, "partial_rotary_factor": 0.25},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    report = assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8)
    assert report["peft_missing_keys"] == [] and report["lora_effect_max_abs"] > 1e-3


def test_parity_float64():
    assert_aligned(MODEL_TYPE, {}, lora_rank=8, dtype="float64")


def test_parity_bfloat16_and_norms_bit_for_bit():
    """bf16 against HF in bf16 (the base model): within the measured floor, every norm equal to HF's."""
    from archon.tools.align import AlignArgs, run_alignment

    report = run_alignment(AlignArgs(model_type=MODEL_TYPE, dtype="bfloat16"))
    assert report["pass"], report["failures"]
    assert report["bf16_norms_compared"] == 9 and report["bf16_norm_max_abs_diff"] == 0.0


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def test_meta_weights_complete_with_the_released_pad_token_id():
    """Glm4Config's default pad_token_id (151329) lies outside the tiny vocabulary; the check still runs."""
    assert_meta_weights_complete(MODEL_TYPE, dict(pad_token_id=151329))


def test_lora_reaches_every_target_peft_accepts(tiny_checkpoint):
    from archon.build import build_model
    from archon.lora import LoRAConfig, lora_parameters

    model = build_model(tiny_checkpoint(MODEL_TYPE), lora=LoRAConfig(rank=4, alpha=8)).model
    adapted = {name.split(".")[-3] for name in lora_parameters(model)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}, adapted


# ---- Mutations: each feature of the registered tiny config, switched off, fails the gate ----------


def _attention(model) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def _no_qkv_bias(model, monkeypatch):
    with torch.no_grad():
        for attn in _attention(model):
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                proj.bias.zero_()


def _rope_half_split(model, monkeypatch):
    for attn in _attention(model):
        attn.interleaved_rotary = False


def _full_rotary(model, monkeypatch):
    """RoPE over the whole head with the partial tables' frequencies repeated (a hard-coded factor 1)."""
    for attn in _attention(model):
        attn.interleaved_rotary = False
    import archon.models.common.attention as attention_module

    def full(x, cos, sin, interleaved=False):
        reps = x.shape[-1] // cos.shape[-1]
        return apply_rotary(x, cos.repeat(1, reps), sin.repeat(1, reps), interleaved)

    monkeypatch.setattr(attention_module, "apply_rotary", full)


def _no_post_norms(model, monkeypatch):
    for layer in model.layers:
        layer.post_self_attn_layernorm = nn.Identity()
        layer.post_mlp_layernorm = nn.Identity()


def _gate_up_swapped(model, monkeypatch):
    for layer in model.layers:
        mlp = layer.mlp

        def forward(x, mlp=mlp):
            up, gate = mlp.gate_up_proj(x).chunk(2, dim=-1)
            return mlp.down_proj(up * torch.nn.functional.silu(gate))

        mlp.forward = forward


MUTATIONS = {
    "qkv-bias": _no_qkv_bias,
    "rope-interleaved-pairs": _rope_half_split,
    "partial-rotary": _full_rotary,
    "sandwich-norms": _no_post_norms,
    "gate-up-order": _gate_up_swapped,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_gate_notices_each_feature_switched_off(mutation, monkeypatch):
    build = align.build_model

    def mutated(*args, **kwargs):
        loaded = build(*args, **kwargs)
        MUTATIONS[mutation](loaded.model, monkeypatch)
        return loaded

    monkeypatch.setattr(align, "build_model", mutated)
    assert_gate_fails(MODEL_TYPE, {})


# ---- Config errors ------------------------------------------------------------------------------


def test_config_errors_name_the_field():
    from transformers import Glm4Config

    from archon.models.glm4.args import Glm4Args

    small = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2, head_dim=24)
    odd = Glm4Config(
        **small, rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.125}
    )
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        Glm4Args.from_hf_config(odd)
    with pytest.raises(ValueError, match="hidden_act"):
        Glm4Args.from_hf_config(Glm4Config(**small, hidden_act="gelu"))
    with pytest.raises(ValueError, match="attention_dropout"):
        Glm4Args.from_hf_config(Glm4Config(**small, attention_dropout=0.1))


def test_attention_without_rope_tables_is_a_clear_error():
    attn = Attention(64, 4, 2, 16, qkv_bias=False, o_bias=False, qk_norm_eps=None, lora=None)
    x = torch.randn(5, 64)
    with pytest.raises(ValueError, match="rotary=False"):
        attn(x, None, None, torch.tensor([0, 5]), 5)
    no_rope = Attention(64, 4, 2, 16, qkv_bias=False, o_bias=False, qk_norm_eps=None, lora=None, rotary=False)
    assert no_rope(x, None, None, torch.tensor([0, 5]), 5).shape == (5, 64)


# ---- Generation, TP / FSDP / context parallelism -------------------------------------------------

PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def test_greedy_with_the_cache_equals_hf_generate(tiny_checkpoint, float64_math):
    from transformers import AutoModelForCausalLM

    from archon.build import build_model
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    path = tiny_checkpoint(MODEL_TYPE)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    engine = NativeRolloutEngine(build_model(path, dtype=torch.float64).model, max_batch_sequences=4)
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, n=2))
    for sample in samples:
        prompt = sample.prompt_ids
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt)),
                pad_token_id=0,
                eos_token_id=None,
            )
        assert sample.completion_ids == out[0, len(prompt) :].tolist(), (sample.prompt_index, sample.completion_ids)


@pytest.mark.slow
def test_tp_fsdp_and_context_parallel_match_one_process(tiny_checkpoint, tmp_path):
    """float64: log-probs, entropies, loss, LoRA gradients, the loss curve, the exported adapter and
    greedy completions (cp2) of tp2, fsdp2 and cp2 against one process (tests/parallel_cases.py)."""
    import parallel_cases as cases
    from test_parallel import _check_against_single_process, _check_export

    from archon.precision import fp32_islands_in_fp64
    from archon.trainer import Trainer

    path = tiny_checkpoint(MODEL_TYPE)
    export_dir = tmp_path / "single"
    with fp32_islands_in_fp64():
        trainer = Trainer(cases.engine_config(path, dtype=cases.EQUALITY_DTYPE))
        reference = cases.run_case(trainer, 256, export_dir=export_dir, generate=True)
    reference["export_dir"] = str(export_dir)
    out = tmp_path / "results.pt"
    layouts = ("tp2", "fsdp2", "cp2")
    cases.launch(2, "parity", "--out", str(out), "--layouts", *layouts, "--ckpt", f"{MODEL_TYPE}={path}")
    results = torch.load(out, weights_only=False)
    for layout in layouts:
        result = results[(MODEL_TYPE, layout)]
        _check_against_single_process(result, reference, f"{MODEL_TYPE} {layout}")
        _check_export(result, reference, f"{MODEL_TYPE} {layout}")
        if layout == "cp2":  # the worker generates under context parallelism
            assert result["generated"] == reference["generated"], (result["generated"], reference["generated"])
