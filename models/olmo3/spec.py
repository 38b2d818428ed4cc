from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.olmo3.args import Olmo3Args
from archon.models.olmo3.model import Olmo3Model
from archon.models.olmo3.parallelize import parallelize_olmo3
from archon.models.olmo3.state_dict_converter import Olmo3StateDictConverter
from archon.spec import ModelSpec, register

# The released configs scale only the full-attention layers with YaRN. Here YaRN over an original
# context of 64 reaches the tiny model's wavelengths (head_dim 24: 6 to 3e4 tokens), and the two
# layer types have different thetas, so a layer given the other type's tables is caught.
TINY_OLMO3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    "full_attention": {
        "rope_type": "yarn",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
}

spec = register(
    ModelSpec(
        name="olmo3",
        hf_model_types=("olmo3", "olmo2"),
        args_cls=Olmo3Args,
        model_cls=Olmo3Model,
        state_dict_converter_cls=Olmo3StateDictConverter,
        parallelize_fn=parallelize_olmo3,
        lora_targets=DENSE_LORA_TARGETS,
        tiny_hf_config={
            # A sliding layer over 8 tokens (fewer than the longest aligned sequence has), then a full one;
            # head_dim 24 != hidden_size / heads; max_position_embeddings = YaRN factor x original context.
            "olmo3": dict(
                TINY_DECODER_CONFIG,
                head_dim=24,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
                rope_parameters=TINY_OLMO3_ROPE,
                max_position_embeddings=512,
            ),
            # OLMo 2: every layer full attention, one set of rope parameters.
            "olmo2": dict(
                TINY_DECODER_CONFIG,
                head_dim=24,
                rope_parameters=TINY_OLMO3_ROPE["full_attention"],
                max_position_embeddings=512,
            ),
        },
        # HF config fields the math does not depend on: none beyond the generic ones (token ids, use_cache,
        # initializer_range); from_hf_config reads every other field of Olmo3Config and Olmo2Config.
        vllm_modes={"olmo3": "adapter", "olmo2": "adapter"},
        renderers={"olmo3": "olmo3_instruct", "olmo2": "olmo2"},
    )
)
