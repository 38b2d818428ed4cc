from archon.checkpoint.state_dict_adapter import StateDictAdapter


class Qwen2StateDictAdapter(StateDictAdapter):
    """HF Qwen2 keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied)."""
