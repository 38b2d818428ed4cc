import re

import torch

from archon.models.common.state_dict import MultiTokenPredictionCheckpointAdapter

# An archon MoE key other than the stacked experts: the router weight or its correction bias.
_ROUTER_KEY = re.compile(r"(layers\.\d+)\.mlp\.gate\.(weight|e_score_correction_bias)")


class MinimaxM2StateDictConverter(MultiTokenPredictionCheckpointAdapter):
    """HF MiniMax-M2 keys. The checkpoint keeps the Mixtral layout: the MoE block is `block_sparse_moe`,
    experts are stored one by one as `experts.<e>.w1` (gate), `w3` (up) and `w2` (down), and the
    correction bias is `block_sparse_moe.e_score_correction_bias`. HF's in-memory model (and so PEFT's
    module paths) names the block `mlp`, stacks the experts and keeps the bias at
    `mlp.e_score_correction_bias`; archon holds the bias on the router (`mlp.gate`). Loading takes
    either layout; exports write the checkpoint's. The multi-token-prediction modules released
    checkpoints carry (`num_mtp_modules` layers numbered from `num_hidden_layers` on) are skipped:
    neither HF's causal LM nor archon builds them.
    """

    hf_expert_parts = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
    # In a Mixtral-layout model PEFT (under transformers v5) reads these target_modules names as the
    # router and per-expert projections.
    peft_reserved_module_names = ("w1", "w2", "w3", "gate")

    def per_expert_hf_name(self, experts: str) -> str:
        return self.hf_name(experts).replace(".mlp.", ".block_sparse_moe.")

    def _router_names(self, archon_key: str) -> tuple[str, str] | None:
        """(checkpoint name, in-memory HF name) of a router key, or None for any other key."""
        match = _ROUTER_KEY.fullmatch(archon_key)
        if match is None:
            return None
        layer, leaf = match.groups()
        suffix = "gate.weight" if leaf == "weight" else "e_score_correction_bias"
        return self.hf_name(f"{layer}.block_sparse_moe.{suffix}"), self.hf_name(f"{layer}.mlp.{suffix}")

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        names = self._router_names(archon_key)
        if names is None:
            return super().hf_sources(archon_key, hf_keys)
        checkpoint_name, in_memory_name = names
        return [in_memory_name if in_memory_name in hf_keys and checkpoint_name not in hf_keys else checkpoint_name]

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        names = self._router_names(archon_key)
        if names is None:
            return super().to_hf(archon_key, tensor)
        return [(names[0], tensor)]
