from archon.lora.config import LoRAConfig
from archon.lora.layers import ExpertLoRA, LoRALinear, LoRAModule, linear, merged_weight
from archon.lora.utils import (
    adapter_disabled,
    configure_lora_modules,
    is_lora_param,
    lora_modules,
    lora_parameters,
    lora_state_dict,
    mark_only_lora_trainable,
    merge_lora,
    reset_lora_parameters,
    set_adapter_enabled,
    unmerge_lora,
)

__all__ = [
    "ExpertLoRA",
    "LoRAConfig",
    "LoRALinear",
    "LoRAModule",
    "adapter_disabled",
    "configure_lora_modules",
    "is_lora_param",
    "linear",
    "lora_modules",
    "lora_parameters",
    "lora_state_dict",
    "mark_only_lora_trainable",
    "merge_lora",
    "merged_weight",
    "reset_lora_parameters",
    "set_adapter_enabled",
    "unmerge_lora",
]
