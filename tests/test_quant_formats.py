"""The low-precision formats' arithmetic (archon.quant.formats) against hand computations."""

import math
import re

import pytest
import torch

from archon.quant.formats import (
    FP4_VALUES,
    QuantFormat,
    compressed_tensors_config,
    dequantize,
    dequantize_fp8,
    dequantize_mxfp4,
    fp8_rows_from_checkpoint,
    mxfp4_rows_from_checkpoint,
    quant_format_from_config,
    quantize_fp8,
    quantize_mxfp4,
)


def _hand_fp8(q: torch.Tensor, scale: torch.Tensor, block: tuple[int | None, int | None]) -> torch.Tensor:
    """w[i, j] = q[i, j] * scale[i // br, j // bc], element by element (None: the whole dimension)."""
    rows, cols = q.shape
    br, bc = block[0] or rows, block[1] or cols
    scale = scale.reshape(math.ceil(rows / br), math.ceil(cols / bc))
    out = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            out[i, j] = q[i, j].float() * scale[i // br, j // bc]
    return out


@pytest.mark.parametrize("block", [(16, 24), (128, 128), (7, 5), (1, None), (None, None)])
def test_fp8_storage_dequantizes_as_the_published_recipe(block):
    """Odd shapes leave partial edge blocks; the storage (scales repeated per row) dequantizes to
    the hand computation, and quantization is the block recipe (scale = amax / 448)."""
    torch.manual_seed(0)
    weight = torch.randn(37, 53)
    q, scale = quantize_fp8(weight, block)
    br, bc = block[0] or 37, block[1] or 53
    assert scale.shape == (math.ceil(37 / br), math.ceil(53 / bc))
    first = weight[:br, :bc]
    assert scale[0, 0].item() == pytest.approx(first.abs().max().item() / 448.0, rel=1e-6)
    data, rows_scale = fp8_rows_from_checkpoint(q, scale, block[0])
    assert data.dtype == torch.uint8 and rows_scale.dtype == torch.int32 and rows_scale.shape[0] == 37
    column_block = block[1]
    got = dequantize_fp8(data, rows_scale, column_block, torch.float32)
    assert torch.equal(got, _hand_fp8(q, scale, block))
    assert (got - weight).abs().max() <= weight.abs().max() / 448 * 16  # e4m3: 3 mantissa bits


def test_fp8_one_scale_per_tensor_in_any_stored_layout():
    q, scale = quantize_fp8(torch.randn(9, 10), (None, None))
    for stored in (scale.reshape(()), scale.reshape(1), scale.reshape(1, 1)):
        data, rows_scale = fp8_rows_from_checkpoint(q, stored, None)
        assert torch.equal(dequantize_fp8(data, rows_scale, None, torch.float32), q.float() * scale.reshape(()))


def _hand_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """[out, G, 16] bytes, [out, G] exponents -> [out, 32 G]: low nibble first, value * 2^(e - 127)."""
    out_rows, groups, _ = blocks.shape
    out = torch.empty(out_rows, groups * 32)
    for r in range(out_rows):
        for g in range(groups):
            for b in range(16):
                byte = int(blocks[r, g, b])
                for half, nibble in enumerate((byte & 0x0F, byte >> 4)):
                    out[r, g * 32 + 2 * b + half] = FP4_VALUES[nibble] * 2.0 ** (int(scales[r, g]) - 127)
    return out


def test_mxfp4_dequantizes_as_the_published_recipe():
    torch.manual_seed(1)
    weight = torch.randn(2, 5, 64) * torch.tensor([1e-3, 1.0, 40.0, 0.5, 3.0])[None, :, None]
    blocks, scales = quantize_mxfp4(weight)
    assert blocks.shape == (2, 5, 2, 16) and scales.shape == (2, 5, 2) and blocks.dtype == torch.uint8
    data, scale = mxfp4_rows_from_checkpoint(blocks, scales)
    got = dequantize_mxfp4(data, scale, torch.float32)
    for e in range(2):
        assert torch.equal(got[e], _hand_mxfp4(blocks[e], scales[e]))
    # OCP MX: e = floor(log2(amax)) - 2, elements rounded to the nearest e2m1 value (clamped at 6)
    group = weight[0, 2, :32]
    exponent = math.floor(math.log2(group.abs().max().item())) - 2
    assert int(scales[0, 2, 0]) == exponent + 127
    grid = torch.tensor(FP4_VALUES[:8]) * 2.0**exponent
    nearest = grid[(group.abs().clamp(max=6 * 2.0**exponent)[:, None] - grid).abs().argmin(-1)] * group.sign()
    assert torch.equal(got[0, 2, :32], nearest)


def test_compiled_dequantization_matches_eager():
    """Partial fp8 blocks and mxfp4 bytes give the eager values under torch.compile too."""
    q, scale = quantize_fp8(torch.randn(40, 50), (16, 24))
    data, rows_scale = fp8_rows_from_checkpoint(q, scale, 16)
    fmt = QuantFormat("fp8", (16, 24))
    eager = dequantize(fmt, data, rows_scale, torch.float32)
    assert torch.equal(torch.compile(dequantize)(fmt, data, rows_scale, torch.float32), eager)
    data, scales = mxfp4_rows_from_checkpoint(*quantize_mxfp4(torch.randn(3, 8, 64)))
    fmt = QuantFormat("mxfp4", (1, 32))
    eager = dequantize(fmt, data, scales, torch.float32)
    assert torch.equal(torch.compile(dequantize)(fmt, data, scales, torch.float32), eager)


def test_formats_from_quantization_config():
    fp8 = quant_format_from_config({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 64]})
    assert (fp8.method, fp8.block_size, fp8.scale_suffix) == ("fp8", (128, 64), "_scale_inv")
    assert fp8.stored_keys("a.weight") == ("a.weight", "a.weight_scale_inv")
    mx = quant_format_from_config({"quant_method": "mxfp4"})
    assert mx.stored_keys("e.gate_up_proj") == ("e.gate_up_proj_blocks", "e.gate_up_proj_scales")
    for strategy, block in (("channel", (1, None)), ("tensor", (None, None)), ("block", (128, 128))):
        ct = quant_format_from_config(compressed_tensors_config(strategy, block if strategy == "block" else None))
        assert (ct.block_size, ct.scale_suffix) == (block, "_scale")
        assert ct.quantization_config()["quant_method"] == "compressed-tensors"
    assert quant_format_from_config(None) is None


