from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.qwen3_next.args import Qwen3NextArgs
from archon.models.qwen3_next.model import Qwen3NextModel
from archon.models.qwen3_next.parallelize import parallelize_qwen3_next
from archon.models.qwen3_next.state_dict_converter import Qwen3NextStateDictConverter
from archon.spec import ModelSpec, register

# Every feature on: both layer types (a linear-attention layer after a full-attention one too), two
# value heads per key head with value and key head sizes apart, RoPE on a quarter of each head
# (Qwen3-Next's own factor), the attention output gate (always on), sparse layers (8 experts, top-2,
# the gated shared expert) and a dense one (`mlp_only_layers`).
# Numerics: the DeltaNet output's gated RMSNorm divides by the norm of o = S^T q, which is small for
# some tokens and heads of a random model (a small beta, a strong decay), and so magnifies fp32
# rounding; the LoRA gradients of later layers then came within 3x of the gate's 1e-4 (beyond it for
# some seeds at rms_norm_eps=1e-6 and value heads of 8). Value heads of 16 and rms_norm_eps=1e-5 keep
# seeds 0-7 under 5e-5, with the same three layers.
_TINY_CONFIG = dict(
    TINY_DECODER_CONFIG,
    num_hidden_layers=3,
    intermediate_size=96,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    rms_norm_eps=1e-5,
    linear_conv_kernel_dim=4,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    mlp_only_layers=[1],
)

# The fused DeltaNet projections, the shared expert's gate and the stacked experts, beside attention
# and the MLPs (dense layers and the shared expert).
LORA_TARGETS = (
    *DENSE_LORA_TARGETS,
    "in_proj_qkvz",
    "in_proj_ba",
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
        # Merged, as every MoE family: vLLM's MoE LoRA takes no stacked expert adapters.
        vllm_modes={"qwen3_next": "merged"},
        tiny_hf_config={"qwen3_next": dict(_TINY_CONFIG)},
        # The Instruct and Thinking checkpoints share the model_type; Thinking's renderer
        # (qwen3_next_thinking) is chosen by name.
        renderers={"qwen3_next": "qwen3_next_instruct"},
        inert_hf_config_fields={
            "partial_rotary_factor": (
                "the config class copies it into rope_parameters, where HF's modeling code and archon read it"
            ),
        },
    )
)
