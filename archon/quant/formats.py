"""Block-scaled weight formats of published low-precision checkpoints, and their arithmetic.

Two formats are read from a checkpoint's `quantization_config`:

- **fp8** (DeepSeek-V3, Kimi K2, GLM-4.5-FP8, Qwen3-FP8, ...): `X.weight` in float8_e4m3fn [out, in]
  and `X.weight_scale_inv` in fp32 [ceil(out/br), ceil(in/bc)], one scale per br x bc block
  (`weight_block_size = [br, bc]`); w = q * scale. Edge blocks may be partial.
- **mxfp4** (GPT-OSS experts, OCP microscaling): `X_blocks` uint8 [..., out, in/32, 16], two e2m1
  values per byte (low nibble first), and `X_scales` uint8 [..., out, in/32], an e8m0 exponent per
  32 inputs; w = fp4 * 2^(scale - 127). The dequantized HF tensor is [..., in, out] (transposed).

In memory archon keeps every quantized weight *row-major with one scale per row and column block*:
data [..., out, in'] (uint8 bytes: fp8 bits, or packed fp4 pairs) and scale [..., out, ceil(in/bc)].
An fp8 block's scale is repeated over its br rows (a few percent of the fp8 bytes), which makes any
concatenation or split along rows exact (stacked experts, fused gate/up, tensor-parallel columns,
FSDP's row shards) even when the rows are not a multiple of the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MXFP4_BLOCK = 32
# The 16 e2m1 values by nibble (bit 3 is the sign).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantFormat:
    """A checkpoint's weight format.

    `method` "fp8": e4m3 weights with a scale per block of `block_size` = (rows, cols), where None
    is the whole dimension ((1, None): one scale per output row; (None, None): one per tensor); the
    scale is stored as `<weight><scale_suffix>`. "mxfp4": block_size (1, 32).
    `config` is the checkpoint's `quantization_config`, written back by a requantized export.
    """

    method: str
    block_size: tuple[int | None, int | None]
    scale_suffix: str = "_scale_inv"
    config: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def column_block(self) -> int | None:
        """Inputs that share a scale; None: all of a row's."""
        return self.block_size[1]

    def __str__(self) -> str:
        if self.method == "mxfp4":
            return "mxfp4 (e2m1, e8m0 scale per 32)"
        rows, cols = self.block_size
        if rows is None and cols is None:
            return "fp8 e4m3 with a scale per tensor"
        if rows == 1 and cols is None:
            return "fp8 e4m3 with a scale per output channel"
        return f"fp8 e4m3 with {rows}x{cols} block scales"

    # ---- checkpoint names -------------------------------------------------------------------
    def stored_keys(self, hf_name: str) -> tuple[str, str]:
        """(data key, scale key) in the checkpoint of the HF weight `hf_name`."""
        if self.method == "fp8":
            return hf_name, f"{hf_name}{self.scale_suffix}"
        return f"{hf_name}_blocks", f"{hf_name}_scales"

    def logical_name(self, stored_key: str) -> str | None:
        """The HF weight a checkpoint key stores (data or scale key), or None for a plain key."""
        suffixes = (self.scale_suffix,) if self.method == "fp8" else ("_blocks", "_scales")
        for suffix in suffixes:
            if stored_key.endswith(suffix):
                return stored_key.removesuffix(suffix)
        return None

    def hf_transposed(self) -> bool:
        """Whether the HF model's dequantized tensor is the transpose of the stored rows (mxfp4)."""
        return self.method == "mxfp4"

    def quantization_config(self) -> dict:
        """`quantization_config` for a config.json of this format: the source checkpoint's, or the
        published layout of the format."""
        if self.config:
            return dict(self.config)
        if self.method == "fp8":
            return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": list(self.block_size)}  # fmt: skip
        return {"quant_method": "mxfp4"}

    # ---- storage ------------------------------------------------------------------------------
    def data_columns(self, in_features: int) -> int:
        return in_features // 2 if self.method == "mxfp4" else in_features

    def scale_columns(self, in_features: int) -> int:
        return 1 if self.column_block is None else math.ceil(in_features / self.column_block)

    def checkpoint_scale_shape(self, data_shape: list[int]) -> list[int]:
        """The scale tensor's shape in the checkpoint for a data tensor of `data_shape`."""
        if self.method == "mxfp4":
            return list(data_shape[:-1])
        rows, cols = self.block_size
        if rows is None and cols is None:
            return [1]
        *lead, out_features, in_features = data_shape
        return [*lead, math.ceil(out_features / (rows or out_features)), math.ceil(in_features / (cols or in_features))]

    def storage_shapes(self, rows_shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(data, scale) shapes of the in-memory storage of a weight of row-major shape [..., out, in]."""
        *lead, in_features = rows_shape
        return (*lead, self.data_columns(in_features)), (*lead, self.scale_columns(in_features))

    def scale_dtype(self) -> torch.dtype:
        # fp8 scales are fp32 kept as their int32 bits: FSDP2's mixed-precision cast leaves
        # non-floating parameters alone, and a bf16-rounded scale would move every weight of its block.
        return torch.int32 if self.method == "fp8" else torch.uint8


def quant_format_from_config(quantization_config: dict | None, where: str = "config.json") -> QuantFormat | None:
    """The format named by a checkpoint's `quantization_config`, None when there is none; an error
    naming the field for a method or layout archon does not read."""
    if quantization_config is None:
        return None
    if not isinstance(quantization_config, dict):
        raise ValueError(
            f"{where}: quantization_config={quantization_config!r}; expected an object with a quant_method"
        )
    if not quantization_config:
        return None
    method = quantization_config.get("quant_method")
    if method == "fp8":
        fmt = quantization_config.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise ValueError(f"{where}: quantization_config.fmt={fmt!r}; archon reads fp8 e4m3 checkpoints only")
        block = quantization_config.get("weight_block_size")
        if (
            not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):  # fmt: skip
            raise ValueError(
                f"{where}: quantization_config.weight_block_size={block!r}; archon reads block-scaled fp8 "
                "checkpoints, which name two positive block sizes (e.g. [128, 128])"
            )
        return QuantFormat("fp8", (int(block[0]), int(block[1])), config=dict(quantization_config))
    if method == "mxfp4":
        return QuantFormat("mxfp4", (1, MXFP4_BLOCK), config=dict(quantization_config))
    if method == "compressed-tensors":
        return _compressed_tensors_format(quantization_config, where)
    raise ValueError(
        f"{where}: quantization_config.quant_method={method!r}; archon reads 'fp8' (block-scaled e4m3), "
        "'compressed-tensors' (float-quantized fp8) and 'mxfp4' checkpoints"
    )


_COMPRESSED_TENSORS_BLOCKS = {"tensor": (None, None), "channel": (1, None)}


def _compressed_tensors_format(config: dict, where: str) -> QuantFormat:
    """The fp8 weight layout of a compressed-tensors checkpoint (`format` float-quantized: e4m3
    weights, `weight_scale` per tensor, per output channel or per block)."""
    field_name = "quantization_config"
    if config.get("format") != "float-quantized":
        raise ValueError(
            f"{where}: {field_name}.format={config.get('format')!r}; of compressed-tensors checkpoints archon reads "
            "the fp8 ones ('float-quantized')"
        )
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: {field_name}.config_groups must name at least one group of weights")
    blocks = set()
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"{where}: {field_name}.config_groups.{name}.weights is missing")
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or not weights.get("symmetric", True):
            raise ValueError(
                f"{where}: {field_name}.config_groups.{name}.weights is type={weights.get('type')!r}, "
                f"num_bits={weights.get('num_bits')!r}; archon reads symmetric 8-bit float weights"
            )
        strategy = weights.get("strategy")
        if strategy == "block":
            block = weights.get("block_structure")
            if not isinstance(block, (list, tuple)) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
                raise ValueError(f"{where}: {field_name}.config_groups.{name}.weights.block_structure={block!r}")
            blocks.add((int(block[0]), int(block[1])))
        elif strategy in _COMPRESSED_TENSORS_BLOCKS:
            blocks.add(_COMPRESSED_TENSORS_BLOCKS[strategy])
        else:
            raise ValueError(
                f"{where}: {field_name}.config_groups.{name}.weights.strategy={strategy!r}; archon reads 'tensor', "
                "'channel' and 'block'"
            )
    if len(blocks) != 1:
        raise ValueError(f"{where}: {field_name}.config_groups mix weight strategies {sorted(map(str, blocks))}")
    return QuantFormat("fp8", blocks.pop(), scale_suffix="_scale", config=dict(config))


def compressed_tensors_config(strategy: str, block: tuple[int, int] | None = None) -> dict:
    """A compressed-tensors `quantization_config` for fp8 weights with dynamic per-token fp8
    activations, as published fp8 checkpoints of that format carry."""
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": False, "strategy": strategy}
    if block is not None:
        weights["block_structure"] = list(block)
    activations = {"type": "float", "num_bits": 8, "symmetric": True, "dynamic": True, "strategy": "token"}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}}}  # fmt: skip


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------


def fp8_rows_from_checkpoint(
    weight: torch.Tensor, scale: torch.Tensor, row_block: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint fp8 `weight` [..., out, in] and its scale ([..., ceil(out/br), nb], or one per
    tensor) -> storage (uint8 bits [..., out, in], int32 bits of the fp32 scale repeated per row
    [..., out, nb]). `row_block` None: the scale covers every row."""
    rows = weight.shape[-2]
    scale = scale.to(torch.float32)
    if scale.numel() == 1:
        scale = scale.reshape(1, 1)
    scale = scale.repeat_interleave(row_block or rows, dim=-2)[..., :rows, :]
    return weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.int32)


