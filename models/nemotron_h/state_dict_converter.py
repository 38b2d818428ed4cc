"""HF Nemotron-H keys <-> archon.

Checkpoints (released ones, and those transformers' `save_pretrained` writes) put the decoder under
`backbone.`; HF's in-memory model, and so PEFT's adapter keys, under `model.` (transformers' conversion
mapping renames one into the other on load). Under either prefix the embedding is `embeddings` and the
final norm `norm_f`; archon names them `embed_tokens` and `norm`, and every block's `norm` and `mixer`
as HF does. Base weights are read under either prefix and written under `backbone.`.

An MoE block's routed experts are stacked in archon and in HF's in-memory model
(`mixer.experts.up_proj` [E, I, D], `mixer.experts.down_proj` [E, D, I]) and stored one by one in
checkpoints (`mixer.experts.<e>.up_proj.weight`, ...); either form is read, the per-expert one written.
Their LoRA is PEFT's `target_parameters` layout: with both stacked weights targeted PEFT nests the
wrappers, up_proj's factors at `experts.base_layer.lora_*`, down_proj's at `experts.lora_*`; lora_A is
[E*r, in] (expert-major rows), lora_B [out, r*E] (expert-minor columns).
"""

from __future__ import annotations

import re

import torch

from archon.checkpoint.state_dict_converter import PEFT_PREFIX, StateDictConverter
from archon.models.common.state_dict import stacked_lora_from_peft, stacked_lora_to_peft

_RENAMES = {"embed_tokens.": "embeddings.", "norm.": "norm_f."}
CHECKPOINT_PREFIX = "backbone."
IN_MEMORY_PREFIX = "model."
_EXPERT_WEIGHT = re.compile(r"(layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)")
_EXPERT_LORA = re.compile(r"(layers\.\d+\.mixer\.experts)\.(up_proj|down_proj)_lora\.lora_([ab])")
_PEFT_WRAPPER = {"up_proj": "experts.base_layer", "down_proj": "experts"}
EXPERT_TARGET_PARAMETERS = ["mixer.experts.up_proj", "mixer.experts.down_proj"]


def _decoder_key(archon_key: str) -> str:
    for archon_name, hf_name in _RENAMES.items():
        if archon_key.startswith(archon_name):
            return hf_name + archon_key[len(archon_name) :]
    return archon_key


class NemotronHStateDictConverter(StateDictConverter):
    hf_prefix = CHECKPOINT_PREFIX

    def hf_name(self, archon_key: str) -> str:
        """The checkpoint name of an archon key."""
        if archon_key.startswith(self.top_level):
            return archon_key
        return CHECKPOINT_PREFIX + _decoder_key(archon_key)

    def in_memory_name(self, archon_key: str) -> str:
        """HF's in-memory name (and PEFT's module path) of an archon key."""
        if archon_key.startswith(self.top_level):
            return archon_key
        return IN_MEMORY_PREFIX + _decoder_key(archon_key)

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        checkpoint = self.hf_name(archon_key)
        in_memory = self.in_memory_name(archon_key)
        if checkpoint in hf_keys or in_memory in hf_keys:
            return [in_memory] if checkpoint not in hf_keys else [checkpoint]
        match = _EXPERT_WEIGHT.fullmatch(archon_key)
        if match is None:
            return [checkpoint]
        experts, which = match.groups()
        per_expert = [f"{experts}.{e}.{which}.weight" for e in range(self.args.n_routed_experts)]
        if self.in_memory_name(per_expert[0]) in hf_keys and self.hf_name(per_expert[0]) not in hf_keys:
            return [self.in_memory_name(key) for key in per_expert]
        return [self.hf_name(key) for key in per_expert]

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        if len(tensors) == 1:
            return tensors[0]
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"per-expert tensors for {archon_key!r} have differing shapes {sorted(shapes)}")
        return torch.stack(tensors)

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = _EXPERT_WEIGHT.fullmatch(archon_key)
        if match is None:
            return super().to_hf(archon_key, tensor)
        experts, which = match.groups()
        return [(self.hf_name(f"{experts}.{e}.{which}.weight"), tensor[e]) for e in range(tensor.shape[0])]

    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = _EXPERT_LORA.fullmatch(archon_key)
        if match is None:
            return [
                (key.replace(f".{CHECKPOINT_PREFIX}", f".{IN_MEMORY_PREFIX}", 1), t)
                for key, t in super().lora_to_peft(archon_key, tensor)
            ]
        experts, which, factor = match.groups()
        block = self.in_memory_name(experts.rsplit(".experts", 1)[0])
        key = f"{PEFT_PREFIX}{block}.{_PEFT_WRAPPER[which]}.lora_{factor.upper()}.weight"
        return [(key, stacked_lora_to_peft(factor, tensor))]

    def lora_from_peft(self, archon_key: str, tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        match = _EXPERT_LORA.fullmatch(archon_key)
        if match is None:
            return super().lora_from_peft(archon_key, tensors, shape)
        (tensor,) = tensors
        return stacked_lora_from_peft(archon_key, match.group(3), tensor, shape)

    def peft_target_parameters(self, lora_keys) -> list[str]:
        if any(_EXPERT_LORA.fullmatch(k) for k in lora_keys):
            return list(EXPERT_TARGET_PARAMETERS)
        return []
