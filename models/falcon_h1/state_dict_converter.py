"""HF Falcon-H1 keys <-> archon: HF's names under `model.` (checkpoints and the in-memory model alike),
but the final norm, which HF names `final_layernorm` and archon `norm`."""

from __future__ import annotations

from archon.checkpoint.state_dict_converter import StateDictConverter


class FalconH1StateDictConverter(StateDictConverter):
    def hf_name(self, archon_key: str) -> str:
        if archon_key.startswith("norm."):
            return self.hf_prefix + "final_layernorm." + archon_key[len("norm.") :]
        return super().hf_name(archon_key)
