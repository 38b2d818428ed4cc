"""The alignment gate itself: it checks the path training takes (hidden states through the chunked
head), runs in fp64 with fp32 islands kept in fp64, reads config overrides from the command line,
and fails on HF config fields that a family neither reads nor declares inert."""

import math

import pytest
import torch
from transformers import AutoConfig

from archon.config_coverage import GENERIC_INERT_FIELDS, fields_read, unaccounted_fields
from archon.precision import fp32_islands_in_fp64
from archon.spec import ModelSpec, get_spec, supported_model_types
from archon.tools.align import (
    TOLERANCES,
    AlignArgs,
    main,
    parse_config_assignments,
    run_alignment,
    tiny_config_kwargs,
)

# ---- config coverage ---------------------------------------------------------------------------


def _configs_of(model_type):
    """The type's tiny config, and its config class's defaults where the family accepts them."""
    spec = get_spec(model_type)
    configs = {"tiny": AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type))}
    default = AutoConfig.for_model(model_type)
    try:
        spec.args_cls.from_hf_config(default)
        configs["default"] = default
    except ValueError:  # e.g. a default the family refuses by name (GLM-4.5's odd rotary width)
        pass
    return configs


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_config_field_is_read_or_declared_inert(model_type):
    """Each field of each registered type's config either reaches from_hf_config or is declared, with
    a reason, as one the math does not depend on. A new field that HF adds (or a family's port forgets)
    fails here by name."""
    spec = get_spec(model_type)
    for label, config in _configs_of(model_type).items():
        assert unaccounted_fields(spec, config) == [], (model_type, label)
    for field, reason in spec.inert_hf_config_fields.items():
        assert reason.strip(), (model_type, field)
        assert field not in GENERIC_INERT_FIELDS, (model_type, field)  # declared once


def test_a_field_nobody_reads_is_named():
    """A soft-cap that a port ignores, and a Gemma activation field that a SwiGLU family would have
    taken for silu: the first is listed as unaccounted, the second refused by name."""
    spec = get_spec("qwen3")
    config = AutoConfig.for_model("qwen3", **tiny_config_kwargs("qwen3"))
    config.final_logit_softcapping = 30.0
    assert unaccounted_fields(spec, config) == ["final_logit_softcapping"]
    config = AutoConfig.for_model("qwen3", **tiny_config_kwargs("qwen3"))
    config.hidden_activation = "gelu_pytorch_tanh"
    with pytest.raises(ValueError, match="config.hidden_activation='gelu_pytorch_tanh'"):
        spec.args_cls.from_hf_config(config)
    config = AutoConfig.for_model("qwen3", **tiny_config_kwargs("qwen3"), attention_dropout=0.1)
    with pytest.raises(ValueError, match="config.attention_dropout"):
        spec.args_cls.from_hf_config(config)


def test_reads_are_recorded_through_aliases_and_text_configs():
    """Qwen3-MoE reads `num_experts`, an alias of the stored `num_local_experts`; Qwen3.5 reads its
    fields through `get_text_config()` of a vision-language composite."""
    moe = AutoConfig.for_model("qwen3_moe", **tiny_config_kwargs("qwen3_moe"))
    assert {"num_experts", "num_local_experts"} <= fields_read(get_spec("qwen3_moe").args_cls, moe)
    composite = AutoConfig.for_model("qwen3_5", **tiny_config_kwargs("qwen3_5"))
    assert "linear_num_value_heads" in fields_read(get_spec("qwen3_5").args_cls, composite)


def test_the_gate_fails_on_an_unaccounted_field(monkeypatch):
    spec = get_spec("llama")
    # llama declares pretraining_tp inert; a spec without the declaration must fail the gate on it
    bare = ModelSpec(**{**spec.__dict__, "inert_hf_config_fields": {}})
    monkeypatch.setattr("archon.tools.align.get_spec", lambda model_type: bare)
    report = run_alignment(AlignArgs(model_type="llama", seq_lens=(5, 9)))
    assert report["unaccounted_config_fields"] == ["pretraining_tp"]
    assert report["failures"] == ["unaccounted_config_fields"]


