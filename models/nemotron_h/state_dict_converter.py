"""HF Nemotron-H keys <-> archon.

Checkpoints (released ones, and those transformers' `save_pretrained` writes) put the decoder under
`backbone.`; HF's in-memory model, and so PEFT's adapter keys, under `model.` (transformers' conversion
mapping renames one into the other on load). Under either prefix the embedding is `embeddings` and the
final norm `norm_f`; archon names them `embed_tokens` and `norm`, and every block's `norm` and `mixer`
as HF does. Base weights are read under either prefix and written under `backbone.`.
"""

from __future__ import annotations

from archon.checkpoint.state_dict_converter import StateDictConverter

_RENAMES = {"embed_tokens.": "embeddings.", "norm.": "norm_f."}
CHECKPOINT_PREFIX = "backbone."
IN_MEMORY_PREFIX = "model."


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
        return [in_memory] if checkpoint not in hf_keys and in_memory in hf_keys else [checkpoint]

    def lora_to_peft(self, archon_key, tensor):
        return [
            (key.replace(f".{CHECKPOINT_PREFIX}", f".{IN_MEMORY_PREFIX}", 1), t)
            for key, t in super().lora_to_peft(archon_key, tensor)
        ]
