from archon.models.deepseek_v3.spec import spec as DEEPSEEK_V3_SPEC
from archon.models.deepseek_v32.args import DeepseekV32Args
from archon.models.deepseek_v32.model import DeepseekV32Model
from archon.models.deepseek_v32.parallelize import parallelize_deepseek_v32
from archon.models.deepseek_v32.state_dict_converter import DeepseekV32StateDictConverter
from archon.spec import ModelSpec, register

# DeepSeek-V3's tiny config (one dense layer, then MoE layers with 4 groups of 2 experts, 2 groups
# allowed per token; MLA with the query bottleneck; interleaved YaRN RoPE whose mscale_all_dim scales
# the softmax) without rope_interleave, which the DSA configs do not have (their MLA always
# interleaves), plus an indexer of 16 heads of 16 (8 rotary) that keeps 4 keys per query, far fewer
# than the gate's sequences hold.
_TINY_DSA = dict(
    {k: v for k, v in DEEPSEEK_V3_SPEC.tiny_hf_config["deepseek_v3"].items() if k != "rope_interleave"},
    index_topk=4,
    index_head_dim=16,
    index_n_heads=16,
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
        # and its scores reach nothing else (HF computes it under no_grad), so LoRA there would learn
        # nothing. No q_proj: the query bottleneck is required.
        lora_targets=tuple(target for target in DEEPSEEK_V3_SPEC.lora_targets if target != "q_proj"),
        tiny_hf_config={
            "deepseek_v32": _TINY_DSA,
            # GLM-5: the indexer's rotary features interleaved; the middle layer shares the first
            # layer's selection (no indexer of its own), the last runs its own again.
            "glm_moe_dsa": dict(_TINY_DSA, indexer_types=["full", "shared", "full"], rms_norm_eps=1e-5),
        },
        vllm_modes={"deepseek_v32": "merged", "glm_moe_dsa": "merged"},
        renderers={"deepseek_v32": "deepseek_v32", "glm_moe_dsa": "glm5"},
        # HF marks every layer 'indexed_attention' (it picks the cache class); what varies per layer is
        # mlp_layer_types and GLM-5's indexer_types, which the tiny configs mix.
        one_kind_layer_patterns=("layer_types",),
        inert_hf_config_fields={
            "mlp_bias": "HF builds the DSA families' MLPs and experts without bias whatever it says",
            "num_nextn_predict_layers": (
                "the multi-token-prediction layers, which the causal LM does not run; their weights are not loaded"
            ),
            "index_topk_pattern": (
                "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read"
            ),
            "index_topk_freq": (
                "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read"
            ),
            "index_skip_topk_offset": (
                "GLM-5: the config class derives indexer_types from it, which HF's modeling code and archon read"
            ),
        },
    )
)
