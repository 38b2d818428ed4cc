"""Falcon-H1 (falcon_h1) against HF transformers and PEFT: every layer a Mamba2 mixer and attention side
by side (the shared Mamba2 mixer of models/common/mamba2.py: grouped B/C, conv with bias, a step-size
limit on both sides, the grouped gated norm before or after the gate, or none) plus a SwiGLU MLP, with
every muP multiplier off 1; LoRA on every target PEFT accepts, packed sequences longer than a scan
chunk, the generation cache, the gate catching each multiplier dropped, and the refused config values."""

import pytest
import torch
from family_checks import (
    assert_aligned,
    assert_gate_fails,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import assert_no_state_leaks_across_packed_sequences, randomise_lora

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.models.common.mamba2 import SSD_CHUNK_SIZE, Mamba2Mixer
from archon.models.falcon_h1.args import FalconH1Args
from archon.models.falcon_h1.model import FalconH1DecoderLayer, FalconH1MLP

MODEL_TYPE = "falcon_h1"
# One sequence longer than a chunk of the scan, one of a single token.
SEQ_LENS = (7, 1, 13, SSD_CHUNK_SIZE + 6)

CASES = {
    # The registered tiny config: gated norm before the gate, 2 groups of B/C, conv bias, a binding
    # step-size limit, every multiplier off 1.
    "registered": {},
    # No gated norm (y * silu(z) only); the Mamba2 width from mamba_expand (mamba_d_ssm None), 8 heads in
    # one group; every bias on but the conv's; a tied head; no step-size limit.
    "no-norm-tied-biases": dict(
        mamba_rms_norm=False,
        mamba_d_ssm=None,
        mamba_expand=2,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_n_groups=1,
        mamba_conv_bias=False,
        mamba_proj_bias=True,
        projectors_bias=True,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        time_step_limit=(0.0, float("inf")),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8, seq_lens=SEQ_LENS)


def test_parity_in_float64():
    """In fp64 the port agrees with HF to rounding (about 1e-14), far inside what fp32 allows: HF's
    fp32 mup vector (ssm_multipliers rounded to fp32 whatever the dtype) is mirrored."""
    assert_aligned(MODEL_TYPE, {}, lora_rank=8, seq_lens=SEQ_LENS, dtype="float64")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def test_no_state_leaks_across_packed_sequences(tiny_checkpoint):
    """A sequence's logits and LoRA gradients are the same alone and packed after another one: the conv
    windows and the Mamba2 state restart at each boundary (and attention sees its own sequence)."""
    model = build_model(tiny_checkpoint(MODEL_TYPE), lora=LoRAConfig(rank=4, alpha=8)).model
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    assert_no_state_leaks_across_packed_sequences(model, SSD_CHUNK_SIZE + 9, (3, SSD_CHUNK_SIZE + 20))


def _config(**overrides):
    from archon.tools.tiny_checkpoint import tiny_hf_config

    return tiny_hf_config(MODEL_TYPE, **overrides)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mamba_n_heads=3, mamba_d_head=16, mamba_d_ssm=48), "mamba_n_groups"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_unsupported_config_is_refused(overrides, field):
    with pytest.raises(ValueError, match=field):
        FalconH1Args.from_hf_config(_config(**overrides))


def _hf_greedy_by_forward(hf_model, prompt, steps):
    """HF's greedy tokens by full forwards on the growing sequence (HF's one-token step takes no
    step-size limit, so its generate's tokens are not its forward's once the limit binds)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_native_greedy_equals_hf_forward(tiny_checkpoint):
    """Greedy decoding through the per-sequence cache (each layer's attention keys and values and its
    Mamba2 conv window and state, in one layer cache) gives the tokens of HF's full forward, for a
    prompt longer than a scan chunk too."""
    from transformers import AutoModelForCausalLM

    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    path = tiny_checkpoint(MODEL_TYPE)
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeRolloutEngine(build_model(path).model)
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + SSD_CHUNK_SIZE + 5))]
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    for prompt, sample in zip(prompts, samples):
        assert sample.completion_ids == _hf_greedy_by_forward(hf_model, prompt, 8)


def test_native_logprobs_equal_the_trainers(tiny_checkpoint):
    """Rollout log-probs (sampled, with LoRA) equal Trainer.logprobs on the same tokens."""
    from archon.batch import PackedBatch
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(model_path=str(tiny_checkpoint(MODEL_TYPE)), lora=LoRAConfig(rank=4, alpha=8)))
    randomise_lora(lora_parameters(trainer.model), 0.1)
    rollout = NativeRolloutEngine(trainer.model)
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + SSD_CHUNK_SIZE + 5))]
    samples = rollout.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, n=2, seed=3))
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    expected = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout_lp = torch.tensor([lp for s in samples for lp in s.logprobs])
    torch.testing.assert_close(rollout_lp, expected, rtol=0, atol=1e-5)


def _layers(model):
    return [layer for layer in model.modules() if isinstance(layer, FalconH1DecoderLayer)]


def _set_on(kind, name, value):
    def switch_off(model, monkeypatch):
        for module in model.modules():
            if isinstance(module, kind):
                monkeypatch.setattr(module, name, value)

    return switch_off


def _no_key_multiplier(model, monkeypatch):
    for layer in _layers(model):
        layer.self_attn.scale = layer.self_attn.head_dim**-0.5


def _no_lm_head_multiplier(model, monkeypatch):
    monkeypatch.setattr(model.args, "lm_head_multiplier", 1.0)


def _no_embedding_multiplier(model, monkeypatch):
    model.embedding_scale = None


def _settings_without(**changes):
    import dataclasses

    def switch_off(model, monkeypatch):
        for mixer in model.modules():
            if isinstance(mixer, Mamba2Mixer):
                mixer.settings = dataclasses.replace(mixer.settings, **changes)
                mixer.time_step_min, mixer.time_step_max = mixer.settings.dt_min, mixer.settings.dt_max

    return switch_off


def _norm_after_gate(model, monkeypatch):
    for mixer in model.modules():
        if isinstance(mixer, Mamba2Mixer):
            mixer.norm.norm_before_gate = False


MUTATIONS = {
    "no-ssm-out-multiplier": _set_on(FalconH1DecoderLayer, "ssm_out_multiplier", 1.0),
    "no-attention-in-multiplier": _set_on(FalconH1DecoderLayer, "attention_in_multiplier", 1.0),
    "no-attention-out-multiplier": _set_on(FalconH1DecoderLayer, "attention_out_multiplier", 1.0),
    "no-mlp-gate-multiplier": _set_on(FalconH1MLP, "gate_multiplier", 1.0),
    "no-mlp-down-multiplier": _set_on(FalconH1MLP, "down_multiplier", 1.0),
    "no-key-multiplier": _no_key_multiplier,
    "no-lm-head-multiplier": _no_lm_head_multiplier,
    "no-embedding-multiplier": _no_embedding_multiplier,
    "no-ssm-in-multiplier": _settings_without(in_multiplier=1.0),
    "no-ssm-projection-multipliers": _settings_without(projection_multipliers=None),
    "no-step-size-maximum": _settings_without(dt_max=float("inf")),
    "no-step-size-minimum": _settings_without(dt_min=0.0),
    "norm-after-gate": _norm_after_gate,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_gate_fails_with_a_feature_switched_off(mutation, monkeypatch):
    """The registered tiny config reaches each feature: with it switched off in the archon model, the
    gate fails (every multiplier is off 1, the step-size limit binds on both sides)."""
    from archon.tools import align

    build_model_ = align.build_model

    def build_and_switch_off(*args, **kwargs):
        loaded = build_model_(*args, **kwargs)
        MUTATIONS[mutation](loaded.model, monkeypatch)
        return loaded

    monkeypatch.setattr(align, "build_model", build_and_switch_off)
    assert_gate_fails(MODEL_TYPE, {}, seq_lens=SEQ_LENS)


@pytest.mark.parametrize("field, value", [("mamba_chunk_size", 16)])
def test_fields_declared_inert_do_not_move_hf(field, value):
    """Flipped in HF, a field the ModelSpec declares inert leaves the parameters and the logits as they were."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(_config()).double().eval()
    flipped = AutoModelForCausalLM.from_config(_config(**{field: value})).double().eval()
    flipped.load_state_dict(reference.state_dict(), strict=True)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # float64: another tiling of the scan moves only the rounding
        torch.testing.assert_close(flipped(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-10)