def dequantize_fp8(data: torch.Tensor, scale: torch.Tensor, column_block: int | None, dtype: torch.dtype) -> torch.Tensor:
    """Storage [..., out, in] (fp8 bits) and [..., out, nb] (fp32 bits) -> weight [..., out, in] in
    `dtype`. `column_block` None: one scale per row."""
    in_features = data.shape[-1]
    values = data.view(torch.float8_e4m3fn).to(torch.float32)
    scale = scale.view(torch.float32)
    if column_block is None or scale.shape[-1] == 1 and in_features <= column_block:
        return (values * scale).to(dtype)
    if in_features % column_block == 0:  # whole blocks: scale each block in a view, no repeated scales
        return (values.unflatten(-1, (-1, column_block)) * scale[..., None]).flatten(-2).to(dtype)
    # A gather rather than repeat_interleave: inductor (torch 2.13, CPU) miscompiles the latter
    # after the bit views above.
    block_of_column = torch.arange(in_features, device=data.device) // column_block
    return (values * scale[..., block_of_column]).to(dtype)


def quantize_fp8(weight: torch.Tensor, block_size: tuple[int | None, int | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The published block recipe: per br x bc block, scale = amax / 448 and q = w / scale in e4m3
    (None: the whole dimension). weight [out, in] -> (float8_e4m3fn [out, in], fp32 scale
    [ceil(out/br), ceil(in/bc)])."""
    out_features, in_features = weight.shape[-2:]
    br, bc = block_size[0] or out_features, block_size[1] or in_features
    nr, nc = math.ceil(out_features / br), math.ceil(in_features / bc)
    padded = torch.zeros(*weight.shape[:-2], nr * br, nc * bc, dtype=torch.float32, device=weight.device)
    padded[..., :out_features, :in_features] = weight.float()
    blocks = padded.unflatten(-1, (nc, bc)).unflatten(-3, (nr, br))  # [..., nr, br, nc, bc]
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)  # [..., nr, nc]
    scale = amax / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.flatten(-2).flatten(-3, -2)[..., :out_features, :in_features]
    return q.to(torch.float8_e4m3fn), scale


# ---------------------------------------------------------------------------------------------
# mxfp4
# ---------------------------------------------------------------------------------------------


def mxfp4_rows_from_checkpoint(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint `X_blocks` [..., out, G, 16] and `X_scales` [..., out, G] -> storage
    (uint8 [..., out, 16 G], uint8 [..., out, G])."""
    return blocks.flatten(-2).contiguous(), scales.contiguous()


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Storage [..., out, in/2] (two e2m1 per byte, low nibble first) and [..., out, in/32] (e8m0)
    -> weight [..., out, in] in `dtype`. Every product is exact in bf16 or wider."""
    values = _fp4_pairs(data.device)[data.long()].flatten(-2)  # [..., out, in]: one lookup per byte
    multiplier = torch.exp2(scale.to(torch.float32) - 127)  # [..., out, in/32]
    return (values.unflatten(-1, (-1, MXFP4_BLOCK)) * multiplier[..., None]).flatten(-2).to(dtype)


_FP4_PAIRS: dict[torch.device, torch.Tensor] = {}


def _fp4_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the two e2m1 values (low nibble, high nibble) of each byte."""
    if device not in _FP4_PAIRS:
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        _FP4_PAIRS[device] = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1).to(device)
    return _FP4_PAIRS[device]


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX quantization: per 32 inputs, a shared exponent e = floor(log2(amax)) - 2 (e2m1's largest
    exponent), elements rounded to the nearest e2m1 value of w / 2^e.
    weight [..., out, in] -> (blocks uint8 [..., out, in/32, 16], scales uint8 [..., out, in/32])."""
    in_features = weight.shape[-1]
    if in_features % MXFP4_BLOCK:
        raise ValueError(f"mxfp4 needs a multiple of {MXFP4_BLOCK} inputs, got a weight of shape {tuple(weight.shape)}")
    groups = weight.float().unflatten(-1, (-1, MXFP4_BLOCK))  # [..., out, G, 32]
    amax = groups.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=2.0**-127))) - 2, torch.zeros_like(amax))
    exponent = exponent.clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    lut = torch.tensor(FP4_VALUES[:8], dtype=torch.float32, device=weight.device)
    magnitude = (scaled.abs().clamp(max=6.0)[..., None] - lut).abs().argmin(dim=-1)  # nearest |value|
    nibbles = (magnitude | ((scaled < 0).to(torch.long) << 3)).to(torch.uint8)  # [..., out, G, 32]
    packed = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)  # [..., out, G, 16]
    return packed, (exponent + 127).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# either
# ---------------------------------------------------------------------------------------------


def dequantize(fmt: QuantFormat, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """In-memory storage -> row-major weight [..., out, in] in `dtype`."""
    if fmt.method == "fp8":
        return dequantize_fp8(data, scale, fmt.column_block, dtype)
    return dequantize_mxfp4(data, scale, dtype)


def quantize_to_checkpoint(fmt: QuantFormat, hf_name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """The checkpoint tensors (names and values) that store HF weight `hf_name` (as the HF model
    holds it: [out, in] for fp8, [..., in, out] for mxfp4) in format `fmt`."""
    data_key, scale_key = fmt.stored_keys(hf_name)
    if fmt.method == "fp8":
        if weight.ndim != 2:
            raise ValueError(f"fp8 block quantization takes 2-D weights; {hf_name!r} has shape {tuple(weight.shape)}")
        q, scale = quantize_fp8(weight, fmt.block_size)
        if fmt.block_size == (None, None):
            scale = scale.reshape(1)  # one scale per tensor, stored as [1]
        return [(data_key, q), (scale_key, scale)]
    blocks, scales = quantize_mxfp4(weight.transpose(-1, -2))
    return [(data_key, blocks), (scale_key, scales)]
