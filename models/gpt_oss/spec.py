from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.gpt_oss.args import GptOssArgs
from archon.models.gpt_oss.model import GptOssModel
from archon.models.gpt_oss.parallelize import parallelize_gpt_oss
from archon.models.gpt_oss.state_dict_converter import GptOssStateDictConverter

from archon.spec import ModelSpec, register

# Layers alternate sliding (even) and full (odd) attention; the window is shorter than the longest
# sequence the alignment tool packs (33), so both kinds of layer differ from each other there.
TINY_SLIDING_WINDOW = 8

spec = register(
    ModelSpec(
        name="gpt_oss",
        hf_model_types=("gpt_oss",),
        args_cls=GptOssArgs,
        model_cls=GptOssModel,
        state_dict_converter_cls=GptOssStateDictConverter,
        parallelize_fn=parallelize_gpt_oss,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
        tiny_hf_config={
            "gpt_oss": dict(
                TINY_DECODER_CONFIG,
                intermediate_size=32,  # per expert
                head_dim=16,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=TINY_SLIDING_WINDOW,
                max_position_embeddings=131072,  # = factor * original_max_position_embeddings
                # GPT-OSS's own YaRN settings (no truncation of the correction range).
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=150000.0,
                    factor=32.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=4096,
                ),
            ),
        },
    )
)
