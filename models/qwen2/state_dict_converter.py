from archon.checkpoint.state_dict_converter import StateDictConverter


class Qwen2StateDictConverter(StateDictConverter):
    """HF Qwen2 keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied)."""
