from archon.models.common.state_dict import StackedExpertsAdapter


class Qwen3StateDictConverter(StackedExpertsAdapter):
    """HF Qwen3 / Qwen3-MoE keys: `model.` prefix, tied `lm_head`, per-expert MoE weights."""
