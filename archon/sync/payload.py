"""What the trainer sends: the adapter in PEFT naming, or merged (or all) weights in HF naming.

Both gather DTensor shards (FSDP/TP), so every trainer rank must iterate them together; only the
rank that talks to the rollout servers needs the values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora.layers import ExpertLoRA, LoRALinear
from archon.lora.peft import full_tensor, peft_state_dict
from archon.lora.utils import is_lora_param


def adapter_payload(model: nn.Module, converter: StateDictConverter) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT keys (`base_model.model.<hf path>.lora_A.weight`)."""
    return peft_state_dict(model, converter)


def _sync_unit(path: str) -> str:
    """The module whose weights travel together when the LoRA module at `path` is merged: its
    parent (`layers.3.self_attn.q_proj` -> `layers.3.self_attn`, an expert LoRA -> its experts
    module), or the module itself at the top level (an adapted lm_head)."""
    parent = path.rpartition(".")[0]
    return parent or path


def _merged(model: nn.Module, key: str, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (parameter `key`, gathered) plus its LoRA delta s*B@A when it carries one, in fp32."""
    module_path, _, param_name = key.rpartition(".")
    module = model.get_submodule(module_path)
    if isinstance(module, LoRALinear) and param_name == "weight":
        delta = module.delta_weight()
    elif isinstance(lora := getattr(module, f"{param_name}_lora", None), ExpertLoRA):
        delta = lora.delta_weight()  # [E, out, in]
        if getattr(module, "input_major", False):
            delta = delta.transpose(1, 2)
    else:
        return tensor
    return (tensor.float() + full_tensor(delta)).to(tensor.dtype)


@torch.no_grad()
def merged_payload(model: nn.Module, converter: StateDictConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights of every module that holds LoRA-adapted weights (an attention, an MLP, a
    shared-expert MLP, a stacked-experts module), with W + s*B@A (computed in fp32, cast to the base
    dtype) where a LoRA applies and the base weights elsewhere. The model's own weights are not
    touched.

    The holder's other weights go too, because servers fuse siblings (q/k/v, gate/up, all experts
    and their biases) into one tensor, and vLLM's in-place reload leaves the part of a fused tensor
    that was not sent uninitialised."""
    units = list(dict.fromkeys(_sync_unit(path) for path, module in model.named_modules()
                               if isinstance(module, (LoRALinear, ExpertLoRA))))  # fmt: skip
    for unit in units:
        for name, param in model.get_submodule(unit).named_parameters(prefix=unit):
            if is_lora_param(name):
                continue
            tensor = _merged(model, name, full_tensor(param.detach()))
            yield from converter.to_hf(name, tensor.cpu())


@torch.no_grad()
def full_payload(model: nn.Module, converter: StateDictConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the model in HF naming, LoRA merged in where there is one (full-weight
    sync, and the merged mode of a model trained without LoRA). Buffers stay as the server loaded
    them: the persistent ones (a router's score-correction bias) are not trained by gradients, and
    vLLM leaves them alone on a reload."""
    for name, param in model.named_parameters():
        if not is_lora_param(name):
            yield from converter.to_hf(name, _merged(model, name, full_tensor(param.detach())).cpu())
