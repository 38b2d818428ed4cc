"""Qwen3.5 / Qwen3.6 (qwen3_5, qwen3_5_moe and their text configs) against HF transformers and PEFT:
gated DeltaNet and gated attention layers mixed, several value heads per key head, partial rotary,
the MoE's gated shared expert, LoRA on every projection, text-only and vision-language checkpoints,
packed sequences longer than a delta-rule chunk, and generation with the recurrent cache."""

import json

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

from archon.build import build_model
from archon.checkpoint.hf_weights import save_merged_hf
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import ADAPTER_CONFIG, ADAPTER_WEIGHTS, save_peft_adapter
from archon.models.common.linear_attention import DELTA_RULE_CHUNK_SIZE, chunked_gated_delta_rule
from archon.tools.align import packed_batch

# One sequence longer than a chunk of the chunked delta rule, one of a single token.
SEQ_LENS = (7, 1, 13, DELTA_RULE_CHUNK_SIZE + 6)

CASES = {
    # The registered tiny configs: layers linear, full, linear; 2 value heads per key head; RoPE on a
    # quarter of each head; MoE with 8 experts, top-2 and a gated shared expert.
    "text": ("qwen3_5_text", {}),
    "moe-text": ("qwen3_5_moe_text", {}),
    # Vision-language composites laid out as released (model.language_model.*, model.visual.*).
    "vision-language": ("qwen3_5", {}),
    "moe-vision-language": ("qwen3_5_moe", {}),
    # A tied head, as the small Qwen3.5 checkpoints have: HF's composite ties by the top-level flag.
    "vision-language-tied": ("qwen3_5", dict(tie_word_embeddings=True)),
    # Full attention first, one value head per key head, RoPE on half of each head, q/k/v/o bias,
    # tied head.
    "full-first-tied-bias": (
        "qwen3_5_text",
        dict(
            layer_types=["full_attention", "linear_attention", "linear_attention"],
            linear_num_value_heads=2,
            attention_bias=True,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        ),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_parity_lora_and_peft_export(case):
    model_type, overrides = CASES[case]
    assert_aligned(model_type, overrides, lora_rank=8, seq_lens=SEQ_LENS)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe"])
def test_state_dict_round_trip(model_type, tiny_checkpoint):
    assert_state_dict_round_trip(tiny_checkpoint(model_type))


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_meta_weights_complete(model_type):
    assert_meta_weights_complete(model_type, {})


def _naive_gated_delta_rule(q, k, v, g, beta, state):
    """Token by token: S = exp(g) S; S += k (beta (v - S^T k))^T; o = S^T q. Shapes as the chunked one."""
    outputs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        k_t = k[:, :, t]
        delta = beta[:, :, t][..., None] * (v[:, :, t] - (state * k_t[..., None]).sum(-2))
        state = state + k_t[..., None] * delta[..., None, :]
        outputs.append((state * q[:, :, t][..., None]).sum(-2))
    return torch.stack(outputs, dim=2), state


@pytest.mark.parametrize("length", [1, 5, DELTA_RULE_CHUNK_SIZE, 2 * DELTA_RULE_CHUNK_SIZE + 3])
def test_chunked_delta_rule_equals_the_recurrence(length):
    """The chunked (WY) form against the delta rule written out per token, from a non-zero state."""
    g_ = torch.Generator().manual_seed(length)
    n, h, dk, dv = 2, 3, 8, 4
    q = torch.nn.functional.normalize(torch.randn(n, h, length, dk, generator=g_), dim=-1) * dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(n, h, length, dk, generator=g_), dim=-1)
    v = torch.randn(n, h, length, dv, generator=g_)
    g = -torch.rand(n, h, length, generator=g_)
    beta = torch.rand(n, h, length, generator=g_)
    state = torch.randn(n, h, dk, dv, generator=g_)
    o, final = chunked_gated_delta_rule(q, k, v, g, beta, state)
    o_ref, final_ref = _naive_gated_delta_rule(q, k, v, g, beta, state)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(final, final_ref, rtol=0, atol=1e-5)


def test_no_state_leaks_across_packed_sequences(tiny_checkpoint):
    """A sequence's logits and gradients are the same alone and packed after another one (of a
    different content each time): the conv window and the recurrent state restart at each boundary."""
    model = build_model(tiny_checkpoint("qwen3_5_text"), lora=LoRAConfig(rank=4, alpha=8)).model
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    assert_no_state_leaks_across_packed_sequences(model, DELTA_RULE_CHUNK_SIZE + 9, (3, DELTA_RULE_CHUNK_SIZE + 20))


def test_vision_language_export_keys_and_merged_checkpoint(tiny_checkpoint, lora_model, tmp_path):
    """From a vision-language checkpoint: the adapter is keyed for the full composite model, and the
    merged export keeps the vision tower as it was, loads into HF's composite model with no missing or
    unexpected weight and gives the adapted model's logits."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    path = tiny_checkpoint("qwen3_5")
    lora = LoRAConfig(rank=4, alpha=8)
    loaded = lora_model(path, lora)
    save_peft_adapter(loaded.model, loaded.converter, lora, tmp_path / "adapter", str(path))
    with safe_open(str(tmp_path / "adapter" / ADAPTER_WEIGHTS), "pt") as f:
        keys = list(f.keys())
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys), keys[:3]
    assert any(".linear_attn.in_proj_a.lora_A" in k for k in keys)
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj"} <= set(config["target_modules"])

    save_merged_hf(loaded.model, loaded.converter, tmp_path / "merged", loaded.hf_config.to_dict(), path)
    original = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32)
    merged, info = AutoModelForImageTextToText.from_pretrained(
        tmp_path / "merged", dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    visual = dict(original.model.visual.named_parameters())
    for name, param in merged.model.visual.named_parameters():
        assert torch.equal(param, visual[name]), name
    seqs, tokens, positions, cu_seqlens = packed_batch((9,), 256, seed=0)
    with torch.no_grad():
        expected = loaded.model.eval()(tokens, positions, cu_seqlens, 9)
        torch.testing.assert_close(merged.eval()(seqs[0][None]).logits[0], expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe"])
def test_native_greedy_equals_hf_generate(tiny_checkpoint, model_type):
    """Greedy generation through the per-sequence cache (KV for attention layers, conv window and
    recurrent state for DeltaNet layers) gives HF's greedy tokens; a prompt longer than a chunk too."""
    prompts = [[3, 17, 42, 9, 250], [7], list(range(100, 100 + DELTA_RULE_CHUNK_SIZE + 5))]
    assert_native_greedy_equals_hf_generate(tiny_checkpoint(model_type), prompts)


def test_native_logprobs_equal_the_trainers(tiny_checkpoint):
    """Rollout log-probs equal Trainer.logprobs on the same tokens (sampled, with LoRA)."""
    from archon.batch import PackedBatch
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(model_path=str(tiny_checkpoint("qwen3_5_moe")), lora=LoRAConfig(rank=4, alpha=8)))
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


