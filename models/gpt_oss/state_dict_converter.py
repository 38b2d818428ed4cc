from archon.models.common.state_dict import StackedExpertLoRAAdapter


class GptOssStateDictConverter(StackedExpertLoRAAdapter):
    """HF GPT-OSS keys: `model.` prefix, experts already stacked as archon holds them.

    HF saves `mlp.experts.gate_up_proj` [E, dim, 2*hidden] (gate/up interleaved), its `_bias`,
    `mlp.experts.down_proj` [E, hidden, dim] and its `_bias` under their in-memory names, so every
    base weight is a rename. Expert LoRA goes to PEFT `target_parameters`: GPT-OSS experts are
    `is_transposed`, so PEFT reads [E, in, out] and its lora_A is [E*r, in], as for the other layout.
    The router is no nn.Linear, so no target_modules name clashes with expert LoRA.
    """