def test_spec_keys_must_be_its_model_types():
    """A per-type table keyed by a type the family does not serve (a scaffold's rename gone wrong)
    is an error when the spec is made, naming the table and the key."""
    spec = get_spec("qwen3")
    with pytest.raises(ValueError, match=r"vllm_modes has keys \['qwen3_next_moe'\]"):
        ModelSpec(**{**spec.__dict__, "vllm_modes": {"qwen3_next_moe": "merged"}})


# ---- the training path -------------------------------------------------------------------------


def test_a_soft_cap_in_forward_only_fails_the_training_path_check(monkeypatch):
    """HF and archon both soft-cap their logits in `forward`, so the logits agree; archon's training
    path (hidden states through the chunked head) does not, and the gate names it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM

    from archon.models.common.decoder import PackedDecoderLM

    cap = 2.0
    hf_forward, archon_forward = Qwen3ForCausalLM.forward, PackedDecoderLM.forward

    def hf_capped(self, *args, **kwargs):
        out = hf_forward(self, *args, **kwargs)
        out.logits = cap * torch.tanh(out.logits / cap)
        return out

    def archon_capped(self, *args, **kwargs):
        out = archon_forward(self, *args, **kwargs)
        return out if kwargs.get("return_hidden") else cap * torch.tanh(out / cap)

    monkeypatch.setattr(Qwen3ForCausalLM, "forward", hf_capped)
    monkeypatch.setattr(PackedDecoderLM, "forward", archon_capped)
    report = run_alignment(AlignArgs(model_type="qwen3", lora_rank=4, seq_lens=(7, 13, 33)))
    assert report["max_abs_logits_diff"] < 1e-4 and report["lora_max_abs_logits_diff"] < 1e-4
    assert report["max_abs_train_logprob_diff"] > 1e-2, report
    assert "max_abs_train_logprob_diff" in report["failures"]
    assert "lora_max_abs_train_logprob_diff" in report["failures"]


# ---- fp64 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen3_5_text", "deepseek_v3"])
def test_fp64_leaves_only_fp64_rounding(model_type):
    """In fp64, with the fp32 islands of both sides kept in fp64, a correct port agrees to fp64
    rounding, five or more orders of magnitude under the fp32 gate's tolerances."""
    report = run_alignment(AlignArgs(model_type=model_type, lora_rank=4, dtype="float64", seq_lens=(7, 1, 33, 70)))
    assert report["pass"], report
    assert report["dtype"] == "float64" and report["tolerances"]["max_abs_logits_diff"] == 1e-9
    for key in (
        "max_abs_logits_diff",
        "max_abs_train_logprob_diff",
        "lora_max_abs_logits_diff",
        "lora_grad_max_rel_err",
    ):
        assert report[key] < 1e-11, (key, report[key])


def test_fp64_sees_a_difference_fp32_cannot(monkeypatch):
    """A port whose RMSNorm eps is off by one part in a hundred (1e-6 -> 1.01e-6) passes the fp32
    gate, whose rounding hides it; the fp64 gate fails it."""
    from archon.models.common.norms import RMSNorm

    norm_init = RMSNorm.__init__

    def shifted_eps(self, dim, eps=1e-6):
        norm_init(self, dim, eps * 1.01)

    monkeypatch.setattr(RMSNorm, "__init__", shifted_eps)
    fp32 = run_alignment(AlignArgs(model_type="llama", seq_lens=(7, 33)))
    fp64 = run_alignment(AlignArgs(model_type="llama", seq_lens=(7, 33), dtype="float64"))
    assert fp32["pass"], fp32
    assert not fp64["pass"] and "max_abs_logits_diff" in fp64["failures"], fp64
    assert fp32["max_abs_logits_diff"] < 1e-5 < 1e-7 * 1000 and fp64["max_abs_logits_diff"] > 1e-9


