"""What the trainer sends: the adapter in PEFT naming, or merged weights in HF naming.

Both gather DTensor shards (FSDP/TP), so every trainer rank must iterate them together; only the
rank that talks to the rollout servers needs the values.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from archon.checkpoint.state_dict_adapter import StateDictAdapter
from archon.lora.layers import ExpertLoRA, LoRALinear
from archon.lora.peft import full_tensor, peft_state_dict


def adapter_payload(model: nn.Module, adapter: StateDictAdapter) -> dict[str, torch.Tensor]:
    """The adapter tensors under PEFT keys (`base_model.model.<hf path>.lora_A.weight`)."""
    return peft_state_dict(model, adapter)


@torch.no_grad()
def merged_payload(model: nn.Module, adapter: StateDictAdapter) -> Iterator[tuple[str, torch.Tensor]]:
    """W + s*B@A (computed in fp32, cast to the base dtype) for every module that carries LoRA,
    MoE experts included, under HF names. The model's own weights are not touched."""
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            weight = full_tensor(module.weight.detach())
            a, b = full_tensor(module.lora_a.weight.detach()), full_tensor(module.lora_b.weight.detach())
            merged = weight.float() + (b.float() @ a.float()) * module.scaling
            yield from adapter.to_hf(f"{path}.weight", merged.to(weight.dtype).cpu())
        elif any(isinstance(child, ExpertLoRA) for child in module.children()):
            for name, lora in module.named_children():
                if not isinstance(lora, ExpertLoRA):
                    continue
                weight_name = name.removesuffix("_lora")
                weight = full_tensor(getattr(module, weight_name).detach())
                a, b = full_tensor(lora.lora_a.detach()), full_tensor(lora.lora_b.detach())
                delta = torch.bmm(b.float(), a.float()) * lora.scaling  # [E, out, in]
                if getattr(module, "input_major", False):
                    delta = delta.transpose(1, 2)
                merged = (weight.float() + delta).to(weight.dtype).cpu()
                yield from adapter.to_hf(f"{path}.{weight_name}", merged)
