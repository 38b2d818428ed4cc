from archon.checkpoint.state_dict_converter import StateDictConverter


class Glm4StateDictConverter(StateDictConverter):
    """HF GLM-4 keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied);
    the fused gate_up_proj is kept fused, as HF stores it."""
