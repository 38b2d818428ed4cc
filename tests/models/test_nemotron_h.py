"""Nemotron-H (nemotron_h) against HF transformers and PEFT: Mamba2 mixers (chunked scan, grouped B/C,
conv with bias, step-size clamp, grouped gated norm), attention without positions, relu^2 MLP blocks and
Nemotron 3 Nano's MoE blocks (group-limited sigmoid routing over non-gated relu^2 experts, a shared MLP)
mixed by layers_block_type, LoRA on every target PEFT accepts, packed sequences longer than a scan
chunk, the chunked scan against the recurrence, the generation cache, and the refused config values."""

import pytest
import torch
import torch.nn.functional as F
from family_checks import (
    assert_aligned,
    assert_gate_fails,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import assert_no_state_leaks_across_packed_sequences, randomise_lora
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.models.common.mamba2 import SSD_CHUNK_SIZE, Mamba2Mixer, chunked_ssd
from archon.models.nemotron_h.args import NemotronHArgs
from archon.models.nemotron_h.model import NemotronHMLP, NemotronHMoE

MODEL_TYPE = "nemotron_h"
# One sequence longer than a chunk of the scan, one of a single token.
SEQ_LENS = (7, 1, 13, SSD_CHUNK_SIZE + 6)

CASES = {
    # The registered tiny config: Mamba2, attention, Mamba2, MLP; 2 groups of B/C; conv bias on.
    "registered": {},
    # Attention first, the MLP between two Mamba2 blocks; one group (B/C shared by all heads), a conv of
    # 3 taps without bias, biased in_proj/out_proj (use_bias) and MLP (mlp_bias), a wider state,
    # another norm eps, no binding clamp.
    "attention-first-biases": dict(
        layers_block_type=["full_attention", "linear_attention", "mlp", "linear_attention"],
        n_groups=1,
        conv_kernel=3,
        use_conv_bias=False,
        use_bias=True,
        mlp_bias=True,
        ssm_state_size=16,
        layer_norm_epsilon=1e-6,
        time_step_min=0.001,
    ),
    # MoE blocks in a latent space (fc1/fc2_latent_proj, biased by mlp_bias) with one group of experts
    # (no group limit), 3 experts per token, weights not renormalised, no scaling; MoE first and last
    # (HF's cache needs an attention block, even in a forward without generation).
    "moe-latent-one-group": dict(
        layers_block_type=["moe", "linear_attention", "full_attention", "moe"],
        moe_latent_size=24,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        mlp_bias=True,
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    assert_aligned(MODEL_TYPE, CASES[case], lora_rank=8, seq_lens=SEQ_LENS)


def test_parity_in_float64():
    """In fp64 the port agrees with HF to rounding (about 1e-14), far inside what fp32 allows."""
    assert_aligned(MODEL_TYPE, {}, lora_rank=8, seq_lens=SEQ_LENS, dtype="float64")


@pytest.mark.parametrize("case", sorted(CASES))
def test_state_dict_round_trip(case, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(MODEL_TYPE, **CASES[case]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_meta_weights_complete(case):
    assert_meta_weights_complete(MODEL_TYPE, CASES[case])


def _recurrent_ssd(x, dt, A, B, C, state):
    """The recurrence written out, token by token: S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T, y_t = S_t C_t."""
    ys = []
    for t in range(x.shape[1]):
        decay = (dt[:, t] * A).exp()[:, :, None, None]  # [N, H, 1, 1]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        ys.append(torch.einsum("nhpd,nhd->nhp", state, C[:, t]))
    return torch.stack(ys, dim=1), state


@pytest.mark.parametrize("length", [1, SSD_CHUNK_SIZE - 1, SSD_CHUNK_SIZE, SSD_CHUNK_SIZE + 1, 2 * SSD_CHUNK_SIZE + 5])
@pytest.mark.parametrize("max_dt", [0.1, 8.0])
def test_chunked_ssd_equals_the_recurrence(length, max_dt):
    """In float64, from a non-zero initial state: lengths below, at and above a chunk; large steps
    (max_dt 8 with A up to -4: decays of exp(-32) per token) must not over- or underflow."""
    g = torch.Generator().manual_seed(length)
    n, heads, head_dim, size = 2, 3, 5, 4
    x = torch.randn(n, length, heads, head_dim, generator=g, dtype=torch.float64)
    dt = torch.rand(n, length, heads, generator=g, dtype=torch.float64) * max_dt
    A = -torch.rand(heads, generator=g, dtype=torch.float64) * 4
    B, C = (torch.randn(n, length, heads, size, generator=g, dtype=torch.float64) for _ in range(2))
    state = torch.randn(n, heads, head_dim, size, generator=g, dtype=torch.float64)
    y, final = chunked_ssd(x, dt, A, B, C, state)
    y_ref, final_ref = _recurrent_ssd(x, dt, A, B, C, state)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-10)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-10)


def test_zero_steps_leave_the_state_unchanged():
    """Padding has dt = 0: the state after it is the state before it, and its outputs read that state."""
    g = torch.Generator().manual_seed(0)
    x, B, C = (torch.randn(1, 5, 2, 3, generator=g, dtype=torch.float64) for _ in range(3))
    dt = torch.zeros(1, 5, 2, dtype=torch.float64)
    state = torch.randn(1, 2, 3, 3, generator=g, dtype=torch.float64)
    _, final = chunked_ssd(x, dt, -torch.ones(2, dtype=torch.float64), B, C, state)
    torch.testing.assert_close(final, state, rtol=0, atol=0)


def test_no_state_leaks_across_packed_sequences(tiny_checkpoint):
    """A sequence's logits and LoRA gradients are the same alone and packed after another one (of a
    different content each time): the conv windows and the Mamba2 state restart at each boundary."""
    model = build_model(tiny_checkpoint(MODEL_TYPE), lora=LoRAConfig(rank=4, alpha=8)).model
    g = torch.Generator().manual_seed(0)
    randomise_lora(lora_parameters(model), 0.1, g)
    assert_no_state_leaks_across_packed_sequences(model, SSD_CHUNK_SIZE + 9, (3, SSD_CHUNK_SIZE + 20))


def _config(**overrides):
    from transformers import AutoConfig

    from archon.spec import get_spec

    return AutoConfig.for_model(MODEL_TYPE, **{**get_spec(MODEL_TYPE).tiny_hf_config[MODEL_TYPE], **overrides})


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_experts_per_tok=0), "num_experts_per_tok"),
        (dict(moe_latent_size=0), "moe_latent_size"),
        (dict(mamba_hidden_act="gelu"), "mamba_hidden_act"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
        (dict(mamba_num_heads=3), "n_groups"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_unsupported_config_is_refused(overrides, field):
    with pytest.raises(ValueError, match=field):
        NemotronHArgs.from_hf_config(_config(**overrides))


def test_a_checkpoint_under_in_memory_names_loads_the_same(tiny_checkpoint, tmp_path):
    """Checkpoints put the decoder under `backbone.` (what save_pretrained writes), HF's in-memory model
    under `model.`: either loads into the same weights."""
    import shutil

    src = tiny_checkpoint(MODEL_TYPE)
    dst = tmp_path / "in_memory_names"
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    assert any(k.startswith("backbone.") for k in tensors)
    save_file({k.replace("backbone.", "model.", 1): v for k, v in tensors.items()}, dst / "model.safetensors")
    a, b = build_model(src).model.state_dict(), build_model(dst).model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_hf_in_memory_state_dict_loads_the_same(tiny_checkpoint, tmp_path):
    """HF's in-memory state dict (`model.` prefix, each MoE block's experts stacked as
    `mixer.experts.up_proj` [E, I, D]) saved as the checkpoint loads into the same weights as the
    checkpoint save_pretrained wrote (`backbone.`, one tensor per expert)."""
    import shutil

    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint(MODEL_TYPE)
    dst = tmp_path / "hf_in_memory"
    shutil.copytree(src, dst)
    hf_state = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).state_dict()
    assert hf_state["model.layers.3.mixer.experts.up_proj"].shape == (8, 32, 64)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, dst / "model.safetensors")
    a, b = build_model(src).model.state_dict(), build_model(dst).model.state_dict()
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0)


