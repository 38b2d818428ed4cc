from archon.models.common.state_dict import MultiTokenPredictionCheckpointAdapter


class DeepseekV32StateDictConverter(MultiTokenPredictionCheckpointAdapter):
    """HF DeepSeek-V3.2 / GLM-5 keys: DeepSeek-V3's (`model.` prefix, MLA projections and latent
    norms under `self_attn`, per-expert MoE weights, router and correction bias, shared experts; MTP
    layers skipped) plus each full layer's indexer, `self_attn.indexer.{wq_b, wk, k_norm, weights_proj}`,
    all a rename."""
