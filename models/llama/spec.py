from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.llama.args import LlamaArgs
from archon.models.llama.model import LlamaModel
from archon.models.llama.parallelize import parallelize_llama
from archon.models.llama.state_dict_converter import LlamaStateDictConverter
from archon.spec import ModelSpec, register

# Scaling reaches the tiny model's wavelengths: with head_dim 24 and theta 1e4 they run from 6 to
# 3e4 tokens; llama3 smooths those of 16..64 tokens and divides longer ones by factor.
TINY_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

spec = register(
    ModelSpec(
        name="llama",
        hf_model_types=("llama",),
        args_cls=LlamaArgs,
        model_cls=LlamaModel,
        state_dict_converter_cls=LlamaStateDictConverter,
        parallelize_fn=parallelize_llama,
        lora_targets=DENSE_LORA_TARGETS,
        tiny_hf_config={
            # head_dim 24 != hidden_size / heads = 16.
            "llama": dict(TINY_DECODER_CONFIG, head_dim=24, rope_parameters=TINY_LLAMA3_ROPE),
        },
        vllm_modes={"llama": "adapter"},
        renderers={"llama": "llama3"},
        inert_hf_config_fields={
            "pretraining_tp": "a pretraining sharding detail that HF's modeling code ignores",
        },
    )
)
