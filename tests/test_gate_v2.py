"""Gate v2 (archon.tools.align.run_gate): the config variants that exercise each boolean or enumerated
field both ways, bfloat16 against HF (end to end within the measured floor, each norm bit for bit), the
generation cache against the full forward, TP x2, and failures as named lines, never tracebacks."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import archon.tools.align as align
from archon.models.common.norms import RMSNorm
from archon.tools.align import AlignArgs, main, run_alignment, run_gate
from archon.tools.align_variants import config_variants

SEQ_LENS = (7, 1, 13)


def test_variants_flip_every_flag_the_family_reads():
    variants, refused = config_variants("glm4", {})
    assert list(variants)[0] == "tiny"
    assert set(variants) == {"tiny", "attention_bias=False", "tie_word_embeddings=True", "partial_rotary_factor=1.0"}
    assert variants["tie_word_embeddings=True"] == {"tie_word_embeddings": True}
    # a value the family refuses by name is listed with the family's reason, not checked
    assert "hidden_act" in refused["hidden_act=gelu_pytorch_tanh"]
    moe, _ = config_variants("qwen3_moe", {})
    assert "norm_topk_prob=False" in moe


def test_gate_v2_passes_a_correct_port_and_names_every_run(capsys):
    args = AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, variants=True, generation=True, extra_dtypes=("bfloat16",))
    result = run_gate(args)
    assert result["pass"], result["failures"]
    runs = [(r["config"], r["dtype"]) for r in result["reports"]]
    assert runs[:2] == [("tiny", "float32"), ("tiny", "bfloat16")]
    assert ("tie_word_embeddings=True", "float32") in runs
    tiny = result["reports"][0]
    assert tiny["cache_greedy_mismatches"] == 0 and tiny["cache_max_abs_logprob_diff"] < 1e-4
    bf16 = result["reports"][1]
    assert bf16["bf16_norms_compared"] == 9 and bf16["bf16_norm_max_abs_diff"] == 0.0


def _mutated_build(monkeypatch, mutate):
    build = align.build_model

    def mutated(*args, **kwargs):
        loaded = build(*args, **kwargs)
        mutate(loaded.model)
        return loaded

    monkeypatch.setattr(align, "build_model", mutated)


def test_an_ignored_flag_fails_in_its_variant_as_a_named_line(monkeypatch):
    """A port that always builds an untied head passes the registered (untied) config and fails the
    tied variant, by name and with the reason, not with a traceback."""
    from archon.models.glm4.args import Glm4Args

    read = Glm4Args.from_hf_config.__func__

    def untied(cls, config):
        return dataclasses.replace(read(cls, config), tie_word_embeddings=False)

    monkeypatch.setattr(Glm4Args, "from_hf_config", classmethod(untied))
    result = run_gate(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, variants=True))
    assert not result["pass"]
    (line,) = result["failures"]
    assert line.startswith("tie_word_embeddings=True/float32 error: KeyError:") and "lm_head.weight" in line


def test_norm_weight_multiplied_in_the_wrong_dtype_order_fails_in_bf16(monkeypatch):
    def scale_in_fp32(model):
        for module in model.modules():
            if isinstance(module, RMSNorm):
                module.scale_in_fp32 = True

    _mutated_build(monkeypatch, scale_in_fp32)
    assert run_alignment(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS))["pass"]  # fp32 cannot tell
    report = run_alignment(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, dtype="bfloat16"))
    assert report["failures"] == ["bf16_norm_max_abs_diff"]
    assert report["bf16_norm_max_abs_diff"] > 0


def test_a_lora_module_without_gradient_is_a_named_failure(monkeypatch):
    """Before: `lora_to_peft(name, None)` raised a TypeError inside the gate."""

    def skip_last_down_proj_lora(model):
        down = model.layers[-1].mlp.down_proj
        down.forward = lambda x: torch.nn.functional.linear(x, down.weight)

    _mutated_build(monkeypatch, skip_last_down_proj_lora)
    report = run_alignment(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, lora_rank=4))
    assert "lora_params_without_grad" in report["failures"]
    assert report["lora_params_without_grad"] == [
        "layers.1.mlp.down_proj.lora_a.weight",
        "layers.1.mlp.down_proj.lora_b.weight",
    ]


def test_generation_cache_that_loses_a_step_fails(monkeypatch):
    from archon.rollout.kv_cache import LayerKVCache

    attention = LayerKVCache.attention

    def forgetful(self, q, k, v, *args, **kwargs):
        return attention(self, q, torch.zeros_like(k), v, *args, **kwargs)

    monkeypatch.setattr(LayerKVCache, "attention", forgetful)
    report = run_alignment(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, generation=True))
    assert "cache_max_abs_logprob_diff" in report["failures"], report["failures"]


def test_cli_prints_a_fail_line_not_a_traceback(monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise KeyError("checkpoint does not match the model: missing 'model.norm.weight'")

    monkeypatch.setattr(align, "build_model", broken)
    assert main(["--model-type", "glm4", "--seq-lens", "7", "1"]) == 1
    out = capsys.readouterr().out
    assert "FAIL float32 error: KeyError:" in out and "model.norm.weight" in out and "Traceback" not in out
    assert main(["--model-type", "glm4", "--seq-lens", "7", "1", "--variants"]) == 1
    out = capsys.readouterr().out
    assert "FAIL tiny/float32 error: KeyError:" in out and "FAIL tie_word_embeddings=True/float32 error" in out


def test_bf16_refuses_lora_by_name():
    with pytest.raises(ValueError, match="--dtype bfloat16 compares the base model"):
        run_alignment(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, dtype="bfloat16", lora_rank=4))


def test_reused_references_give_the_same_report():
    args = AlignArgs(model_type="glm4", seq_lens=SEQ_LENS)
    plain = run_alignment(args)
    with align.reuse_hf_references():
        first, again = run_alignment(args), run_alignment(args)
    for report in (first, again):
        assert report["max_abs_logits_diff"] == plain["max_abs_logits_diff"]


@pytest.mark.slow
def test_tp2_in_the_gate():
    result = run_gate(AlignArgs(model_type="glm4", seq_lens=SEQ_LENS, tp=2))
    assert result["pass"], result["failures"]
    assert result["tp"]["tp2_grad_max_rel"] < 1e-10 and result["tp"]["tp2_lora_params_without_grad"] == []
