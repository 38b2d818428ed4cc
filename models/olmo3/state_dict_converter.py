from archon.checkpoint.state_dict_converter import StateDictConverter


class Olmo3StateDictConverter(StateDictConverter):
    """HF OLMo 3 keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied)."""
