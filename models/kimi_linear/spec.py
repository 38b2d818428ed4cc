from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.kimi_linear.args import KimiLinearArgs
from archon.models.kimi_linear.model import KimiLinearModel
from archon.models.kimi_linear.parallelize import parallelize_kimi_linear
from archon.models.kimi_linear.state_dict_converter import KimiLinearStateDictConverter
from archon.spec import ModelSpec, register

# Every feature on: KDA layers before and after an MLA layer, a dense MLP then MoE layers (4 groups of
# 2 experts, 2 groups allowed per token, top-2, routed_scaling_factor 2.5, one shared expert), MLA
# with value heads narrower than query/key heads. The KDA conv of 4 taps, per-channel decay and
# sigmoid output gate are always on.
_TINY = dict(
    {k: v for k, v in TINY_DECODER_CONFIG.items() if k != "num_key_value_heads"},
    num_hidden_layers=3,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
    num_key_value_heads=4,  # MLA: every head has its own keys and values
    q_lora_rank=None,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=4,
    num_local_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    pad_token_id=None,  # the released ids lie outside the tiny vocabulary
    bos_token_id=None,
    eos_token_id=None,
)

# The KDA projections (q/k/v/o as attention's), the MLA projections, MLPs, shared experts and experts.
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "f_a_proj",
    "f_b_proj",
    "b_proj",
    "g_a_proj",
    "g_b_proj",
    "q_a_proj",
    "q_b_proj",
    "kv_a_proj_with_mqa",
    "kv_b_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "experts",
)

spec = register(
    ModelSpec(
        name="kimi_linear",
        hf_model_types=("kimi_linear",),
        args_cls=KimiLinearArgs,
        model_cls=KimiLinearModel,
        state_dict_converter_cls=KimiLinearStateDictConverter,
        parallelize_fn=parallelize_kimi_linear,
        lora_targets=LORA_TARGETS,
        tiny_hf_config={"kimi_linear": _TINY},
        # An MoE family: vLLM's MoE LoRA takes no stacked expert adapters, so the merged weights are served.
        vllm_modes={"kimi_linear": "merged"},
        inert_hf_config_fields={
            "qk_head_dim": "derived by the config from qk_nope_head_dim + qk_rope_head_dim, which are read",
            "pretraining_tp": "a pretraining sharding detail that HF's modeling code ignores",
            "linear_attn_config": "a released config's KDA settings, resolved by the config into layer_types, "
            "linear_num_heads, linear_head_dim and linear_conv_kernel_dim, which are read",
            "rope_theta": "HF's Kimi Linear applies no RoPE (its MLA layers are NoPE)",
            "rope_parameters": "HF's Kimi Linear applies no RoPE (its MLA layers are NoPE)",
        },
    )
)
