"""Kimi Linear (kimi_linear) against HF transformers and PEFT: Kimi Delta Attention (per-channel
decay, short convs, sigmoid-gated output norm) and NoPE MLA layers mixed, dense and MoE layers
(group-limited sigmoid routing, shared experts), LoRA on every projection, packed sequences longer
than a delta-rule chunk, the chunked rule against the recurrence, and the refused config values."""

import pytest
import torch
import torch.nn.functional as F
from family_checks import (
    assert_aligned,
    assert_meta_weights_complete,
    assert_state_dict_round_trip,
)
from helpers import assert_no_state_leaks_across_packed_sequences, randomise_lora

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.models.common.linear_attention import DELTA_RULE_CHUNK_SIZE, chunked_gated_delta_rule

MODEL_TYPE = "kimi_linear"
# One sequence longer than a chunk of the chunked delta rule, one of a single token.
SEQ_LENS = (7, 1, 13, DELTA_RULE_CHUNK_SIZE + 6)

CASES = {
    # The registered tiny config: layers KDA, MLA, KDA; dense then two MoE layers (4 groups of 2
    # experts, 2 groups allowed, top-2, scaling 2.5, one shared expert); no query bottleneck.
    "registered": {},
    # MLA first, with a query bottleneck and biased q_a_proj / kv_a_proj_with_mqa / o_proj; the dense
    # layer between two MoE layers; one expert group, top-3 without renormalisation, two shared
    # experts; a conv of 3 taps; another norm eps.
    "mla-first-q-lora-bias": dict(
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        mlp_layer_types=["sparse", "dense", "sparse"],
        q_lora_rank=32,
        attention_bias=True,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        n_shared_experts=2,
        linear_conv_kernel_dim=3,
        rms_norm_eps=1e-6,
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


def _naive_kimi_delta_rule(q, k, v, g, beta, state):
    """Token by token: S = diag(exp(g)) S; S += k (beta (v - S^T k))^T; o = S^T q. g: [N, H, L, dk]."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None]
        k_t = k[:, :, t]
        delta = beta[:, :, t][..., None] * (v[:, :, t] - (state * k_t[..., None]).sum(-2))
        state = state + k_t[..., None] * delta[..., None, :]
        outputs.append((state * q[:, :, t][..., None]).sum(-2))
    return torch.stack(outputs, dim=2), state


@pytest.mark.parametrize("max_decay", [2.0, 60.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("length", [1, 5, DELTA_RULE_CHUNK_SIZE, 2 * DELTA_RULE_CHUNK_SIZE + 3])
def test_chunked_kimi_delta_rule_equals_the_recurrence(length, dtype, max_decay):
    """The chunked (WY) form with a per-channel decay against the rule written out per token, from a
    non-zero state; decays spread over channels so that a per-head decay could not pass, and strong
    enough (up to 60 per token, far past exp's range over a chunk) that no factor may overflow."""
    g_ = torch.Generator().manual_seed(length)
    n, h, dk, dv = 2, 3, 8, 4
    q = F.normalize(torch.randn(n, h, length, dk, generator=g_, dtype=dtype), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n, h, length, dk, generator=g_, dtype=dtype), dim=-1)
    v = torch.randn(n, h, length, dv, generator=g_, dtype=dtype)
    g = -torch.rand(n, h, length, dk, generator=g_, dtype=dtype) * torch.linspace(0.01, max_decay, dk, dtype=dtype)
    beta = torch.rand(n, h, length, generator=g_, dtype=dtype)
    state = torch.randn(n, h, dk, dv, generator=g_, dtype=dtype)
    o, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    o_ref, final_ref = _naive_kimi_delta_rule(q, k, v, g, beta, state)
    atol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(o, o_ref, rtol=0, atol=atol)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=atol)


def test_no_state_leaks_across_packed_sequences(tiny_checkpoint):
    """A sequence's logits and LoRA gradients are the same alone and packed after another one (of a
    different content each time): the conv windows and the recurrent state restart at each boundary."""
    model = build_model(tiny_checkpoint(MODEL_TYPE), lora=LoRAConfig(rank=4, alpha=8)).model
    g = torch.Generator().manual_seed(0)
    randomise_lora(lora_parameters(model), 0.1, g)
    assert_no_state_leaks_across_packed_sequences(model, DELTA_RULE_CHUNK_SIZE + 9, (3, DELTA_RULE_CHUNK_SIZE + 20))


# The mutation checks (each feature switched off fails the gate) are the kimi_linear cases of
# tests/models/test_feature_sensitivity.py.


def _config(**overrides):
    from transformers import AutoConfig

    from archon.tools.align import tiny_config_kwargs

    return AutoConfig.for_model(MODEL_TYPE, **tiny_config_kwargs(MODEL_TYPE, **overrides))


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(mla_use_nope=False), "mla_use_nope"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(n_shared_experts=0), "n_shared_experts"),
        (dict(layer_types=["linear_attention", "sliding_attention", "linear_attention"]), r"layer_types\[1\]"),
        (dict(tie_word_embeddings=True), "tie_word_embeddings"),
        (dict(kv_lora_rank=0), "kv_lora_rank"),
        (dict(moe_router_activation_func="softmax"), "moe_router_activation_func"),
        (dict(moe_layer_freq=2), "moe_layer_freq"),
        (dict(use_grouped_topk=False), "use_grouped_topk"),
        (dict(num_nextn_predict_layers=1), "num_nextn_predict_layers"),
        (dict(attention_dropout=0.1), "attention_dropout"),
    ],
)
def test_unsupported_config_is_refused(overrides, field):
    from archon.models.kimi_linear.args import KimiLinearArgs

    with pytest.raises(ValueError, match=field):
        KimiLinearArgs.from_hf_config(_config(**overrides))