def test_fp32_islands_are_kept_in_fp64_only_inside_the_context():
    x64, x32 = torch.randn(3, dtype=torch.float64), torch.randn(3)
    with fp32_islands_in_fp64():
        assert x64.float().dtype == torch.float64
        assert x64.to(torch.float32).dtype == torch.float64
        assert x64.to(dtype=torch.float32, memory_format=torch.contiguous_format).dtype == torch.float64
        assert x64.type(torch.float32).dtype == torch.float64
        assert torch.nn.functional.softmax(x64, dim=-1, dtype=torch.float32).dtype == torch.float64
        assert x64.softmax(-1, dtype=torch.float32).dtype == torch.float64
        assert x32.double().float().dtype == torch.float64  # fp64 stays fp64, whatever its origin
        assert x32.to(torch.bfloat16).dtype == torch.bfloat16  # other casts as usual
    with pytest.raises(RuntimeError):
        with fp32_islands_in_fp64():
            raise RuntimeError("inside")
    assert x64.float().dtype == torch.float32  # restored, after an exception too
    assert torch.nn.functional.softmax(x64, dim=-1, dtype=torch.float32).dtype == torch.float32


# ---- command line --------------------------------------------------------------------------------


def test_set_reads_json_values_and_strings():
    assert parse_config_assignments(
        [
            "sliding_window=8",
            "use_sliding_window=true",
            "rope_scaling=None",
            "hidden_act=silu",
            'rope_parameters={"rope_type": "default", "rope_theta": 5000.0}',
            'layer_types=["a", "b"]',
            "eps=1e-5",
        ]
    ) == {
        "sliding_window": 8,
        "use_sliding_window": True,
        "rope_scaling": None,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0},
        "layer_types": ["a", "b"],
        "eps": 1e-5,
    }
    for bad in ("sliding_window", "=3", "not a name=1"):
        with pytest.raises(ValueError, match="KEY=VALUE"):
            parse_config_assignments([bad])


def test_cli_set_overrides_the_tiny_config(capsys):
    """Overrides from the command line reach the tiny config: a free head_dim passes, and a sliding
    window, which Llama has not, is refused by name."""
    assert main(["--model-type", "llama", "--set", "head_dim=24", "--seq-lens", "5", "9"]) == 0
    out = capsys.readouterr().out
    assert '"config_overrides": {"head_dim": 24}' in out
    with pytest.raises(ValueError, match="config.sliding_window=8"):
        run_alignment(AlignArgs(model_type="llama", set=("sliding_window=8",), seq_lens=(5,)))


def test_set_with_a_checkpoint_is_an_error(tiny_checkpoint, capsys):
    path = tiny_checkpoint("qwen3")
    assert main(["--hf-path", str(path), "--set", "sliding_window=8"]) == 2
    assert "a --hf-path checkpoint is checked as it is" in capsys.readouterr().err


def test_tolerances_name_their_dtype():
    assert set(TOLERANCES) == {"float32", "float64", "bfloat16"}
    for dtype in ("float32", "float64"):
        assert set(TOLERANCES[dtype]) == {"max_abs_logits_diff", "mean_kl", "lora_grad_max_rel_err"}
        assert all(0 < v < 1 and math.isfinite(v) for v in TOLERANCES[dtype].values())
    # bf16 compares the base model within twice its measured floor (written beside it), no LoRA
    assert set(TOLERANCES["bfloat16"]) == {"max_abs_logits_diff", "mean_kl"}
    assert all(0 < v < 10 for v in TOLERANCES["bfloat16"].values())


def test_the_alignment_table_has_a_row_per_type_and_dtype(capsys):
    from archon.tools.alignment_table import main as table_main

    assert table_main(["--model-types", "qwen2", "--lora-rank", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line for line in lines if line.startswith("| qwen2 |")).strip("|").split("|")
    figures = [float(cell) for cell in row[1:9]]
    assert all(f < 1e-4 for f in figures[0::2]) and all(f < 1e-9 for f in figures[1::2]), row
    assert row[9].strip() == "0"
    assert lines[-3].startswith("| tolerance | 1e-04 | 1e-09 |")