@pytest.mark.parametrize(
    "config, field",
    [
        ({"quant_method": "awq"}, "quant_method='awq'"),
        ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "fmt='e5m2'"),
        ({"quant_method": "fp8"}, "weight_block_size=None"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size=[128]"),
        ({"quant_method": "compressed-tensors", "format": "pack-quantized"}, "format='pack-quantized'"),
        (dict(compressed_tensors_config("group"), format="float-quantized"), "strategy='group'"),
    ],
)
def test_unreadable_quantization_configs_name_the_field(config, field):
    with pytest.raises(ValueError, match="m/config.json: quantization_config.*" + re.escape(field)):
        quant_format_from_config(config, "m/config.json")


@pytest.mark.parametrize("columns", [37, 38, 64])
def test_table_lookup_covers_every_byte_chunk_edges_offsets_and_out(monkeypatch, columns):
    """The table-lookup dequantization equals float8 -> fp32 conversion times the block scales for
    every byte value (NaN codes included), odd and even widths, chunks of a few rows, data at an odd
    byte offset, and writes into a given `out`."""
    import archon.quant.formats as formats

    monkeypatch.setitem(formats._CHUNK_ELEMENTS, "cpu", 3 * columns)  # chunks of 3 rows
    rows, block = 13, 16
    data = (torch.arange(rows * (columns + 1)) * 7 % 256).to(torch.uint8).reshape(rows, columns + 1)
    for view in (data[:, :columns], data[:, 1:]):  # the second starts at an odd byte offset
        scale = torch.rand(rows, math.ceil(columns / block)) + 0.5
        expected = view.contiguous().view(torch.float8_e4m3fn).float() * scale.repeat_interleave(block, -1)[:, :columns]
        got = dequantize_fp8(view, scale.view(torch.int32), block, torch.float32)
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
        out = torch.empty(rows, columns, dtype=torch.bfloat16)
        dequantize_fp8(view, scale.view(torch.int32), block, torch.bfloat16, out=out)
        torch.testing.assert_close(out, expected.bfloat16(), rtol=0, atol=0, equal_nan=True)
    bytes_ = torch.arange(256, dtype=torch.uint8).reshape(8, 32)  # every pair of e2m1 nibbles
    exponents = torch.tensor([[127], [100], [130], [127], [0], [200], [127], [120]], dtype=torch.uint8)
    got = dequantize_mxfp4(bytes_, exponents.repeat(1, 2), torch.float32)
    assert torch.equal(got, _hand_mxfp4(bytes_.reshape(8, 2, 16), exponents.repeat(1, 2)))
