from archon.checkpoint.state_dict_converter import StateDictConverter


class LlamaStateDictConverter(StateDictConverter):
    """HF Llama keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied)."""
