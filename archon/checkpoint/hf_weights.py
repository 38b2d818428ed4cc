"""A model's base weights from and to Hugging Face checkpoints, quantized bases included: loading
every base weight of a built model (`load_hf_weights`), and writing base + s*B@A as a plain or
requantized HF checkpoint (`save_merged_hf`). Above both the safetensors files
(archon.checkpoint.hf) and the quantized storage (archon.quant) that they put together."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
from torch import nn

from archon.checkpoint.hf import (
    HFCheckpoint,
    check_source_shapes,
    copy_local_into,
    expected_base_params,
    read_local,
    save_hf_checkpoint,
    warn_non_finite,
)
from archon.checkpoint.state_dict_converter import StateDictConverter, is_lora_param
from archon.dtensor import full_tensor
from archon.lora.peft import merged_named_tensors
from archon.lora.utils import merge_lora, unmerge_lora
from archon.quant.checkpoint import load_quantized_weight
from archon.quant.export import requantized
from archon.quant.formats import QuantFormat
from archon.quant.modules import dense_base_tensors, is_quantized_storage, quantized_weights


@torch.no_grad()
def load_hf_weights(model: nn.Module, converter: StateDictConverter, checkpoint: HFCheckpoint) -> None:
    """Copy every base weight from `checkpoint` into `model`; fail naming any missing, unexpected or
    mis-shaped key before anything is copied. A quantized checkpoint (archon.quant.QuantizedCheckpoint)
    fills the weights the model keeps quantized with their storage and dequantizes the others."""
    quantized = quantized_weights(model)
    hf_keys = checkpoint.keys()
    expected = {k: v for k, v in expected_base_params(model).items() if not is_quantized_storage(k)}
    for key, (module, name) in quantized.items():
        expected[key] = torch.empty(module._quantized[name].shape, device="meta")
    plan: dict[str, list[str]] = {}
    missing: list[str] = []
    for key in expected:
        sources = converter.hf_sources(key, hf_keys)
        absent = [s for s in sources if s not in hf_keys]
        if absent:
            missing.append(f"{absent[0]!r} (for {key!r})")
        plan[key] = sources
    used = {s for sources in plan.values() for s in sources}
    unexpected = sorted(k for k in hf_keys - used if not converter.is_ignored(k))
    errors = []
    if missing:
        errors.append(f"missing {len(missing)} key(s): " + ", ".join(missing[:5]))
    if unexpected:
        errors.append(f"unexpected {len(unexpected)} key(s): " + ", ".join(repr(k) for k in unexpected[:5]))
    if errors:
        raise KeyError(f"checkpoint {str(checkpoint.path)!r} does not match the model: " + "; ".join(errors))

    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    for key, sources in plan.items():
        check_source_shapes(converter, checkpoint, key, sources, tuple(expected[key].shape))
    for key, sources in plan.items():
        if key in quantized:
            load_quantized_weight(*quantized[key], converter, checkpoint, key, sources)
            continue
        target = params[key]
        local = read_local(converter, checkpoint, key, sources, target)
        warn_non_finite(sources[0] if len(sources) == 1 else key, local, checkpoint.file_of(sources[0]))
        copy_local_into(target, local, key)


def save_merged_hf(
    model: nn.Module,
    converter: StateDictConverter,
    out_dir: str | os.PathLike,
    hf_config: dict,
    source_dir: str | os.PathLike | None = None,
    write: bool = True,
    requantize: tuple[QuantFormat, frozenset[str]] | None = None,
) -> Path:
    """Write base + s*B@A as a plain HF checkpoint (merged in fp32), leaving the model unmerged.

    Without LoRA this writes the model as it is (e.g. after full fine-tuning). Under FSDP/TP every
    rank calls this (shards are gathered); only `write=True` ranks write. `source_dir`, the checkpoint
    the model was built from, gives the tokenizer files and the weights archon does not build but
    the export must carry (`StateDictConverter.carried_hf_keys`, e.g. a vision tower).

    A model built from a quantized checkpoint (archon.quant; kept quantized or dequantized at load)
    is written by default dequantized, in its build dtype, as W + s*B@A, without
    `quantization_config`: that is the trained model exactly. `requantize` = (format, the HF weights
    the source stored in it), i.e. (LoadedModel.quant_format, LoadedModel.quantized_hf_keys), writes
    those weights again in the source's format after the merge, with the same tensor names, dtypes
    and shapes as the source and its `quantization_config`: a checkpoint of the source's size that
    the source's serving kernels run, but rounded to the format's grid, so adapter deltas smaller
    than half a quantization step of their block are lost (archon.quant.export.requantized)."""
    quantized = bool(quantized_weights(model))
    # The written weights are in the format `requantize` names, or plain: the source's
    # quantization_config (which a model dequantized at load has too) describes neither.
    hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if requantize is not None:
        hf_config["quantization_config"] = requantize[0].quantization_config()
    if not quantized:
        merge_lora(model)
    try:
        if quantized:  # the adapter is added to a dequantized copy of each weight
            base = dict(merged_named_tensors(model, dense_base_tensors(model)))
            for key, value in model.state_dict().items():  # persistent buffers
                if not is_lora_param(key) and not key.endswith(("_qdata", "_qscale")) and key not in base:
                    base[key] = full_tensor(value)
        else:
            base = {k: full_tensor(v) for k, v in model.state_dict().items() if not is_lora_param(k)}
        extra = {}
        if source_dir is not None:
            for f in Path(source_dir).iterdir():
                if f.name.startswith(
                    ("tokenizer", "special_tokens", "vocab", "merges", "generation_config", "chat_template")
                ):
                    extra[f.name] = f.read_bytes()
        path = Path(out_dir)
        if write:
            tensors = converter.iter_to_hf(base.items())
            if requantize is not None:
                tensors = requantized(tensors, *requantize, complete=True)
            if source_dir is not None and converter.carried_hf_keys:
                tensors = itertools.chain(tensors, _carried_tensors(converter, source_dir))
            save_hf_checkpoint(tensors, out_dir, hf_config, extra_files=extra)
    finally:
        if not quantized:
            unmerge_lora(model)
    return path


def _carried_tensors(converter: StateDictConverter, source_dir: str | os.PathLike):
    checkpoint = HFCheckpoint(source_dir)
    for key in sorted(checkpoint.keys()):
        if converter.is_carried(key):
            yield key, checkpoint.get(key)
