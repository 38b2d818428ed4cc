from __future__ import annotations

from dataclasses import dataclass

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf

_LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass
class GptOssArgs(DecoderArgs):
    """GPT-OSS hyper-parameters, named as in the HF config (intermediate_size is per expert)."""

    attention_bias: bool
    sliding_window: int | None
    layer_types: list[str]
    num_local_experts: int
    num_experts_per_tok: int
    swiglu_alpha: float
    swiglu_limit: float

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries, but config.num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        unknown = sorted({t for t in self.layer_types if t not in _LAYER_TYPES})
        if unknown:
            raise ValueError(f"config.layer_types has unsupported type(s) {unknown}; supported: {list(_LAYER_TYPES)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError(
                f"config.layer_types has sliding_attention layers, but config.sliding_window is {self.sliding_window!r}"
            )

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        """The attention window of a layer; None for full causal attention."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None

    @classmethod
    def from_hf_config(cls, config) -> "GptOssArgs":
        return cls(
            **decoder_fields_from_hf(config),
            attention_bias=bool(config.attention_bias),
            sliding_window=config.sliding_window,
            layer_types=list(config.layer_types),
            num_local_experts=config.num_local_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            swiglu_alpha=float(config.swiglu_alpha),
            swiglu_limit=float(config.swiglu_limit),
        )
