"""What the alignment gate checks: the model type (given, or read from --hf-path), the config
overrides (--set), the --quantize option, and the checkpoints both sides load (the tiny model or
--hf-path, quantized when asked, and HF's dequantized reference copy)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from archon.checkpoint.hf import read_json_file
from archon.quant import QuantFormat, quant_format_from_config
from archon.quant.export import QUANTIZED_WEIGHTS, quantize_checkpoint
from archon.quant.formats import compressed_tensors_config
from archon.spec import get_spec
from archon.tools.dequantized_reference import write_dequantized_reference
from archon.tools.tiny_checkpoint import make_tiny_hf_checkpoint


def parse_config_assignments(assignments: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """["key=value", ...] -> {key: value}; a value is read as JSON (numbers, true/false/null, lists,
    objects), else kept as a string. `None` is null too."""
    overrides: dict[str, Any] = {}
    for item in assignments:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY a config field name")
        if text.strip() == "None":
            overrides[key] = None
            continue
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    return overrides


def resolve_model_type(args) -> str:
    """args.model_type, else the model_type of args.hf_path/config.json; a supported type either way."""
    overrides = parse_config_assignments(args.set)
    if args.hf_path is not None and (overrides or args.config_overrides):
        raise ValueError(
            "--set / config_overrides change the tiny model's config; a --hf-path checkpoint is checked as it is"
        )
    if args.hf_path is None:
        if args.model_type is None:
            raise ValueError("give --model-type (to check a tiny random model of that type) or --hf-path DIR")
        get_spec(args.model_type)
        return args.model_type
    config_path = Path(args.hf_path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist; --hf-path must be an HF model directory")
    model_type = read_json_file(config_path, "model config").get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f'{config_path} has no "model_type" string, so it is not an HF transformers model config')
    if args.model_type is not None and args.model_type != model_type:
        raise ValueError(f"{config_path} holds model_type {model_type!r}, not {args.model_type!r}")
    try:
        get_spec(model_type)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    return model_type


def quantize_option_format(option: str) -> QuantFormat:
    """The format an `--quantize` value names: fp8 (128x128 blocks), fp8:RxC, fp8-channel,
    fp8-tensor or mxfp4."""
    method, _, blocks = option.partition(":")
    if method == "mxfp4" and not blocks:
        return QuantFormat("mxfp4", (1, 32))
    if method in ("fp8-channel", "fp8-tensor") and not blocks:
        return quant_format_from_config(compressed_tensors_config(method.removeprefix("fp8-")))
    if method == "fp8":
        if not blocks:
            return QuantFormat("fp8", (128, 128))
        rows, x, cols = blocks.partition("x")
        if x and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0:
            return QuantFormat("fp8", (int(rows), int(cols)))
    raise ValueError(
        f"--quantize {option!r}: expected fp8 (128x128 blocks), fp8:RxC (blocks of R rows and C columns, "
        "e.g. fp8:16x24), fp8-channel, fp8-tensor or mxfp4"
    )


def checkpoint_quantization_config(path: Path) -> dict | None:
    return read_json_file(path / "config.json", "model config").get("quantization_config")


def check_quantize_option(args) -> None:
    """An error naming the option when --quantize is malformed or the --hf-path checkpoint is quantized already."""
    if args.quantize is None:
        return
    quantize_option_format(args.quantize)
    if args.hf_path is not None and checkpoint_quantization_config(Path(args.hf_path)) is not None:
        raise ValueError(
            f"--quantize {args.quantize!r}: {str(Path(args.hf_path) / 'config.json')!r} has a quantization_config "
            "already; check a quantized checkpoint with --hf-path alone"
        )


def checkpoints(args, model_type: str, overrides: dict[str, Any], tmp: Path):
    """(the checkpoint archon loads, the plain one HF loads, its quantization format or None, how many
    weights it stores quantized): the tiny model or --hf-path, quantized by --quantize, and when
    quantized, HF's copy dequantized by the reference recipe."""
    if args.hf_path is None:
        hf_path = make_tiny_hf_checkpoint(model_type, tmp / "hf", args.seed, **overrides)
    else:
        hf_path = Path(args.hf_path)
    if args.quantize is not None:
        fmt = quantize_option_format(args.quantize)
        hf_path = quantize_checkpoint(hf_path, tmp / "quantized", fmt)

    # HF runs on a plain copy of a quantized checkpoint, dequantized by the reference recipe.
    quant_format = quant_format_from_config(checkpoint_quantization_config(hf_path), str(hf_path / "config.json"))
    hf_reference_path, quantized_tensors = hf_path, 0
    if quant_format is not None:
        hf_reference_path, quantized_tensors = write_dequantized_reference(hf_path, tmp / "reference")
    if args.quantize is not None and quantized_tensors == 0:
        raise ValueError(
            f"--quantize {args.quantize!r}: no weight of the {model_type} checkpoint is one {quant_format.method} "
            f"stores (HF names matching {QUANTIZED_WEIGHTS[quant_format.method]!r})"
        )
    return hf_path, hf_reference_path, quant_format, quantized_tensors
