from archon.models.common.state_dict import MultiTokenPredictionCheckpointAdapter


class Glm4MoeStateDictConverter(MultiTokenPredictionCheckpointAdapter):
    """HF GLM-4.5 keys: `model.` prefix, per-expert MoE weights, router `mlp.gate.weight` and
    `mlp.gate.e_score_correction_bias`, shared experts `mlp.shared_experts.*`; MTP layers skipped."""
