"""What the trainer sends: the adapter in PEFT naming, or merged (or all) weights in HF naming.

Both gather DTensor shards (FSDP/TP), so every trainer rank must iterate them together; only the
rank that talks to the rollout servers needs the values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora.layers import LoRALinear, LoRAModule, merged_weight
from archon.lora.peft import full_tensor, peft_state_dict
from archon.lora.utils import is_lora_param


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


def _merged_tensors(model: nn.Module, named_params) -> Iterator[tuple[str, torch.Tensor]]:
    """(archon name, gathered tensor) of each base parameter in `named_params`, with the delta of
    the LoRA module owning it (its `delta_weight()`) added in fp32 where it has one."""
    deltas: dict[str, dict[str, torch.Tensor]] = {}
    for name, param in named_params:
        if is_lora_param(name):
            continue
        module_path, _, param_name = name.rpartition(".")
        if module_path not in deltas:
            owner = model.get_submodule(module_path)
            deltas[module_path] = owner.delta_weight() if isinstance(owner, LoRAModule) else {}
        tensor = full_tensor(param.detach())
        delta = deltas[module_path].get(param_name)
        yield name, tensor if delta is None else merged_weight(tensor, full_tensor(delta))


@torch.no_grad()
def merged_payload(model: nn.Module, converter: StateDictConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named weights of every module that holds LoRA-adapted weights (an attention, an MLP, a
    shared-expert MLP, a stacked-experts module), with W + s*B@A (computed in fp32, cast to the base
    dtype) where a LoRA applies and the base weights elsewhere. The model's own weights are not
    touched.

    The holder's other weights go too, because servers fuse siblings (q/k/v, gate/up, all experts
    and their biases) into one tensor, and vLLM's in-place reload leaves the part of a fused tensor
    that was not sent uninitialised."""
    units = list(dict.fromkeys(_sync_unit(path, module) for path, module in model.named_modules()
                               if isinstance(module, LoRAModule) and module.adapter_params()))  # fmt: skip
    for unit in units:
        for name, tensor in _merged_tensors(model, model.get_submodule(unit).named_parameters(prefix=unit)):
            yield from converter.to_hf(name, tensor.cpu())


@torch.no_grad()
def full_payload(model: nn.Module, converter: StateDictConverter) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter of the model in HF naming, LoRA merged in where there is one (full-weight
    sync, and the merged mode of a model trained without LoRA). Buffers stay as the server loaded
    them: the persistent ones (a router's score-correction bias) are not trained by gradients, and
    vLLM leaves them alone on a reload."""
    for name, tensor in _merged_tensors(model, model.named_parameters()):
        yield from converter.to_hf(name, tensor.cpu())
