from archon.models.common.state_dict import MultiTokenPredictionCheckpointAdapter


class DeepseekV3StateDictConverter(MultiTokenPredictionCheckpointAdapter):
    """HF DeepSeek-V3 keys: `model.` prefix, MLA projections and latent norms under `self_attn`,
    per-expert MoE weights, router `mlp.gate.weight` and `mlp.gate.e_score_correction_bias`, shared
    experts `mlp.shared_experts.*`; MTP layers read when the model builds them (see
    MultiTokenPredictionCheckpointAdapter), else skipped."""
