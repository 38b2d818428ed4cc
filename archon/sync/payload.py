"""What the trainer sends: the adapter in PEFT naming, or merged (or all) weights in HF naming.

Both gather DTensor shards (FSDP/TP), so every trainer rank must iterate them together; only the
rank that talks to the rollout servers needs the values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora.layers import LoRALinear, LoRAModule
from archon.lora.peft import merged_named_tensors, peft_state_dict
from archon.quant import QuantFormat, dense_base_tensors
from archon.quant.export import requantized

Requantize = tuple[QuantFormat, frozenset[str]]
"""(format, the HF weights to send in it): what a server serving a quantized checkpoint loads."""


def adapter_payload(model: nn.Module, converter: StateDictConverter) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT keys (`base_model.model.<hf path>.lora_A.weight`)."""
    return peft_state_dict(model, converter)


def _sync_unit(path: str, module: LoRAModule) -> str:
    """The module whose weights travel together when the LoRA module at `path` is merged: the
    parent of a LoRA linear (`layers.3.self_attn.q_proj` -> `layers.3.self_attn`), a stacked-experts
    module itself, or the LoRA linear itself at the top level (an adapted lm_head)."""
    if not isinstance(module, LoRALinear):
        return path
    return path.rpartition(".")[0] or path


def _in_format(tensors: Iterator[tuple[str, torch.Tensor]], requantize: Requantize | None):
    return tensors if requantize is None else requantized(tensors, *requantize)


@torch.no_grad()
def merged_payload(
    model: nn.Module, converter: StateDictConverter, requantize: Requantize | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights of every module that holds LoRA-adapted weights (an attention, an MLP, a
    shared-expert MLP, a stacked-experts module), with W + s*B@A (computed in fp32, cast to the base
    dtype) where a LoRA applies and the base weights elsewhere. The model's own weights are not
    touched. A quantized base (archon.quant) goes dequantized, in the build dtype, unless
    `requantize` names a format: then the weights it names go quantized to it, as the checkpoint
    tensors (data and scale) of a server that serves the quantized checkpoint.

    The holder's other weights go too, because servers fuse siblings (q/k/v, gate/up, all experts
    and their biases) into one tensor, and vLLM's in-place reload leaves the part of a fused tensor
    that was not sent uninitialised."""
    units = list(
        dict.fromkeys(
            _sync_unit(path, module)
            for path, module in model.named_modules()
            if isinstance(module, LoRAModule) and module.adapter_params()
        )
    )
    for unit in units:
        merged = merged_named_tensors(model, dense_base_tensors(model.get_submodule(unit), prefix=unit))
        yield from _in_format((t for name, tensor in merged for t in converter.to_hf(name, tensor.cpu())), requantize)


@torch.no_grad()
def full_payload(
    model: nn.Module, converter: StateDictConverter, requantize: Requantize | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the model in HF naming, LoRA merged in where there is one (full-weight
    sync, and the merged mode of a model trained without LoRA), quantized as `requantize` says
    (merged_payload). Buffers stay as the server loaded them: the persistent ones (a router's
    score-correction bias) are not trained by gradients, and vLLM leaves them alone on a reload."""
    merged = merged_named_tensors(model, dense_base_tensors(model))
    yield from _in_format((t for name, tensor in merged for t in converter.to_hf(name, tensor.cpu())), requantize)
