"""archon vs HF transformers (and PEFT), for Qwen3 and Qwen3-MoE configurations.

Both sides compute the same math, so the gate runs in float64 with fp32 islands kept in fp64 (its
float64 tolerances: logits and log-probs 1e-9, mean KL 1e-15, LoRA gradients 1e-9 relative), as do
archon's packed and per-sequence forwards. Measured on these cases: logits at most 7.8e-15 apart,
LoRA gradients 3.5e-15 relative."""

import json

import pytest
import torch
from helpers import assert_close_reporting

from archon.precision import fp32_islands_in_fp64
from archon.spec import get_spec, supported_model_types
from archon.tools.align import AlignArgs, run_alignment

QWEN3_CASES = {
    "untied-gqa2": {},
    "tied-mha": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "mqa-odd-dims": dict(num_attention_heads=6, num_key_value_heads=1, head_dim=8, hidden_size=48),
    "yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        }
    ),
    "linear-rope-bias": dict(
        rope_parameters={"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}, attention_bias=True
    ),
}
QWEN3_MOE_CASES = {
    "topk-norm": {},
    "no-norm-sparse-step": dict(norm_topk_prob=False, decoder_sparse_step=2, num_hidden_layers=3),
    "mlp-only-layers-tied": dict(mlp_only_layers=[1], tie_word_embeddings=True),
}


def _check(report, lora: bool):
    case = f"{report['model_type']} {report['config_overrides']}"
    assert report["dtype"] == "float64", f"{case}: run in {report['dtype']}"
    assert ("lora_grad_max_rel_err" in report["tolerances"]) == lora, sorted(report["tolerances"])
    beyond = {
        name: f"{report[name]:.3e} > {tol:.1e}" for name, tol in report["tolerances"].items() if not report[name] <= tol
    }
    assert not beyond, f"{case}: {beyond}"
    if lora:
        assert report["peft_missing_keys"] == [] and report["peft_unexpected_keys"] == [], report
        effect = report["lora_effect_max_abs"]
        assert effect > 1e-3, f"{case}: the adapter changes the logits by {effect:.3e}"
    assert report["pass"], f"{case}: {report['failures']}"


@pytest.mark.parametrize("case", sorted(QWEN3_CASES))
def test_qwen3_parity(case):
    report = run_alignment(
        AlignArgs(
            model_type="qwen3",
            config_overrides=QWEN3_CASES[case],
            lora_rank=4 if case != "yarn" else None,
            seq_lens=(9, 1, 16, 31),
            dtype="float64",
        )
    )
    _check(report, lora=case != "yarn")


@pytest.mark.parametrize("case", sorted(QWEN3_MOE_CASES))
def test_qwen3_moe_parity(case):
    # Dense MLP layers beside stacked experts: their LoRA is exported as PEFT target_parameters.
    report = run_alignment(
        AlignArgs(
            model_type="qwen3_moe",
            config_overrides=QWEN3_MOE_CASES[case],
            lora_rank=8,
            seq_lens=(5, 12, 1, 23),
            dtype="float64",
        )
    )
    _check(report, lora=True)


def test_packed_equals_separate_archon_forwards(tiny_checkpoint):
    """One packed forward equals archon's own per-sequence forwards: no attention across boundaries."""
    from archon.build import build_model
    from archon.tools.align import packed_batch

    model = build_model(tiny_checkpoint("qwen3"), dtype=torch.float64).model.eval()
    seqs, tokens, positions, cu_seqlens = packed_batch((4, 9, 1, 6), 256, seed=3)
    with torch.no_grad(), fp32_islands_in_fp64():
        packed = model(tokens, positions, cu_seqlens, 9)
        separate = torch.cat([model(s, torch.arange(len(s)), torch.tensor([0, len(s)]), len(s)) for s in seqs])
    # measured 5.1e-15
    assert_close_reporting(packed, separate, 1e-10, "logits, packed against per-sequence forwards")


def test_hf_path_alone_reads_the_model_type(tiny_checkpoint, capsys):
    from archon.tools.align import main

    path = tiny_checkpoint("qwen3")
    assert main(["--hf-path", str(path), "--dtype", "float64"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["model_type"] == "qwen3" and report["hf_path"] == str(path) and report["pass"]


def test_single_kind_per_layer_patterns_are_named():
    """A tiny config whose per-layer pattern has one kind cannot catch a port that treats the kinds
    alike; the gate names such patterns (and warns)."""
    from transformers import AutoConfig

    from archon.tools.align import single_kind_patterns, tiny_config_kwargs

    def patterns(model_type, **overrides):
        return single_kind_patterns(AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, **overrides)))

    assert patterns("qwen3_moe", mlp_only_layers=[]) == ["decoder_sparse_step / mlp_only_layers (every layer sparse)"]
    assert patterns("qwen3_moe", mlp_only_layers=[0]) == []
    assert patterns("qwen3", use_sliding_window=False) == ["layer_types (every layer 'full_attention')"]
    assert patterns("qwen2", use_sliding_window=False) == ["layer_types (every layer 'full_attention')"]
    assert patterns("qwen3_5") == []
    assert patterns("qwen3_5", layer_types=["linear_attention"] * 3) == ["layer_types (every layer 'linear_attention')"]
    assert patterns("glm4_moe", first_k_dense_replace=0, num_hidden_layers=2) == ["first_k_dense_replace=0 of 2 layers"]
    # every list field named *_types with an entry per layer is a pattern (GLM-5's indexer_types) ...
    assert "indexer_types (every layer 'full')" in patterns("glm_moe_dsa", indexer_types=["full"] * 3)
    # ... but the one the family declares single-kind by definition (every layer 'indexed_attention')
    config = AutoConfig.for_model("glm_moe_dsa", **tiny_config_kwargs("glm_moe_dsa"))
    assert single_kind_patterns(config) == ["layer_types (every layer 'indexed_attention')"]
    assert single_kind_patterns(config, get_spec("glm_moe_dsa").one_kind_layer_patterns) == []


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_tiny_config_holds_both_kinds_of_each_per_layer_pattern(model_type):
    """The gate's tiny config of every registered model_type has both kinds of each per-layer pattern
    (sliding and full attention, dense and sparse MLP, ...), so the gate can catch a port that treats
    them alike."""
    from transformers import AutoConfig

    from archon.tools.align import single_kind_patterns, tiny_config_kwargs

    config = AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type))
    assert single_kind_patterns(config, get_spec(model_type).one_kind_layer_patterns) == []


def test_qwen3_moe_sliding_window_is_refused():
    """HF's Qwen3-MoE config has no layer_types and slides every layer under use_sliding_window; archon
    does not implement that and says which field."""
    from transformers import AutoConfig

    from archon.models.qwen3.args import Qwen3Args
    from archon.tools.align import tiny_config_kwargs

    config = AutoConfig.for_model("qwen3_moe", **tiny_config_kwargs("qwen3_moe", use_sliding_window=True))
    with pytest.raises(ValueError, match=r"config.use_sliding_window=True is not supported for 'qwen3_moe'"):
        Qwen3Args.from_hf_config(config)


def test_special_tokens_outside_the_tiny_vocabulary_are_dropped(tmp_path):
    from archon.tools.align import make_tiny_hf_checkpoint

    with pytest.warns(UserWarning, match=r"pad_token_id=999 lies outside its vocabulary of 256"):
        path = make_tiny_hf_checkpoint("llama", tmp_path / "hf", pad_token_id=999, eos_token_id=[2, 300])
    config = json.loads((path / "config.json").read_text())
    assert config["pad_token_id"] is None and config["eos_token_id"] == [2]
