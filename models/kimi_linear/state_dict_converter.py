"""HF Kimi Linear keys <-> archon.

Checkpoints (released ones, and those transformers' `save_pretrained` writes) name modules apart from
HF's in-memory model, which transformers' conversion mapping renames on load:
- a layer's MLP is `block_sparse_moe` (in memory `mlp`); released checkpoints name dense layers `mlp`;
- routed experts are per expert, `experts.<e>.w1` (gate), `w3` (up), `w2` (down) (in memory stacked
  `experts.gate_up_proj` / `experts.down_proj`);
- the KDA forget gate's `f_a_proj`, `f_b_proj`, `dt_bias` and `A_log` sit on `self_attn` (in memory
  under `self_attn.forget_gate`);
- the KDA convs are `q_conv1d`, `k_conv1d`, `v_conv1d` (in memory concatenated into `conv1d`).
archon names its modules as the checkpoint does for the convs and as the in-memory model otherwise.
Base weights are read under either naming and written as `save_pretrained` writes them; PEFT adapter
keys follow the in-memory module paths, which PEFT wraps.
"""

from __future__ import annotations

import re

import torch

from archon.models.common.state_dict import StackedExpertsAdapter

_CONV = re.compile(r"(layers\.\d+\.self_attn)\.([qkv])_conv1d\.weight")
_CHECKPOINT_FORGET_GATE = re.compile(r"(\.self_attn)\.(f_a_proj|f_b_proj|dt_bias|A_log)\b")
_CHECKPOINT_MLP = ".block_sparse_moe."


def in_memory_name(hf_key: str) -> str:
    """A checkpoint key (or module path) as HF's in-memory model names it."""
    return _CHECKPOINT_FORGET_GATE.sub(r"\1.forget_gate.\2", hf_key.replace(_CHECKPOINT_MLP, ".mlp."))


class KimiLinearStateDictConverter(StackedExpertsAdapter):
    hf_expert_parts = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

    def hf_name(self, archon_key: str) -> str:
        """The checkpoint name of an archon key."""
        name = super().hf_name(archon_key).replace(".forget_gate.", ".")
        return name.replace(".mlp.", _CHECKPOINT_MLP)

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        sources = super().hf_sources(archon_key, hf_keys)
        if all(s in hf_keys for s in sources):
            return sources
        conv = _CONV.fullmatch(archon_key)
        if conv is not None:
            in_memory = [f"{self.hf_prefix}{conv.group(1)}.conv1d.weight"]
        else:
            in_memory = [in_memory_name(self.hf_name(archon_key))]
        # HF's in-memory names, which are also a released checkpoint's names of a dense layer's MLP
        return in_memory if all(s in hf_keys for s in in_memory) else sources

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        conv = _CONV.fullmatch(archon_key)
        if conv is not None and len(tensors) == 1 and tensors[0].shape[0] == 3 * self._kda_width():
            index = "qkv".index(conv.group(2))  # HF's fused conv1d: [q | k | v] channels
            return tensors[0].narrow(0, index * self._kda_width(), self._kda_width())
        return super().combine(archon_key, tensors)

    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(in_memory_name(key), t) for key, t in super().lora_to_peft(archon_key, tensor)]

    def _kda_width(self) -> int:
        return self.args.linear_num_heads * self.args.linear_head_dim
