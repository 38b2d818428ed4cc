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

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

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
            return {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": list(self.block_size),
            }
        return {"quant_method": "mxfp4"}

    # ---- storage ------------------------------------------------------------------------------
    def data_columns(self, in_features: int) -> int:
        return in_features // 2 if self.method == "mxfp4" else in_features

    def in_features(self, data_columns: int) -> int:
        """The inputs a storage row of `data_columns` bytes holds (the inverse of data_columns)."""
        return data_columns * 2 if self.method == "mxfp4" else data_columns

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


def quant_format_of_config_file(config_file: Path) -> QuantFormat | None:
    """The format named by the `quantization_config` of an HF `config.json`, checked as
    quant_format_from_config checks it (None for a file that is not a JSON object: the config
    loader names that)."""
    try:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (
        quant_format_from_config(config.get("quantization_config"), str(config_file))
        if isinstance(config, dict)
        else None
    )


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
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
        ):
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
            if (
                not isinstance(block, (list, tuple))
                or len(block) != 2
                or not all(isinstance(b, int) and b > 0 for b in block)
            ):
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
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations}},
    }


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------


def fp8_rows_from_checkpoint(
    weight: torch.Tensor, scale: torch.Tensor, row_block: int | None, first_row: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Checkpoint fp8 `weight` [..., out, in] and the scale rows of its blocks ([..., nr, nb], or one
    per tensor) -> storage (uint8 bits [..., out, in], int32 bits of the fp32 scale repeated per row
    [..., out, nb]). `row_block` None: the scale covers every row. `first_row`: where `weight`'s rows
    start within the first block of `scale` (a rank's part that begins inside a block)."""
    rows = weight.shape[-2]
    scale = scale.to(torch.float32)
    if scale.numel() == 1:  # one scale for the tensor
        scale = scale.reshape(1, 1).expand(*weight.shape[:-1], 1)
    else:
        scale = scale.repeat_interleave(row_block or rows, dim=-2)[..., first_row : first_row + rows, :]
    return weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.int32)


def dequantize_fp8(
    data: torch.Tensor,
    scale: torch.Tensor,
    column_block: int | None,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Storage [..., out, in] (fp8 bits) and [..., out, nb] (fp32 bits) -> weight [..., out, in] in
    `dtype` (written into `out` when given). `column_block` None: one scale per row."""
    table = _fp8_pair_values(data.device) if data.shape[-1] % 2 == 0 else _fp8_values(data.device)
    block = column_block or data.shape[-1]
    return _dequantize_rows(table, data, scale.view(torch.float32), block, dtype, out)


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


def dequantize_mxfp4(
    data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Storage [..., out, in/2] (two e2m1 per byte, low nibble first) and [..., out, in/32] (e8m0)
    -> weight [..., out, in] in `dtype` (written into `out` when given). Every product is exact in
    bf16 or wider."""
    multiplier = torch.exp2(scale.to(torch.float32) - 127)  # [..., out, in/32]
    return _dequantize_rows(_fp4_pairs(data.device), data, multiplier, MXFP4_BLOCK, dtype, out)


def _fp4_pairs(device: torch.device) -> torch.Tensor:
    """[256] int64: the two e2m1 values of each byte (low nibble first) as an fp32 pair in one 8-byte
    word (index_select gathers a 1-D table of words faster than rows of a [256, 2] one)."""
    key = ("fp4 pairs", device)
    if key not in _TABLES:
        lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
        byte = torch.arange(256)
        pairs = torch.stack((lut[byte & 0x0F], lut[byte >> 4]), dim=-1)  # [256, 2] fp32
        _TABLES[key] = pairs.view(torch.int64).reshape(256).to(device)
    return _TABLES[key]


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
# dequantization by table lookup
# ---------------------------------------------------------------------------------------------
#
# Converting float8 to float32 element by element is slow on CPUs (several ns a value), so both
# formats look their bytes up in a table of exact fp32 values (fp8: two bytes at a time; int32
# indices: int64 ones would double the traffic) and scale block by block in place, a chunk of rows
# at a time: the fp32 values of a chunk stay in cache, and a narrower weight dtype never has a whole
# fp32 copy beside it. The product is formed in fp32 and rounded once to the weight's dtype either way.

_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}
# Elements dequantized per chunk: 4 MB of fp32 on a CPU; on an accelerator, few enough launches.
_CHUNK_ELEMENTS = {"cpu": 1 << 20}
_DEVICE_CHUNK_ELEMENTS = 1 << 24


def _fp8_values(device: torch.device) -> torch.Tensor:
    """[256] fp32: the float8_e4m3fn value of each byte (NaN for the two NaN codes)."""
    key = ("fp8 values", device)
    if key not in _TABLES:
        _TABLES[key] = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).to(device)
    return _TABLES[key]


