from archon.checkpoint.state_dict_adapter import StateDictAdapter


class LlamaStateDictAdapter(StateDictAdapter):
    """HF Llama keys are archon's with a `model.` prefix (`lm_head.weight` as is, absent when tied)."""
