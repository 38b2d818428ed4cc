from __future__ import annotations

from dataclasses import dataclass, field

from archon.models.deepseek_v3.args import DeepseekV3Args

FULL_INDEXER = "full"
SHARED_INDEXER = "shared"
INDEXED_ATTENTION = "indexed_attention"


@dataclass
class DeepseekV32Args(DeepseekV3Args):
    """DeepSeek-V3.2 (deepseek_v32) and GLM-5 (glm_moe_dsa) hyper-parameters, named as in the HF config.

    DeepSeek-V3's MLA and MoE (see DeepseekV3Args) plus DeepSeek Sparse Attention: each layer's
    lightning indexer (`index_n_heads` heads of `index_head_dim`, the first `qk_rope_head_dim`
    features rotary) scores every earlier key per query, and attention reads only the
    `index_topk` best.

    indexer_rope_interleave: the indexer's rotary features are stored in interleaved pairs (GLM-5)
        rather than half-split (DeepSeek-V3.2). The MLA rotary features are always interleaved.
    indexer_types: per layer, "full" (the layer runs its own indexer) or "shared" (it reuses the
        selection of the nearest full layer before it, and has no indexer weights; GLM-5).
    mlp_layer_types: per layer, "dense" (SwiGLU MLP) or "sparse" (routed + shared experts).
    """

    index_topk: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    indexer_rope_interleave: bool = False
    indexer_types: list[str] = field(default_factory=list)
    mlp_layer_types: list[str] = field(default_factory=list)

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.mlp_layer_types[layer_idx] == "sparse"

    def has_indexer(self, layer_idx: int) -> bool:
        return self.indexer_types[layer_idx] == FULL_INDEXER

    @classmethod
    def from_hf_config(cls, config) -> "DeepseekV32Args":
        fields = vars(DeepseekV3Args.from_hf_config(config))
        if not config.q_lora_rank:
            raise ValueError(
                f"config.q_lora_rank={config.q_lora_rank!r}: sparse attention needs the query bottleneck "
                "(the indexer's queries are made from it)"
            )
        # HF's DSA attention always interleaves the MLA rotary features (its config drops rope_interleave)
        fields["rope_interleave"] = True
        n_layers = config.num_hidden_layers
        for name in ("index_topk", "index_head_dim", "index_n_heads"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"config.{name}={getattr(config, name)!r}; it must be a positive integer")
        if config.index_head_dim < config.qk_rope_head_dim:
            raise ValueError(
                f"config.index_head_dim={config.index_head_dim} is below config.qk_rope_head_dim="
                f"{config.qk_rope_head_dim} (the indexer's rotary features)"
            )
        mlp_layer_types = list(config.mlp_layer_types)
        if len(mlp_layer_types) != n_layers or set(mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(
                f"config.mlp_layer_types={mlp_layer_types!r}: "
                f"expected 'dense' or 'sparse' for each of {n_layers} layers"
            )
        layer_types = list(getattr(config, "layer_types", None) or [INDEXED_ATTENTION] * n_layers)
        if layer_types != [INDEXED_ATTENTION] * n_layers:
            raise ValueError(
                f"config.layer_types={layer_types!r}: every layer of this family is {INDEXED_ATTENTION!r} (sparse MLA)"
            )
        indexer_types = list(getattr(config, "indexer_types", None) or [FULL_INDEXER] * n_layers)
        if len(indexer_types) != n_layers or set(indexer_types) - {FULL_INDEXER, SHARED_INDEXER}:
            raise ValueError(
                f"config.indexer_types={indexer_types!r}: expected {FULL_INDEXER!r} or {SHARED_INDEXER!r} "
                f"for each of {n_layers} layers"
            )
        if indexer_types[0] != FULL_INDEXER:
            raise ValueError(
                f"config.indexer_types[0]={indexer_types[0]!r}: a shared layer reuses an earlier full layer's selection"
            )
        fields.update(
            index_topk=config.index_topk,
            index_head_dim=config.index_head_dim,
            index_n_heads=config.index_n_heads,
            indexer_rope_interleave=config.model_type == "glm_moe_dsa",
            indexer_types=indexer_types,
            mlp_layer_types=mlp_layer_types,
        )
        return cls(**fields)
