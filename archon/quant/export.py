"""Writing quantized checkpoints: a merged export requantized to its source's format, and
`quantize_checkpoint`, which stores an HF checkpoint's linear weights in a low-precision format
by the published recipes (what the tests and benchmarks make their quantized models with)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from archon.checkpoint.hf import HFCheckpoint, save_hf_checkpoint
from archon.quant.formats import QuantFormat, quantize_to_checkpoint

# The weights the published checkpoints of each format store quantized: every linear projection of
# the decoder layers (not the router, embeddings, norms or unembedding) for fp8; the routed experts
# for mxfp4 (GPT-OSS).
QUANTIZED_WEIGHTS = {
    # projections (q_proj, gate_up_proj, ...) and per-expert w1/w2/w3 (Mixtral-style checkpoints, MiniMax-M2)
    "fp8": r"\.layers\.\d+\..*(_proj[a-z_]*|\.experts\.\d+\.w[123])\.weight$",
    "mxfp4": r"\.experts\.(gate_up_proj|down_proj)$",
}


def requantized(
    named_tensors: Iterable[tuple[str, torch.Tensor]], fmt: QuantFormat, hf_keys: frozenset[str], complete: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with those named in `hf_keys` quantized to `fmt` (data and scale tensors, by the
    checkpoint's names). `complete`: `named_tensors` is a whole checkpoint, so a name of `hf_keys`
    it does not hold is an error (raised after the last tensor).

    Requantizing a merged weight rounds W + s*B@A to the format's grid again: an adapter delta
    smaller than half a quantization step of its block is lost, so a requantized merge is an
    approximation of the trained model (the dequantized merge is exact)."""
    missing = set(hf_keys)
    for name, tensor in named_tensors:
        if name in hf_keys:
            missing.discard(name)
            yield from quantize_to_checkpoint(fmt, name, tensor)
        else:
            yield name, tensor
    if complete and missing:
        raise KeyError(
            f"requantizing to {fmt}: {len(missing)} HF weight(s) to quantize are not among the exported tensors, "
            f"e.g. {sorted(missing)[0]!r}; pass the quantized_hf_keys of the model being exported"
        )


def quantize_checkpoint(
    source: str | os.PathLike, out_dir: str | os.PathLike, fmt: QuantFormat, pattern: str | None = None
) -> Path:
    """Copy the HF checkpoint `source` to `out_dir` with the weights matching `pattern` (default:
    QUANTIZED_WEIGHTS of the format) stored in `fmt`, and `quantization_config` in its config."""
    import json

    source = Path(source)
    checkpoint = HFCheckpoint(source)
    regex = re.compile(pattern or QUANTIZED_WEIGHTS[fmt.method])
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = fmt.quantization_config()

    def tensors():
        for key in sorted(checkpoint.keys()):
            tensor = checkpoint.get(key)
            if regex.search(key) and tensor.is_floating_point():
                yield from quantize_to_checkpoint(fmt, key, tensor)
            else:
                yield key, tensor

    extra = {
        f.name: f.read_bytes()
        for f in source.iterdir()
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json")
    }
    save_hf_checkpoint(tensors(), out_dir, config, extra_files=extra)
    return Path(out_dir)
