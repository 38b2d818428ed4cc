from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.falcon_h1.args import FalconH1Args
from archon.models.falcon_h1.model import FalconH1Model
from archon.models.falcon_h1.parallelize import parallelize_falcon_h1
from archon.models.falcon_h1.state_dict_converter import FalconH1StateDictConverter
from archon.spec import ModelSpec, register

# Two layers. Mamba2: 4 heads of 16 (mamba_d_ssm 64) in 2 groups (B and C shared by 2 heads each), a
# state of 8, a conv of 4 taps with bias, the gated norm on, before the gate (HF's default), a step-size
# limit that binds on both sides. Attention: 4 query heads of 16 over 2 key/value heads, RoPE. Every muP
# multiplier off 1, each to its own value, so that a port that drops or swaps one fails.
_TINY = dict(
    TINY_DECODER_CONFIG,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    mamba_d_ssm=64,
    mamba_n_heads=4,
    mamba_d_head=16,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_d_conv=4,
    mamba_rms_norm=True,
    time_step_limit=(0.3, 1.5),
    embedding_multiplier=1.3,
    lm_head_multiplier=0.7,
    key_multiplier=1.2,
    attention_in_multiplier=0.9,
    attention_out_multiplier=1.1,
    ssm_in_multiplier=0.8,
    ssm_out_multiplier=1.25,
    ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.3],
    mlp_multipliers=[1.2, 0.9],
)

# Attention's q/k/v/o, the Mamba2 in_proj and the MLP's gate/up/down. PEFT (0.21.2) refuses LoRA on the
# Mamba2 mixer's out_proj and conv1d, so an adapter on them could not be exported; full fine-tuning
# trains them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "gate_proj", "up_proj", "down_proj")

spec = register(
    ModelSpec(
        name="falcon_h1",
        hf_model_types=("falcon_h1",),
        args_cls=FalconH1Args,
        model_cls=FalconH1Model,
        state_dict_converter_cls=FalconH1StateDictConverter,
        parallelize_fn=parallelize_falcon_h1,
        lora_targets=LORA_TARGETS,
        tiny_hf_config={"falcon_h1": _TINY},
        renderers={"falcon_h1": "falcon_h1"},
        inert_hf_config_fields={
            "mamba_chunk_size": "the tiling of HF's chunked scan, which does not change the math",
            "num_logits_to_keep": "a generation setting of HF's generate",
        },
    )
)
