from archon.models.common.decoder import DENSE_LORA_TARGETS, TINY_DECODER_CONFIG
from archon.models.qwen2.args import Qwen2Args
from archon.models.qwen2.model import Qwen2Model
from archon.models.qwen2.parallelize import parallelize_qwen2
from archon.models.qwen2.state_dict_converter import Qwen2StateDictConverter
from archon.spec import ModelSpec, register

spec = register(
    ModelSpec(
        name="qwen2",
        hf_model_types=("qwen2",),
        args_cls=Qwen2Args,
        model_cls=Qwen2Model,
        state_dict_converter_cls=Qwen2StateDictConverter,
        parallelize_fn=parallelize_qwen2,
        lora_targets=DENSE_LORA_TARGETS,
        tiny_hf_config={
            # The second layer slides over 8 tokens, fewer than the longest aligned sequence has.
            "qwen2": dict(TINY_DECODER_CONFIG, use_sliding_window=True, sliding_window=8, max_window_layers=1),
        },
        vllm_modes={"qwen2": "adapter"},
        renderers={"qwen2": "qwen2"},
    )
)