def test_expert_lora_is_exported_as_peft_target_parameters(tiny_checkpoint):
    """LoRA on the stacked experts goes to PEFT as target_parameters, up_proj's factors on the inner
    wrapper (`experts.base_layer`), down_proj's on the outer one, [E*r, in] and [out, r*E]."""
    from archon.lora.peft import peft_adapter_config

    lora = LoRAConfig(rank=4, alpha=8)
    loaded = build_model(tiny_checkpoint(MODEL_TYPE), lora=lora)
    keys = loaded.converter.lora_state_dict_to_peft(lora_parameters(loaded.model))
    prefix = "base_model.model.model.layers.3.mixer.experts"
    assert keys[f"{prefix}.base_layer.lora_A.weight"].shape == (8 * 4, 64)
    assert keys[f"{prefix}.base_layer.lora_B.weight"].shape == (32, 4 * 8)
    assert keys[f"{prefix}.lora_A.weight"].shape == (8 * 4, 32)
    assert keys[f"{prefix}.lora_B.weight"].shape == (64, 4 * 8)
    config = peft_adapter_config(loaded.model, loaded.converter, lora, "tiny")
    assert config["target_parameters"] == ["mixer.experts.up_proj", "mixer.experts.down_proj"]
    assert "shared_experts" not in str(config["target_modules"])  # a leaf name ("up_proj") covers them


