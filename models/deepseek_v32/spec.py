from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.deepseek_v32.args import DeepseekV32Args
from archon.models.deepseek_v32.model import DeepseekV32Model
from archon.models.deepseek_v32.parallelize import parallelize_deepseek_v32
from archon.models.deepseek_v32.state_dict_converter import DeepseekV32StateDictConverter

from archon.spec import ModelSpec, register

# One dense layer, then MoE layers with 4 groups of 2 experts (2 groups allowed per token); MLA with
# the query bottleneck; interleaved YaRN RoPE whose mscale_all_dim scales the softmax; an indexer of
# 16 heads of 16 (8 rotary) that keeps 4 keys per query, far fewer than the gate's sequences hold.
_TINY_DSA = dict(
    TINY_DECODER_CONFIG,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_key_value_heads=4,  # MLA: every head has its own keys and values
    q_lora_rank=32,
    kv_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    index_topk=4,
    index_head_dim=16,
    index_n_heads=16,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)

spec = register(
    ModelSpec(
        name="deepseek_v32",
        hf_model_types=("deepseek_v32", "glm_moe_dsa"),
        args_cls=DeepseekV32Args,
        model_cls=DeepseekV32Model,
        state_dict_converter_cls=DeepseekV32StateDictConverter,
        parallelize_fn=parallelize_deepseek_v32,
        # The indexer (wq_b, wk, weights_proj) is frozen: its top-k selection is not differentiable
        # and its scores reach nothing else (HF computes it under no_grad), so LoRA there would learn nothing.
        lora_targets=(
            "q_a_proj",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_b_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
            "experts",
        ),
        tiny_hf_config={
            "deepseek_v32": _TINY_DSA,
            # GLM-5: the indexer's rotary features interleaved; the middle layer shares the first
            # layer's selection (no indexer of its own), the last runs its own again.
            "glm_moe_dsa": dict(_TINY_DSA, indexer_types=["full", "shared", "full"], rms_norm_eps=1e-5),
        },
        vllm_modes={"deepseek_v32": "merged", "glm_moe_dsa": "merged"},
        inert_hf_config_fields={
            "mlp_bias": "HF builds the DSA families' MLPs and experts without bias whatever it says",
            "num_nextn_predict_layers": "the multi-token-prediction layers, which the causal LM does not run; their weights are not loaded",
            "index_topk_pattern": "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read",
            "index_topk_freq": "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read",
            "index_skip_topk_offset": "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read",
        },
    )
)
