"""Quantized checkpoints whose scales are damaged (NaN, inf, negative, all zero, absurdly large) are
refused when they are opened, naming the scale tensor and its file; a quantization_config that is
not an object is refused naming config.json."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.quant import QuantFormat
from archon.quant.checkpoint import MAX_DEQUANTIZED_WEIGHT, MXFP4_MAX_EXPONENT, scale_problem
from archon.quant.export import quantize_checkpoint
from archon.quant.formats import FP8_MAX
from archon.tools.align import make_tiny_hf_checkpoint

FP8 = QuantFormat("fp8", (16, 24))
MXFP4 = QuantFormat("mxfp4", (1, 32))
Q_PROJ_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
GATE_UP_SCALES = "model.layers.1.mlp.experts.gate_up_proj_scales"


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    made = {}

    def make(model_type: str, fmt: QuantFormat) -> Path:
        if (model_type, fmt) not in made:
            root = tmp_path_factory.mktemp(f"{model_type}_{fmt.method}")
            made[model_type, fmt] = quantize_checkpoint(
                make_tiny_hf_checkpoint(model_type, root / "hf"), root / "q", fmt
            )
        return made[model_type, fmt]

    return make


def _at_first(value):
    def edit(scale):
        scale = scale.clone()
        scale.view(-1)[0] = value
        return scale

    return edit


BAD_SCALES = {
    # name: (model_type, fmt, scale key, edit of the scale tensor, what the message names)
    "fp8-nan": ("qwen3", FP8, Q_PROJ_SCALE, _at_first(float("nan")), "holds nan at index [0, 0]"),
    "fp8-inf": ("qwen3", FP8, Q_PROJ_SCALE, _at_first(float("inf")), "holds inf at index [0, 0]"),
    "fp8-negative": ("qwen3", FP8, Q_PROJ_SCALE, _at_first(-0.01), "holds -0.01 at index [0, 0]"),
    "fp8-all-zero": ("qwen3", FP8, Q_PROJ_SCALE, torch.zeros_like, "is all zero"),
    "fp8-1e30": ("qwen3", FP8, Q_PROJ_SCALE, _at_first(1e30), "holds 1e+30 at index [0, 0], past 146.2"),
    "mxfp4-nan": ("gpt_oss", MXFP4, GATE_UP_SCALES, _at_first(255), "holds 255 (NaN in e8m0)"),
    "mxfp4-all-zero": ("gpt_oss", MXFP4, GATE_UP_SCALES, torch.zeros_like, "is all zero bytes"),
    "mxfp4-huge": (
        "gpt_oss",
        MXFP4,
        GATE_UP_SCALES,
        _at_first(200),
        "holds exponent 200 (at index [0, 0, 0]), past 140",
    ),
}


@pytest.mark.parametrize("quantized_base", ["keep", "dequantize"])
@pytest.mark.parametrize("case", sorted(BAD_SCALES))
def test_a_damaged_scale_is_refused_when_the_checkpoint_is_opened(case, quantized_base, quantized, tmp_path):
    model_type, fmt, key, edit, culprit = BAD_SCALES[case]
    path = shutil.copytree(quantized(model_type, fmt), tmp_path / "checkpoint")
    build_model(path, quantized_base=quantized_base)  # intact, it builds
    tensors = load_file(path / "model.safetensors")
    tensors[key] = edit(tensors[key])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as raised:
        build_model(path, quantized_base=quantized_base)
    message = str(raised.value)
    assert f"scale '{key}' in 'model.safetensors'" in message and str(path) in message, message
    assert culprit in message, message


def test_the_scale_bounds():
    """The largest fp8 scale and mxfp4 exponent that keep every weight within MAX_DEQUANTIZED_WEIGHT
    pass; the next ones are refused. Zero scales in part of a tensor (blocks of zeros) pass."""
    largest = MAX_DEQUANTIZED_WEIGHT / FP8_MAX
    assert scale_problem(FP8, torch.tensor([[0.0, largest]])) is None
    assert scale_problem(FP8, torch.tensor([[0.0, largest * 1.001]])) is not None
    assert scale_problem(FP8, torch.tensor(1e-12)) is None  # one scale per tensor, a 0-dim tensor
    assert 6 * 2.0 ** (MXFP4_MAX_EXPONENT - 127) <= MAX_DEQUANTIZED_WEIGHT < 6 * 2.0 ** (MXFP4_MAX_EXPONENT - 126)
    assert scale_problem(MXFP4, torch.tensor([0, MXFP4_MAX_EXPONENT], dtype=torch.uint8)) is None
    assert scale_problem(MXFP4, torch.tensor([0, MXFP4_MAX_EXPONENT + 1], dtype=torch.uint8)) is not None


def test_a_quantization_config_that_is_a_string_is_refused_naming_config_json(quantized, tmp_path):
    from archon.rl.config import parse_config

    path = shutil.copytree(quantized("qwen3", FP8), tmp_path / "checkpoint")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = "fp8"
    (path / "config.json").write_text(json.dumps(config))
    (tmp_path / "train.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError) as raised:
        parse_config(
            [
                "--model.path",
                str(path),
                "--data.path",
                str(tmp_path / "train.jsonl"),
                "--logging.run-dir",
                str(tmp_path),
            ]
        )
    assert f"model.path: {path / 'config.json'}: quantization_config='fp8'; expected an object" in str(raised.value)


def test_build_model_refuses_a_quantization_config_that_is_a_string_naming_config_json(quantized, tmp_path):
    """Outside the recipe (no config validation), building from such a checkpoint names the file too,
    instead of transformers' AttributeError."""
    from archon.build import load_hf_config

    path = shutil.copytree(quantized("qwen3", FP8), tmp_path / "checkpoint")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = "fp8"
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: quantization_config='fp8'; expected an object"):
        load_hf_config(path)
