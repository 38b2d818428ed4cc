"""Tiny random-weight HF checkpoints of a family's model type (sizes from its
ModelSpec.tiny_hf_config), saved as real checkpoints: what the alignment tool (archon.tools.align)
checks without --hf-path, and what tests build models from.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import torch

from archon.spec import get_spec


def hf_model_class(config):
    """The HF auto class a checkpoint of `config` is made and checked with: the whole model for a
    vision-language composite (`vision_config`), so its vision tower is saved and PEFT sees the module
    paths of released checkpoints; else the causal LM."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if getattr(config, "vision_config", None) is not None:
        return AutoModelForImageTextToText
    return AutoModelForCausalLM


def tiny_config_kwargs(model_type: str, **overrides) -> dict[str, Any]:
    """The family's tiny config kwargs for `model_type` with `overrides` applied. For a vision-language
    composite (a tiny config with `text_config`), overrides other than `text_config`/`vision_config`
    are language-model fields and go into `text_config`; `tie_word_embeddings`, which the composite
    has too (and HF's whole model reads there), is set on both."""
    kwargs = dict(get_spec(model_type).tiny_hf_config.get(model_type, {}))
    if "text_config" not in kwargs:
        return {**kwargs, **overrides}
    sub_configs = {k: overrides.pop(k) for k in ("text_config", "vision_config") if k in overrides}
    kwargs.update(sub_configs)
    if "tie_word_embeddings" in overrides:
        kwargs["tie_word_embeddings"] = overrides["tie_word_embeddings"]
    kwargs["text_config"] = {**kwargs["text_config"], **overrides}
    return kwargs


_SPECIAL_TOKEN_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id")


def _drop_special_tokens_outside_vocab(config) -> None:
    """Config classes default some special-token ids to those of the released vocabulary (SmolLM3's
    pad_token_id 128004), which a tiny vocabulary does not hold; such ids are set to None."""
    text = config.get_text_config()
    for name in _SPECIAL_TOKEN_FIELDS:
        value = getattr(text, name, None)
        ids = value if isinstance(value, list) else [value]
        kept = [i for i in ids if i is None or 0 <= i < text.vocab_size]
        if len(kept) == len(ids):
            continue
        warnings.warn(
            f"tiny {config.model_type} config: {name}={value!r} lies outside its vocabulary of {text.vocab_size}; "
            f"set to {kept or None!r}",
            stacklevel=4,
        )
        setattr(text, name, (kept or None) if isinstance(value, list) else None)


def single_kind_patterns(config, one_kind_by_definition: tuple[str, ...] = ()) -> list[str]:
    """The per-layer patterns of `config` whose every layer is of one kind. A tiny config like that
    lets a port pass that treats the kinds alike (RoPE on NoPE layers, a window on every layer).
    Patterns are `no_rope_layers` and every list field named `*_types` or `layers_block_type` (Nemotron-H,
    Falcon-H1) with an entry per layer (`layer_types`, `mlp_layer_types`, `indexer_types`), but those
    the family declares to have one kind by definition (`ModelSpec.one_kind_layer_patterns`)."""
    text = config.get_text_config()
    n_layers = text.num_hidden_layers
    found = []
    per_layer = [
        name
        for name, value in sorted(text.to_dict().items())
        if name.endswith(("_types", "layers_block_type")) and isinstance(value, list) and len(value) == n_layers
    ]
    for name in ("no_rope_layers", *per_layer):
        pattern = getattr(text, name, None)
        if pattern and len(set(map(str, pattern))) == 1 and name not in one_kind_by_definition:
            found.append(f"{name} (every layer {pattern[0]!r})")
    routed = any(getattr(text, name, None) for name in ("num_experts", "n_routed_experts", "num_local_experts"))
    if routed and (hasattr(text, "decoder_sparse_step") or hasattr(text, "mlp_only_layers")):
        step, dense = getattr(text, "decoder_sparse_step", None) or 1, set(getattr(text, "mlp_only_layers", None) or [])
        kinds = {i not in dense and (i + 1) % step == 0 for i in range(n_layers)}
        if len(kinds) == 1:
            found.append(
                f"decoder_sparse_step / mlp_only_layers (every layer {'sparse' if kinds == {True} else 'dense'})"
            )
    first_dense = getattr(text, "first_k_dense_replace", None) if routed else None
    if first_dense is not None and not 0 < first_dense < n_layers:
        found.append(f"first_k_dense_replace={first_dense} of {n_layers} layers")
    return found


def tiny_hf_config(model_type: str, **overrides):
    """The HF config of the family's tiny model of `model_type` with `overrides`, special-token ids
    outside its vocabulary set to None (an embedding's padding_idx must lie inside it)."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, **tiny_config_kwargs(model_type, **overrides))
    _drop_special_tokens_outside_vocab(config)
    return config


def make_tiny_hf_checkpoint(model_type: str, out_dir: str | Path, seed: int = 0, **overrides) -> Path:
    """Build a small random-weight HF model of `model_type` and save it as a real checkpoint."""
    config = tiny_hf_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = hf_model_class(config).from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.ndim >= 2:  # O(1) activations, so routing and attention are far from ties
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[-1]))
            else:  # norms and biases off their init values, so they are exercised
                param.add_(0.1 * torch.randn_like(param))
        persistent = model.state_dict().keys()
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():  # e.g. a router's score-correction bias
                buffer.add_(0.1 * torch.randn_like(buffer))
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    return out_dir
