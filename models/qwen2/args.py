from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import SlidingWindowDecoderArgs, sliding_window_fields_from_hf


@dataclass
class Qwen2Args(SlidingWindowDecoderArgs):
    """Qwen2 / Qwen2.5 hyper-parameters, named as in the HF config (per-layer sliding windows as HF
    derives them from use_sliding_window, max_window_layers and layer_types)."""

    @classmethod
    def from_hf_config(cls, config) -> "Qwen2Args":
        return cls(**sliding_window_fields_from_hf(config))