def test_bad_layer_types_are_refused():
    from transformers import AutoConfig

    from archon.models.qwen3_5.args import Qwen3_5Args

    config = AutoConfig.for_model(
        "qwen3_5_text", num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]
    )
    with pytest.raises(ValueError, match=r"layer_types holds \[.sliding_attention.\]"):
        Qwen3_5Args.from_hf_config(config)
    config = AutoConfig.for_model("qwen3_5_text", linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(ValueError, match=r"linear_num_value_heads \(4\) must be a multiple of"):
        Qwen3_5Args.from_hf_config(config)


# Two layers, one of each type: the fp32 rounding noise of these random-weight models grows with
# depth (the three-layer tiny model's hidden states differ from its own fp64 run by 2e-5), and two
# layers keep it under the 1e-5 contract, while a wrong sharding moves the outputs by O(1).
_PARALLEL_TEXT = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
PARALLEL_CASES = {"text": "qwen3_5_text", "moe-vision-language": "qwen3_5_moe"}


@pytest.mark.slow
def test_parallel_layouts_match_one_process(tiny_checkpoint, tmp_path):
    """TP x2 and FSDP2 x2 (gloo, two processes) give the single-process hidden states, label
    log-probs and LoRA gradients: DeltaNet heads sharded by key head with their value heads, conv
    channels, dt_bias and A_log with them, the gated norm on local heads; gated attention heads with
    their output gates; the MoE shared expert's intermediate dimension."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).with_name("dense_parallel_worker.py")
    dirs = {case: str(tiny_checkpoint(model_type, **_PARALLEL_TEXT)) for case, model_type in PARALLEL_CASES.items()}
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(out),
        *(f"{d}@tp2,fsdp2" for d in dirs.values()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for case, hf_dir in dirs.items():
        for layout in ("tp2", "fsdp2"):
            figures = results[hf_dir][layout]
            # float64 against float64 (the worker runs inside fp32_islands_in_fp64)
            assert figures["hidden_max_abs"] <= 1e-10, (case, layout, figures)
            assert figures["logprob_max_abs"] <= 1e-10, (case, layout, figures)
            assert figures["grad_max_rel"] <= 1e-10, (case, layout, figures)
