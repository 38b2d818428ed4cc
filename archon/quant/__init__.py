"""Low-precision bases: FP8 block-scaled and MXFP4 checkpoints, kept quantized under LoRA."""

from archon.quant.checkpoint import QuantizedCheckpoint
from archon.quant.formats import (
    QuantFormat,
    dequantize,
    quant_format_from_config,
    quant_format_of_config_file,
    quantize_to_checkpoint,
)
from archon.quant.modules import (
    QuantizedWeights,
    dense_base_tensors,
    quantize_base_weights,
    quantized_weights,
)

__all__ = [
    "QuantFormat",
    "QuantizedCheckpoint",
    "QuantizedWeights",
    "dense_base_tensors",
    "dequantize",
    "quant_format_from_config",
    "quant_format_of_config_file",
    "quantize_base_weights",
    "quantize_to_checkpoint",
    "quantized_weights",
]
