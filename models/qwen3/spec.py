from archon.spec import ModelSpec, register
from models.qwen3.args import Qwen3Args
from models.qwen3.model import Qwen3Model
from models.qwen3.parallelize import parallelize_qwen3
from models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

_TINY_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)

spec = register(
    ModelSpec(
        name="qwen3",
        hf_model_types=("qwen3", "qwen3_moe"),
        args_cls=Qwen3Args,
        model_cls=Qwen3Model,
        state_dict_adapter_cls=Qwen3StateDictAdapter,
        parallelize_fn=parallelize_qwen3,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts"),
        tiny_hf_config={
            "qwen3": dict(_TINY_COMMON),
            "qwen3_moe": dict(
                _TINY_COMMON,
                moe_intermediate_size=32,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=True,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            ),
        },
    )
)