def test_peft_keys_follow_in_memory_names(tiny_checkpoint):
    """Adapter keys name HF's in-memory modules (`model.`, not the checkpoint's `backbone.`), and no
    LoRA sits on the Mamba2 out_proj or conv1d, which PEFT refuses."""
    loaded = build_model(tiny_checkpoint(MODEL_TYPE), lora=LoRAConfig(rank=4, alpha=8))
    keys = loaded.converter.lora_state_dict_to_peft(lora_parameters(loaded.model))
    assert "base_model.model.model.layers.0.mixer.in_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mixer.q_proj.lora_B.weight" in keys
    assert not any("backbone" in k or "out_proj" in k or "conv1d" in k for k in keys)


def test_mamba_mixer_refuses_context_parallelism(tiny_checkpoint):
    model = build_model(tiny_checkpoint(MODEL_TYPE)).model
    x = torch.zeros(3, model.args.hidden_size)
    with pytest.raises(NotImplementedError, match="context parallelism"):
        model.layers[0].mixer(x, None, None, torch.tensor([0, 3]), 3, None, object())


def _hf_greedy_by_forward(hf_model, prompt, steps):
    """HF's greedy tokens by full forwards on the growing sequence (HF's own generate skips the
    step-size clamp in its one-token step, so its tokens are not its forward's)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            logits = hf_model(torch.tensor([tokens])).logits[0, -1]
            tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


def test_native_greedy_equals_hf_forward(tiny_checkpoint):
    """Greedy decoding through the per-sequence cache (attention keys and values; Mamba2 conv windows and
    states) gives the tokens of HF's full forward, for a prompt longer than a scan chunk too."""
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
    """Rollout log-probs (Mamba2 state and conv windows, attention keys and values in the cache) equal
    Trainer.logprobs on the same tokens (sampled, with LoRA), a prompt longer than a chunk too."""
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


def _each_mamba_mixer(model):
    return [layer.mixer for layer in model.layers if isinstance(layer.mixer, Mamba2Mixer)]


def _no_step_clamp(model, monkeypatch):
    for mixer in _each_mamba_mixer(model):
        mixer.time_step_min = 0.0


def _no_d_skip(model, monkeypatch):
    with torch.no_grad():
        for mixer in _each_mamba_mixer(model):
            mixer.D.zero_()


def _no_conv_bias(model, monkeypatch):
    with torch.no_grad():
        for mixer in _each_mamba_mixer(model):
            mixer.conv1d.bias.zero_()


def _norm_over_all_channels(model, monkeypatch):
    for mixer in _each_mamba_mixer(model):
        mixer.norm.group_size = mixer.width


def _mlp_relu_not_squared(model, monkeypatch):
    for layer in model.layers:
        if isinstance(layer.mixer, NemotronHMLP):
            monkeypatch.setattr(layer.mixer, "forward", lambda x, m=layer.mixer: m.down_proj(F.relu(m.up_proj(x))))


def _each_moe(model):
    return [layer.mixer for layer in model.layers if isinstance(layer.mixer, NemotronHMoE)]


