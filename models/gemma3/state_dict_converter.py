from archon.checkpoint.state_dict_converter import StateDictConverter


class Gemma3StateDictConverter(StateDictConverter):
    """HF Gemma 3 text keys: the `model.` prefix and the tied `lm_head`, a rename."""
