from archon.spec import ModelSpec, register
from models.qwen2.args import Qwen2Args
from models.qwen2.model import Qwen2Model
from models.qwen2.state_dict_adapter import Qwen2StateDictAdapter

spec = register(
    ModelSpec(
        name="qwen2",
        hf_model_types=("qwen2",),
        args_cls=Qwen2Args,
        model_cls=Qwen2Model,
        state_dict_adapter_cls=Qwen2StateDictAdapter,
        parallelize_fn=None,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        tiny_hf_config={
            # The second layer slides over 8 tokens, shorter than the longest aligned sequence.
            "qwen2": dict(
                vocab_size=256,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=512,
                tie_word_embeddings=False,
                use_sliding_window=True,
                sliding_window=8,
                max_window_layers=1,
            ),
        },
    )
)
