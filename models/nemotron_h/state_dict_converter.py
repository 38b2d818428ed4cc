"""HF Nemotron-H keys <-> archon.

Checkpoints (released ones, and those transformers' `save_pretrained` writes) put the decoder under
`backbone.`; HF's in-memory model, and so PEFT's adapter keys, under `model.` (transformers' conversion
mapping renames one into the other on load). Under either prefix the embedding is `embeddings` and the
final norm `norm_f`; archon names them `embed_tokens` and `norm`, and every block's `norm` and `mixer`
as HF does. Base weights are read under either prefix and written under `backbone.`.

An MoE block's routed experts are stacked in archon and in HF's in-memory model
(`mixer.experts.up_proj` [E, I, D], `mixer.experts.down_proj` [E, D, I]) and stored one by one in
checkpoints (`mixer.experts.<e>.up_proj.weight`, ...); either form is read, the per-expert one written.
Their LoRA is PEFT's `target_parameters` layout (models/common/state_dict.py): up_proj's factors at
`experts.base_layer.lora_*`, down_proj's at `experts.lora_*`.
"""

from __future__ import annotations

import torch

from archon.checkpoint.state_dict_converter import PEFT_PREFIX
from archon.models.common.state_dict import StackedExpertsAdapter

_RENAMES = {"embed_tokens.": "embeddings.", "norm.": "norm_f."}
CHECKPOINT_PREFIX = "backbone."
IN_MEMORY_PREFIX = "model."


def _decoder_key(archon_key: str) -> str:
    for archon_name, hf_name in _RENAMES.items():
        if archon_key.startswith(archon_name):
            return hf_name + archon_key[len(archon_name) :]
    return archon_key


def _in_memory(hf_key: str) -> str:
    """A checkpoint name under HF's in-memory prefix."""
    if hf_key.startswith(CHECKPOINT_PREFIX):
        return IN_MEMORY_PREFIX + hf_key[len(CHECKPOINT_PREFIX) :]
    return hf_key


class NemotronHStateDictConverter(StackedExpertsAdapter):
    hf_prefix = CHECKPOINT_PREFIX
    expert_layers = r"layers\.\d+"
    expert_module = "mixer.experts"
    expert_weights = ("up_proj", "down_proj")
    hf_expert_parts = {"up_proj": ("up_proj",), "down_proj": ("down_proj",)}
    # none (StateDictConverter's default): the dense blocks' up_proj/down_proj are exported as target_modules
    peft_reserved_module_names = ()

    def _num_experts(self) -> int:
        return self.args.n_routed_experts

    def hf_name(self, archon_key: str) -> str:
        """The checkpoint name of an archon key."""
        if archon_key.startswith(self.top_level):
            return archon_key
        return CHECKPOINT_PREFIX + _decoder_key(archon_key)

    def in_memory_name(self, archon_key: str) -> str:
        """HF's in-memory name (and PEFT's module path) of an archon key."""
        return _in_memory(self.hf_name(archon_key))

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        """Checkpoint names, or in-memory ones where the checkpoint holds those instead."""
        checkpoint, in_memory = self.hf_name(archon_key), self.in_memory_name(archon_key)
        if in_memory in hf_keys and checkpoint not in hf_keys:
            return [in_memory]
        sources = super().hf_sources(archon_key, hf_keys)
        if _in_memory(sources[0]) in hf_keys and sources[0] not in hf_keys:
            return [_in_memory(key) for key in sources]
        return sources

    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """PEFT's keys follow HF's in-memory names."""
        return [
            (PEFT_PREFIX + _in_memory(key[len(PEFT_PREFIX) :]), t)
            for key, t in super().lora_to_peft(archon_key, tensor)
        ]
