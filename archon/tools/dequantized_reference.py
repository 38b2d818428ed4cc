"""Reference dequantization of a quantized checkpoint, written out by the published recipes one
block at a time (`write_dequantized_reference`): what the alignment tool (archon.tools.align) runs
HF transformers on when it checks a quantized checkpoint. It shares no code with archon.quant, whose
vectorised dequantization it checks.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from archon.checkpoint.hf import HFCheckpoint, read_json_file


def _e2m1_value(nibble: int) -> float:
    """OCP e2m1: sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal."""
    sign = -1.0 if nibble & 0b1000 else 1.0
    exponent, mantissa = (nibble >> 1) & 0b11, nibble & 0b1
    if exponent == 0:
        return sign * mantissa * 0.5
    return sign * 2.0 ** (exponent - 1) * (1.0 + mantissa / 2)


def reference_dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block_size: tuple[int, int], name: str
) -> torch.Tensor:
    """fp8 e4m3 `weight` [..., rows, cols] with `scale_inv` [..., ceil(rows/br), ceil(cols/bc)] ->
    fp32: for each br x bc block (i, j), partial edge blocks included, w = q * scale_inv[i, j]."""
    br, bc = block_size
    *lead, rows, cols = weight.shape
    grid = (math.ceil(rows / br), math.ceil(cols / bc))
    if tuple(scale_inv.shape) != (*lead, *grid):
        raise ValueError(
            f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; blocks of {br}x{bc} over {name} of shape "
            f"{tuple(weight.shape)} need {(*lead, *grid)}"
        )
    q = weight.reshape(-1, rows, cols)
    scales = scale_inv.reshape(-1, *grid)
    out = torch.empty(q.shape, dtype=torch.float32)
    for m in range(q.shape[0]):
        for i in range(grid[0]):
            row_block = slice(i * br, min((i + 1) * br, rows))
            for j in range(grid[1]):
                col_block = slice(j * bc, min((j + 1) * bc, cols))
                out[m, row_block, col_block] = q[m, row_block, col_block].float() * scales[m, i, j].float()
    return out.reshape(weight.shape)


def reference_dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> torch.Tensor:
    """`blocks` uint8 [..., out, G, 16] (32 e2m1 values per group, two per byte, low nibble first)
    and `scales` uint8 [..., out, G] (e8m0) -> the HF weight, fp32 [..., G*32, out]:
    w = e2m1 * 2^(scale - 127), rows [..., out, in] transposed to the HF layout [..., in, out]."""
    if blocks.shape[-1] != 16 or tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(
            f"{name}_blocks of shape {tuple(blocks.shape)} and {name}_scales of shape {tuple(scales.shape)}: "
            "expected [..., out, G, 16] and [..., out, G]"
        )
    values = torch.tensor([_e2m1_value(n) for n in range(16)], dtype=torch.float32)
    low, high = values[(blocks & 0x0F).long()], values[(blocks >> 4).long()]
    groups = torch.stack((low, high), dim=-1).flatten(-2)  # [..., out, G, 32]: low nibble first
    multiplier = torch.exp2(scales.to(torch.float64) - 127).to(torch.float32)  # 2^-127 is an fp32 subnormal
    rows = (groups * multiplier[..., None]).flatten(-2)  # [..., out, in]
    return rows.transpose(-1, -2).contiguous()


def write_dequantized_reference(source: Path, out_dir: Path) -> tuple[Path, int]:
    """A plain fp32 copy of the quantized HF checkpoint `source` (same shard files, config without
    `quantization_config`), each quantized weight dequantized by its published recipe. Returns the
    copy's directory and the number of weights that were stored quantized."""
    from safetensors.torch import save_file

    config = read_json_file(source / "config.json", "model config")
    quantization = config.pop("quantization_config")
    method = quantization.get("quant_method")
    checkpoint = HFCheckpoint(source)
    keys = checkpoint.keys()
    files: dict[Path, list[str]] = {}
    for key in sorted(keys):
        files.setdefault(checkpoint.file_of(key), []).append(key)
    out_dir.mkdir(parents=True)
    weight_map, dequantized = {}, 0
    if method in ("fp8", "compressed-tensors"):
        scale_suffix, block = _fp8_scales(quantization)
    for file, file_keys in sorted(files.items()):
        tensors = {}
        for key in file_keys:
            if method in ("fp8", "compressed-tensors"):
                written = _fp8_reference(checkpoint, keys, key, scale_suffix, block)
            elif method == "mxfp4":
                written = _mxfp4_reference(checkpoint, keys, key)
            else:
                raise ValueError(
                    f"{str(source / 'config.json')!r}: quantization_config.quant_method={method!r} has no "
                    "reference dequantization"
                )
            if written is None:
                continue
            key, tensor, was_quantized = written
            tensors[key] = tensor
            dequantized += was_quantized
        save_file(tensors, str(out_dir / file.name), metadata={"format": "pt"})
        weight_map.update({key: file.name for key in tensors})
    if (source / "model.safetensors.index.json").exists():
        (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    for extra in source.iterdir():  # tokenizer, generation config
        written = ("config.json", "model.safetensors.index.json")
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in written:
            (out_dir / extra.name).write_bytes(extra.read_bytes())
    return out_dir, dequantized


def _where(checkpoint: HFCheckpoint, key: str) -> str:
    return f"{key!r} in {str(checkpoint.file_of(key))!r}"


def _fp8_scales(quantization: dict) -> tuple[str, tuple]:
    """An fp8 (or compressed-tensors fp8) quantization_config's scale name suffix and the block of one
    scale, (rows, cols); None is the whole dimension."""
    if quantization.get("quant_method") == "fp8":
        return "_scale_inv", tuple(quantization["weight_block_size"])
    (weights,) = {json.dumps(group["weights"], sort_keys=True) for group in quantization["config_groups"].values()}
    weights = json.loads(weights)
    block = {"tensor": (None, None), "channel": (1, None)}.get(weights["strategy"]) or tuple(weights["block_structure"])
    return "_scale", block


def _fp8_reference(
    checkpoint: HFCheckpoint, keys, key: str, scale_suffix: str, block: tuple
) -> tuple[str, torch.Tensor, int] | None:
    """What the fp32 copy holds for `key` of an fp8 checkpoint: (key, tensor, 1 if it was stored
    quantized else 0); None for a scale."""
    if key.endswith("weight" + scale_suffix):
        if key.removesuffix(scale_suffix) not in keys:
            raise KeyError(f"scale {_where(checkpoint, key)} has no weight {key.removesuffix(scale_suffix)!r}")
        return None
    if key.endswith((".input_scale", ".activation_scale")):  # activation scales: not weights
        return None
    tensor = checkpoint.get(key)
    if f"{key}{scale_suffix}" in keys:
        if tensor.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{_where(checkpoint, key)} has a scale but is {tensor.dtype}, not float8_e4m3fn")
        rows, cols = tensor.shape[-2:]
        whole = (block[0] or rows, block[1] or cols)
        scale = checkpoint.get(f"{key}{scale_suffix}")
        if scale.numel() == 1:  # one scale for the tensor
            scale = scale.reshape(1, 1)
        return key, reference_dequantize_fp8(tensor, scale, whole, key), 1
    if tensor.dtype == torch.float8_e4m3fn:
        raise KeyError(f"fp8 weight {_where(checkpoint, key)} has no {key + scale_suffix!r}")
    return key, tensor, 0


def _mxfp4_reference(checkpoint: HFCheckpoint, keys, key: str) -> tuple[str, torch.Tensor, int] | None:
    """What the fp32 copy holds for `key` of an MXFP4 checkpoint: (key, tensor, 1 if it was stored
    quantized else 0), the blocks under the weight's name; None for scales."""
    if key.endswith("_scales"):
        if key.removesuffix("_scales") + "_blocks" not in keys:
            raise KeyError(f"scales {_where(checkpoint, key)} have no {key.removesuffix('_scales') + '_blocks'!r}")
        return None
    tensor = checkpoint.get(key)
    if key.endswith("_blocks"):
        name = key.removesuffix("_blocks")
        if f"{name}_scales" not in keys:
            raise KeyError(f"mxfp4 blocks {_where(checkpoint, key)} have no {name + '_scales'!r}")
        return name, reference_dequantize_mxfp4(tensor, checkpoint.get(f"{name}_scales"), name), 1
    return key, tensor, 0
