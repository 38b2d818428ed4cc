from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from archon.models.common.args import HybridDeltaNetArgs, hybrid_deltanet_fields_from_hf, is_sparse_layer


@dataclass
class Qwen3NextArgs(HybridDeltaNetArgs):
    """Qwen3-Next hyper-parameters, named as in the HF config.

    HF derives layer_types from `full_attention_interval` (every n-th layer full) unless the config
    lists it. Layer i has a sparse MLP (routed experts, renormalised over the top k when
    norm_topk_prob, plus a gated shared expert) when num_experts > 0, i is not in mlp_only_layers and
    (i + 1) is a multiple of decoder_sparse_step; otherwise a dense SwiGLU MLP of intermediate_size.
    """

    mtp_config_field: ClassVar[str] = "num_nextn_predict_layers"

    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return is_sparse_layer(layer_idx, self.num_experts, self.decoder_sparse_step, self.mlp_only_layers)

    @classmethod
    def from_hf_config(cls, config) -> "Qwen3NextArgs":
        args = cls(
            **hybrid_deltanet_fields_from_hf(config),
            norm_topk_prob=bool(config.norm_topk_prob),
            decoder_sparse_step=config.decoder_sparse_step,
            mlp_only_layers=list(config.mlp_only_layers or []),
            checkpoint_mtp_layers=int(getattr(config, "num_nextn_predict_layers", 0) or 0),
        )
        args.validate()
        return args

    def validate(self) -> None:
        super().validate()
        if self.decoder_sparse_step < 1:
            raise ValueError(f"config.decoder_sparse_step={self.decoder_sparse_step} must be at least 1")
        out_of_range = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if out_of_range:
            raise ValueError(f"config.mlp_only_layers holds {out_of_range}, outside 0..{self.num_hidden_layers - 1}")
        if self.num_experts > 0 and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"config.num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"config.num_experts={self.num_experts}"
            )
        dense_layers = [i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i)]
        if dense_layers and self.intermediate_size <= 0:
            raise ValueError(
                f"layers {dense_layers} have a dense MLP (mlp_only_layers, decoder_sparse_step or num_experts=0) "
                f"but config.intermediate_size={self.intermediate_size}"
            )