def _no_correction_bias(model, monkeypatch):
    with torch.no_grad():
        for moe in _each_moe(model):
            moe.gate.e_score_correction_bias.zero_()


def _no_routed_scaling(model, monkeypatch):
    for moe in _each_moe(model):
        moe.gate.routed_scaling_factor = 1.0


def _no_group_limit(model, monkeypatch):
    for moe in _each_moe(model):
        moe.gate.n_group = moe.gate.topk_group = 1


def _no_shared_experts(model, monkeypatch):
    for moe in _each_moe(model):
        monkeypatch.setattr(moe.shared_experts, "forward", torch.zeros_like)


def _experts_relu_not_squared(model, monkeypatch):
    for moe in _each_moe(model):
        moe.experts.activation = F.relu


MUTATIONS = {
    "moe-no-correction-bias": _no_correction_bias,
    "moe-no-routed-scaling": _no_routed_scaling,
    "moe-no-group-limit": _no_group_limit,
    "moe-no-shared-experts": _no_shared_experts,
    "moe-experts-relu-not-squared": _experts_relu_not_squared,
    "no-step-clamp": _no_step_clamp,
    "no-d-skip": _no_d_skip,
    "no-conv-bias": _no_conv_bias,
    "norm-over-all-channels": _norm_over_all_channels,
    "mlp-relu-not-squared": _mlp_relu_not_squared,
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_gate_fails_with_a_feature_switched_off(mutation, monkeypatch):
    """The registered tiny config reaches each feature: with it switched off in the archon model, the
    gate fails (the step-size clamp binds on some tokens, the norm's groups differ from one group)."""
    from archon.tools import align

    build_model_ = align.build_model

    def build_and_switch_off(*args, **kwargs):
        loaded = build_model_(*args, **kwargs)
        MUTATIONS[mutation](loaded.model, monkeypatch)
        return loaded

    monkeypatch.setattr(align, "build_model", build_and_switch_off)
    assert_gate_fails(MODEL_TYPE, {}, seq_lens=SEQ_LENS)


def test_tp2_fsdp2_and_ep2_match_one_process(tiny_checkpoint, tmp_path):
    """TP x2, FSDP2 x2 and EP x2 (the MoE block's routed experts split over the ranks) against one
    process on the registered tiny config, and TP x2 on the attention-first config with every bias;
    float32 (the dense families' worker with an ep2 layout), one launch for all. (TP x2 in float64:
    the gate's `--all`, archon.tools.align_tp.)"""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from archon.rollout.vllm_network import free_port

    port = free_port("127.0.0.1")
    hf_dir = str(tiny_checkpoint(MODEL_TYPE))
    biases_dir = str(tiny_checkpoint(MODEL_TYPE, **CASES["attention-first-biases"]))
    out = tmp_path / "results.json"
    worker = Path(__file__).with_name("nemotron_h_parallel_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd += [str(worker), str(out), f"{hf_dir}@tp2,fsdp2,ep2", f"{biases_dir}@tp2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    assert sorted(results[hf_dir]) == ["ep2", "fsdp2", "tp2"], results
    assert sorted(results[biases_dir]) == ["tp2"], results
    for checkpoint, layouts in results.items():
        for layout, figures in layouts.items():
            # float64 against float64 (the worker runs inside fp32_islands_in_fp64)
            assert max(figures.values()) <= 1e-10, (checkpoint, layout, figures)


@pytest.mark.parametrize(
    "field, value",
    [
        ("attention_bias", True),
        ("sliding_window", 4),
        ("time_step_limit", [0.0, 0.5]),
        ("tie_word_embeddings", True),
        ("residual_in_fp32", True),
        ("hidden_dropout", 0.5),
        ("mamba_proj_bias", True),
        ("expand", 7),
        ("n_shared_experts", 3),
        ("moe_shared_expert_overlap", False),
    ],
)
def test_fields_declared_inert_do_not_move_hf(field, value):
    """The fields the ModelSpec declares inert because HF ignores them: flipped in HF, the same weights
    load (no parameter added or dropped) and give the same logits."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(_config()).eval()
    flipped = AutoModelForCausalLM.from_config(_config(**{field: value})).eval()
    flipped.load_state_dict(reference.state_dict(), strict=True)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(flipped(tokens).logits, reference(tokens).logits, rtol=0, atol=0)