def _released_layout(src, dst):
    """The tiny checkpoint as Moonshot's release lays it out: config.json with `linear_attn_config`
    (1-based layer lists), `first_k_dense_replace` and the fields its remote code reads, and the dense
    layer's MLP under `mlp.` (transformers' save_pretrained writes `block_sparse_moe.`)."""
    import json

    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    layer_types, mlp_layer_types = config.pop("layer_types"), config.pop("mlp_layer_types")
    first_dense = mlp_layer_types.index("sparse")
    config.update(
        linear_attn_config={
            "kda_layers": [i + 1 for i, t in enumerate(layer_types) if t == "linear_attention"],
            "full_attn_layers": [i + 1 for i, t in enumerate(layer_types) if t == "full_attention"],
            "head_dim": config.pop("linear_head_dim"),
            "num_heads": config.pop("linear_num_heads"),
            "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
        },
        first_k_dense_replace=first_dense,
        moe_layer_freq=1,
        moe_router_activation_func="sigmoid",
        use_grouped_topk=True,
        num_nextn_predict_layers=0,
        mla_use_nope=True,
        rope_theta=10000.0,
    )
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(src / "model.safetensors"))
    dense = tuple(f"model.layers.{i}.block_sparse_moe." for i in range(first_dense))
    renamed = {
        (key.replace(".block_sparse_moe.", ".mlp.") if key.startswith(dense) else key): t for key, t in tensors.items()
    }
    save_file(renamed, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_a_checkpoint_laid_out_as_released_aligns(tiny_checkpoint, tmp_path):
    from archon.tools.align import AlignArgs, run_alignment

    path = _released_layout(tiny_checkpoint(MODEL_TYPE), tmp_path / "released")
    report = run_alignment(AlignArgs(hf_path=str(path), lora_rank=4, seq_lens=SEQ_LENS))
    assert report["pass"] and report["unaccounted_config_fields"] == [], report


def test_checkpoint_and_in_memory_names(tiny_checkpoint):
    """The converter writes the names `save_pretrained` writes (block_sparse_moe, w1/w2/w3 experts,
    q/k/v_conv1d, the forget gate on self_attn), and reads a released checkpoint's dense `mlp` too."""
    from archon.models.kimi_linear.state_dict_converter import in_memory_name

    loaded = build_model(tiny_checkpoint(MODEL_TYPE))
    converter = loaded.converter
    names = {key for key, _ in converter.iter_to_hf((k, v) for k, v in loaded.model.state_dict().items())}
    assert "model.layers.0.self_attn.A_log" in names and "model.layers.0.self_attn.q_conv1d.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in names
    assert "model.layers.0.block_sparse_moe.gate_proj.weight" in names
    released = {"model.layers.0.mlp.gate_proj.weight"}
    assert converter.hf_sources("layers.0.mlp.gate_proj.weight", released) == ["model.layers.0.mlp.gate_proj.weight"]
    assert in_memory_name("model.layers.0.self_attn.f_b_proj.lora_A.weight") == (
        "model.layers.0.self_attn.forget_gate.f_b_proj.lora_A.weight"
    )


def test_native_logprobs_equal_the_trainers(tiny_checkpoint):
    """Rollout log-probs (KDA state and conv windows, MLA keys and values in the cache) equal
    Trainer.logprobs on the same tokens (sampled, with LoRA), a prompt longer than a chunk too."""
    from archon.batch import PackedBatch
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(model_path=str(tiny_checkpoint(MODEL_TYPE)), lora=LoRAConfig(rank=4, alpha=8)))
    randomise_lora(lora_parameters(trainer.model), 0.1)
    rollout = NativeRolloutEngine(trainer.model)
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + DELTA_RULE_CHUNK_SIZE + 5))]
    samples = rollout.generate(prompts, SamplingParams(max_new_tokens=6, temperature=0.8, n=2, seed=3))
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    expected = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout_lp = torch.tensor([lp for s in samples for lp in s.logprobs])
    torch.testing.assert_close(rollout_lp, expected, rtol=0, atol=1e-5)


def test_native_greedy_equals_hf_generate(tiny_checkpoint):
    """Greedy generation through the per-sequence cache (MLA keys and values; KDA conv windows and
    state) gives HF's greedy tokens, for a prompt longer than a delta-rule chunk too."""
    from transformers import AutoModelForCausalLM

    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine

    path = tiny_checkpoint(MODEL_TYPE, layer_types=["full_attention", "linear_attention", "linear_attention"])
    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeRolloutEngine(build_model(path).model)
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + DELTA_RULE_CHUNK_SIZE + 5))]
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=8, temperature=0))
    for prompt, sample in zip(prompts, samples):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt)),
                pad_token_id=0,
                eos_token_id=None,
            )
        assert sample.completion_ids == out[0, len(prompt) :].tolist()
