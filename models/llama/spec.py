from archon.spec import ModelSpec, register
from models.llama.args import LlamaArgs
from models.llama.model import LlamaModel
from models.llama.state_dict_adapter import LlamaStateDictAdapter

spec = register(
    ModelSpec(
        name="llama",
        hf_model_types=("llama",),
        args_cls=LlamaArgs,
        model_cls=LlamaModel,
        state_dict_adapter_cls=LlamaStateDictAdapter,
        parallelize_fn=None,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        tiny_hf_config={
            # head_dim 24 != hidden/heads, llama3 RoPE whose scaling reaches the wavelengths used.
            "llama": dict(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=24,
                max_position_embeddings=512,
                tie_word_embeddings=False,
                rope_parameters={
                    "rope_type": "llama3",
                    "rope_theta": 10000.0,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
            ),
        },
    )
)
