"""Merged weight sync of a model built from a quantized checkpoint: the servers loaded that
checkpoint, so the merged weights can go back in its format (names, dtypes and shapes of the
source's tensors), quantized by the published recipe from the exact dequantized merge."""

import pytest
import torch
from helpers import randomise_lora

from archon.build import build_model
from archon.checkpoint.hf import HFCheckpoint
from archon.lora import LoRAConfig, lora_parameters
from archon.quant import QuantFormat
from archon.quant.export import quantize_checkpoint
from archon.quant.formats import quantize_fp8, quantize_mxfp4
from archon.sync import merged_payload
from archon.tools.align import make_tiny_hf_checkpoint


@pytest.mark.parametrize(
    "model_type, fmt",
    [("qwen3_moe", QuantFormat("fp8", (16, 24))), ("gpt_oss", QuantFormat("mxfp4", (1, 32)))],
)
def test_merged_payload_requantized_to_the_served_format(tmp_path, model_type, fmt):
    source = make_tiny_hf_checkpoint(model_type, tmp_path / "hf")
    quantized = quantize_checkpoint(source, tmp_path / "q", fmt)
    loaded = build_model(quantized, lora=LoRAConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    randomise_lora(lora_parameters(loaded.model), 0.1, torch.Generator().manual_seed(0))
    dense = dict(merged_payload(loaded.model, loaded.converter))
    served = dict(merged_payload(loaded.model, loaded.converter, (loaded.quant_format, loaded.quantized_hf_keys)))
    stored = HFCheckpoint(quantized)
    requantized = [name for name in dense if name in loaded.quantized_hf_keys]
    assert requantized, "the merged units hold quantized weights"
    for name, tensor in dense.items():
        if name not in loaded.quantized_hf_keys:
            assert torch.equal(served[name], tensor), name
            continue
        data_key, scale_key = fmt.stored_keys(name)
        assert name not in served or data_key == name
        for key in (data_key, scale_key):
            assert served[key].dtype == stored.get(key).dtype and served[key].shape == stored.get(key).shape, key
        if fmt.method == "fp8":
            q, scale = quantize_fp8(tensor, fmt.block_size)
            assert torch.equal(served[data_key].view(torch.uint8), q.view(torch.uint8)) and torch.equal(served[scale_key], scale)
        else:
            blocks, scales = quantize_mxfp4(tensor.transpose(-1, -2))
            assert torch.equal(served[data_key], blocks) and torch.equal(served[scale_key], scales)
    # the adapter moved the merged weights off the stored ones
    name = requantized[0]
    data_key, _ = fmt.stored_keys(name)
    assert not torch.equal(served[data_key].view(torch.uint8), stored.get(data_key).view(torch.uint8))