def _fp8_pair_values(device: torch.device) -> torch.Tensor:
    """[65536] int64: for each pair of bytes read as one uint16, their two float8_e4m3fn values as an
    fp32 pair in one 8-byte word (half the lookups of the byte table)."""
    key = ("fp8 pair values", device)
    if key not in _TABLES:
        # the bytes of every uint16 in memory order, whatever the machine's byte order
        byte_pairs = torch.arange(65536, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(65536, 2)
        pairs = _fp8_values(torch.device("cpu"))[byte_pairs.long()]  # [65536, 2] fp32
        _TABLES[key] = pairs.view(torch.int64).reshape(65536).to(device)
    return _TABLES[key]


def _dequantize_rows(
    table: torch.Tensor,
    data: torch.Tensor,
    scale: torch.Tensor,
    block: int,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """data [..., out, in_bytes] (uint8) looked up in `table` and times scale [..., out, ceil(in/block)]
    (fp32, one per `block` columns, the last block may be partial) -> [..., out, in] in `dtype`.
    `table` has 256 entries (indexed by a byte) or 65536 (by two bytes read as one uint16), each the
    fp32 value or values (in one wider word) that its bytes stand for. `out`, when given, is a
    contiguous tensor of the result's shape and dtype to write into."""
    *lead, in_bytes = data.shape
    index_bytes = 2 if table.numel() == 65536 else 1
    values_per_entry = table.element_size() // 4
    in_features = in_bytes // index_bytes * values_per_entry
    data_rows = data.reshape(-1, in_bytes)
    scale_rows = scale.reshape(-1, scale.shape[-1])
    shape = (*lead, in_features)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=data.device)
    elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(
            f"dequantize: out must be a contiguous {dtype} tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    out_rows = out.view(-1, in_features)
    step = max(1, _CHUNK_ELEMENTS.get(data.device.type, _DEVICE_CHUNK_ELEMENTS) // max(in_features, 1))
    for start in range(0, data_rows.shape[0], step):
        chunk = data_rows[start : start + step]
        if index_bytes == 2:
            if chunk.stride(-1) != 1 or chunk.stride(0) % 2 or chunk.storage_offset() % 2:
                # two bytes read as one uint16 need even, packed rows (a row of a wider tensor, even
                # one alone, keeps the wider stride)
                chunk = torch.empty(chunk.shape, dtype=chunk.dtype, device=chunk.device).copy_(chunk)
            chunk = chunk.view(torch.uint16)
        indices = chunk.reshape(-1).int()
        if dtype == torch.float32:  # look up straight into the output
            values = out_rows[start : start + step]
            torch.index_select(table, 0, indices, out=values.view(table.dtype).view(-1))
        else:
            values = table.index_select(0, indices).view(torch.float32).view(-1, in_features)
        _scale_column_blocks(values, scale_rows[start : start + step], block)
        if dtype != torch.float32:
            out_rows[start : start + step] = values
    return out


def _scale_column_blocks(values: torch.Tensor, scale: torch.Tensor, block: int) -> None:
    """values [rows, in] (fp32) *= scale [rows, ceil(in/block)], one scale per `block` columns."""
    in_features = values.shape[-1]
    whole = in_features - in_features % block
    blocks = whole // block
    values[:, :whole].unflatten(-1, (blocks, block)).mul_(scale[:, :blocks, None])
    if whole < in_features:
        values[:, whole:].mul_(scale[:, blocks:])


# ---------------------------------------------------------------------------------------------
# either
# ---------------------------------------------------------------------------------------------


def dequantize(
    fmt: QuantFormat, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
) -> torch.Tensor:
    """In-memory storage -> row-major weight [..., out, in] in `dtype` (written into `out`, a
    contiguous tensor of that shape and dtype, when given)."""
    if data.device.type == "cpu" and torch.compiler.is_compiling():
        return _dequantize_outside_graph(fmt, data, scale, dtype, out)
    if fmt.method == "fp8":
        return dequantize_fp8(data, scale, fmt.column_block, dtype, out)
    return dequantize_mxfp4(data, scale, dtype, out)


@torch.compiler.disable
def _dequantize_outside_graph(
    fmt: QuantFormat, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None
) -> torch.Tensor:
    """`dequantize` run eagerly from inside a compiled graph on the CPU. Inductor's CPU code for these
    byte lookups and block scales is wrong under some ISAs (torch 2.13: with ATEN_CPU_CAPABILITY=avx2
    and one thread, blocks left unscaled or NaN, and every rewrite tried failed on some ISA or thread
    count; with =default it emits vector code that does not compile)."""
    return dequantize(fmt, data, scale, dtype, out)


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
