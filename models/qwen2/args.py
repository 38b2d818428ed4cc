from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.common.args import DecoderArgs, decoder_fields_from_hf

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass
class Qwen2Args(DecoderArgs):
    """Qwen2 / Qwen2.5 hyper-parameters, named as in the HF config.

    layer_types: one of "full_attention" / "sliding_attention" per layer. HF derives it from
    use_sliding_window and max_window_layers (layers at index >= max_window_layers slide) unless
    the config lists it; sliding_window is None unless use_sliding_window is set.
    """

    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"config.layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers"
            )
        for i, layer_type in enumerate(self.layer_types):
            if layer_type not in (FULL_ATTENTION, SLIDING_ATTENTION):
                raise ValueError(
                    f"config.layer_types[{i}]={layer_type!r} is not supported; "
                    f"expected {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
                )
            if layer_type == SLIDING_ATTENTION and self.sliding_window is None:
                raise ValueError(
                    f"config.layer_types[{i}] is {SLIDING_ATTENTION!r} but config.sliding_window is None "
                    "(HF sets it to None unless use_sliding_window=True)"
                )

    def layer_sliding_window(self, layer_idx: int) -> int | None:
        return self.sliding_window if self.layer_types[layer_idx] == SLIDING_ATTENTION else None

    @classmethod
    def from_hf_config(cls, config) -> "Qwen2Args":
        fields = decoder_fields_from_hf(config)
        use_sliding_window = bool(getattr(config, "use_sliding_window", False))
        sliding_window = getattr(config, "sliding_window", None) if use_sliding_window else None
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:  # configs from before layer_types existed
            max_window_layers = getattr(config, "max_window_layers", fields["num_hidden_layers"])
            layer_types = [
                SLIDING_ATTENTION if sliding_window is not None and i >= max_window_layers else FULL_ATTENTION
                for i in range(fields["num_hidden_layers"])
            ]
        return cls(**fields, sliding_window=sliding_window, layer_types=list(layer_types))
