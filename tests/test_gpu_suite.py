"""The GPU readiness suite at tiny sizes on the CPU (so it cannot rot), its isolation of failing
checks, and the flash varlen attention call across torch releases."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
SUITE = REPO_ROOT / "benchmarks" / "gpu_suite.py"


def _suite_module():
    spec = importlib.util.spec_from_file_location("gpu_suite", SUITE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_suite"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_tiny_suite_passes_every_check(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(SUITE), "--tiny", "--out", str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.stdout.strip(), proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {name: check for name, check in result["checks"].items() if not check["pass"]}
    assert not failed, json.dumps(failed, indent=1)[-6000:]
    assert result["pass"] and proc.returncode == 0, proc.stderr[-4000:]
    assert set(result["checks"]) == {
        "alignment",
        "train",
        "generation",
        "memory",
        "throughput",
        "moe",
        "offload",
        "prefill",
        "quantized",
        "rollout_systems",
    }
    assert result["mode"] == "tiny-cpu"

    checks = result["checks"]
    from archon.spec import supported_model_types

    assert set(checks["alignment"]["families"]) == set(supported_model_types())
    for family in checks["alignment"]["families"].values():
        assert family["fp32_max_abs_logits_diff"] <= 1e-4 and family["bf16_mean_kl"] > 0
    for family in checks["train"]["families"].values():
        assert family["dtype"] == "bfloat16" and family["losses"][-1] < family["losses"][0]
    assert all(f["greedy_tokens_equal_hf"] for f in checks["generation"]["families"].values())
    assert checks["memory"]["unchunked_peak_mb_at_small"] > checks["memory"]["peak_mb"][1]
    assert checks["throughput"]["tokens_per_s"] > 0 and 0 < checks["throughput"]["mfu"]
    moe = checks["moe"]
    assert moe["tokens_per_s"] > 0 and 0 < moe["mfu"] and moe["grouped_speedup_over_loop"] > 0
    for parity in moe["grouped_vs_loop"].values():  # grouped GEMM ran and matched the loop
        assert parity["grouped_mm_calls"] > 0 and "gate_up_proj_lora.lora_a" in parity["compared"]
    offload = checks["offload"]
    assert offload["grads_equal"] and offload["tensors_offloaded_per_step"] > 0 and offload["saved_peak_ratio"] < 1
    prefill = checks["prefill"]  # one forward against several of at most the budget, the same samples
    assert prefill["prefill_forwards"][0] == 1 and prefill["prefill_forwards"][1] > 1
    assert (
        prefill["largest_forward_tokens"][1] <= prefill["prefill_chunk_tokens"] < prefill["largest_forward_tokens"][0]
    )
    assert prefill["greedy_tokens_equal"]
    quantized = checks["quantized"]["formats"]  # both formats trained and sampled on the kept-quantized base
    assert set(quantized) == {"fp8", "mxfp4"}
    for fmt in quantized.values():
        assert fmt["greedy_tokens_equal"] and fmt["lora_grads_checked"] > 0 and not fmt["bad_lora_grads"]
        assert fmt["base_param_bytes_ratio"] < 1
        assert fmt["first_loss_rel_diff"] <= checks["quantized"]["loss_rtol_kept_vs_dequantized"]

    replay = checks["rollout_systems"]["parts"]["replay"]  # the bf16 sampler's routing, replayed in fp32
    assert replay["tokens"] > 0 and replay["max_gap_no_flip"]["replay"] == replay["max_gap_no_flip"]["own"]
    speculative = checks["rollout_systems"]["parts"]["speculative"]
    assert (
        speculative["qwen3_self_draft"]["acceptance"] == 1.0 and speculative["deepseek_v3_mtp"]["greedy_tokens_equal"]
    )
    assert checks["rollout_systems"]["parts"]["partial"]["token_versions_exact"]

    assert json.loads((out / "gpu_suite.json").read_text()) == result
    log = (out / "gpu_suite.log").read_text()
    assert all(f"{name}: PASS" in log for name in result["checks"])


def test_a_failing_check_is_recorded_and_the_others_still_run(tmp_path, monkeypatch):
    suite = _suite_module()

    def broken(ctx):
        raise RuntimeError("deliberately broken check")

    monkeypatch.setitem(suite.CHECK_FNS, "alignment", broken)
    result = suite.run_suite(suite.SuiteArgs(out=str(tmp_path), tiny=True, only=("alignment", "memory")))
    assert result["pass"] is False
    assert result["checks"]["alignment"] == {
        "pass": False,
        "error": "RuntimeError: deliberately broken check",
        "seconds": result["checks"]["alignment"]["seconds"],
    }
    assert result["checks"]["memory"]["pass"] is True


def test_suite_arguments_are_checked():
    suite = _suite_module()
    with pytest.raises(ValueError, match="unknown check.*bogus"):
        suite.run_suite(suite.SuiteArgs(only=("memory", "bogus"), tiny=True))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a CUDA device.*--tiny"):
            suite.run_suite(suite.SuiteArgs())


def test_throughput_lengths_and_flops():
    suite = _suite_module()
    lengths = suite.throughput_lengths(16384, 16, seed=0)
    assert sum(lengths) == 16384 and len(lengths) == 16
    assert max(lengths) / min(lengths) == pytest.approx(8, rel=0.05)
    # One layer, one 4-token sequence, no LoRA: 4 FLOPs per frozen weight per token, causal
    # attention 3 x 2 L^2 H hd, a head of 4 D V per loss token.
    config = dict(
        hidden_size=8,
        intermediate_size=16,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
        num_hidden_layers=1,
        vocab_size=32,
    )
    linear = 8 * 2 * 4 * 2 + 8 * 1 * 4 * 2 + 3 * 8 * 16
    expected = 4 * 4 * linear + 3 * 2 * 16 * 2 * 4 + 3 * 4 * 8 * 32
    assert suite.train_step_flops(config, [4], loss_tokens=3, lora_rank=0) == expected
    # MoE: per token the attention projections, the router (D x E) and k experts of 3 D I each.
    moe = dict(config, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6)
    attention, router, experts = 8 * 2 * 4 * 2 + 8 * 1 * 4 * 2, 8 * 4, 2 * 3 * 8 * 6
    expected = 4 * 4 * (attention + router + experts) + 3 * 2 * 16 * 2 * 4 + 3 * 4 * 8 * 32
    assert suite.moe_train_step_flops(moe, [4], loss_tokens=3, lora_rank=0) == expected


# ---- the flash varlen call across torch releases --------------------------------------------------


def _fake_varlen(with_enable_gqa: bool, calls: list):
    """A stand-in for torch.nn.attention.varlen.varlen_attn with the 2.10/2.11 signature (no
    enable_gqa) or the 2.12+ one; it records its arguments and returns zeros of the output shape."""

    def record(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs):
        calls.append(dict(cu_seq_q=cu_seq_q, cu_seq_k=cu_seq_k, max_q=max_q, max_k=max_k, **kwargs))
        return query.new_zeros(query.shape[0], query.shape[1], value.shape[2])

    if with_enable_gqa:

        def varlen_attn(
            query,
            key,
            value,
            cu_seq_q,
            cu_seq_k,
            max_q,
            max_k,
            *,
            return_aux=None,
            scale=None,
            window_size=(-1, -1),
            enable_gqa=False,
        ):
            return record(
                query,
                key,
                value,
                cu_seq_q,
                cu_seq_k,
                max_q,
                max_k,
                scale=scale,
                window_size=window_size,
                enable_gqa=enable_gqa,
            )
    else:

        def varlen_attn(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1)
        ):
            return record(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    return varlen_attn


@pytest.mark.parametrize("with_enable_gqa", [False, True], ids=["torch-2.11", "torch-2.12+"])
@pytest.mark.parametrize("sliding_window", [None, 3])
def test_flash_varlen_call_fits_the_installed_signature(monkeypatch, with_enable_gqa, sliding_window):
    from torch.nn.attention import varlen

    from archon.models.common import attention

    calls: list = []
    fake = _fake_varlen(with_enable_gqa, calls)
    assert ("enable_gqa" in inspect.signature(fake).parameters) == with_enable_gqa
    monkeypatch.setattr(varlen, "varlen_attn", fake)
    monkeypatch.setattr(attention, "_flash_varlen_usable", lambda q: True)  # the CUDA bf16 branch, on CPU
    attention._varlen_takes_enable_gqa.cache_clear()  # it inspects the signature once per process
    try:
        q, k, v = torch.randn(12, 4, 8), torch.randn(12, 2, 8), torch.randn(12, 2, 6)
        cu_seqlens = torch.tensor([0, 5, 12])
        out = attention.packed_attention(q, k, v, cu_seqlens, 7, 0.125, sliding_window=sliding_window)
    finally:
        attention._varlen_takes_enable_gqa.cache_clear()
    assert out.shape == (12, 4, 6)
    (call,) = calls
    assert call["cu_seq_q"].dtype == torch.int32 and call["cu_seq_q"].tolist() == [0, 5, 12]
    assert call["max_q"] == call["max_k"] == 7 and call["scale"] == 0.125
    assert call["window_size"] == ((-1, 0) if sliding_window is None else (2, 0))
    if with_enable_gqa:
        assert call["enable_gqa"] is True
    else:
        assert "enable_gqa" not in call
