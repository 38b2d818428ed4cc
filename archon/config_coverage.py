"""Which fields of an HF config a family reads, and which it neither reads nor declares inert.

A field that changes the math must be read by the family's `from_hf_config` (and implemented or
refused by name there); a field the math does not depend on is listed, with the reason, in the
family's `ModelSpec.inert_hf_config_fields` or, when no family depends on it, in
`GENERIC_INERT_FIELDS` below. `unaccounted_fields` lists the rest: the alignment gate fails on
them and tests/test_alignment.py checks every registered type.

Reads are recorded by handing `from_hf_config` a proxy of the config that notes every attribute
looked up (`config.x`, `getattr(config, "x", default)`, `hasattr`), in sub-configs as well
(`get_text_config()`).
"""

from __future__ import annotations

from typing import Any

# Fields of every transformers config that no family's forward depends on, with the reason.
GENERIC_INERT_FIELDS: dict[str, str] = {
    "_name_or_path": "where the config was loaded from",
    "architectures": "the HF class names; archon picks the family by model_type",
    "model_type": "selects the family",
    "transformers_version": "bookkeeping",
    "dtype": "the stored dtype; archon builds in the dtype it is asked for",
    "torch_dtype": "the stored dtype (older name); archon builds in the dtype it is asked for",
    "use_cache": "HF generation's cache switch; archon's engine keeps its own cache",
    "cache_implementation": (
        "the cache class HF's generate uses (Gemma 2/3 configs say 'hybrid'); archon's engine keeps its own"
    ),
    "bos_token_id": "a token id (the data and the engine read it from the tokenizer and generation config)",
    "eos_token_id": "a token id (the data and the engine read it from the tokenizer and generation config)",
    "pad_token_id": "a token id; archon packs sequences and never pads",
    "sep_token_id": "a token id",
    "decoder_start_token_id": "encoder-decoder models only",
    "initializer_range": "random initialisation; archon loads the checkpoint's weights",
    "output_attentions": "HF output switch",
    "output_hidden_states": "HF output switch",
    "return_dict": "HF output switch",
    "chunk_size_feed_forward": "HF's feed-forward chunking, which does not change results",
    "is_encoder_decoder": "False for every causal LM archon serves",
    "id2label": "classification heads",
    "label2id": "classification heads",
    "problem_type": "classification heads",
    "tokenizer_class": "the tokenizer",
    "task_specific_params": "pipelines",
    "quantization_config": "read by archon.quant when the checkpoint is loaded",
    "output_router_logits": "HF output switch for the router's logits",
    "router_aux_loss_coef": "HF's auxiliary load-balancing loss weight; archon's is TrainerConfig's",
}


class _RecordingConfig:
    """Delegates attribute reads to `config` and records each name in `read`."""

    def __init__(self, config: Any, read: set[str]) -> None:
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_read", read)

    def __getattr__(self, name: str) -> Any:
        self._read.add(name)
        # an alias (Qwen3-MoE's num_experts) reads the field its config class maps it to
        self._read.add(getattr(type(self._config), "attribute_map", {}).get(name, name))
        value = getattr(self._config, name)
        if name == "get_text_config":
            return lambda *args, **kwargs: _RecordingConfig(value(*args, **kwargs), self._read)
        return value

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError(f"from_hf_config must not change the HF config (it set {name!r})")


def fields_read(args_cls: type, hf_config: Any) -> set[str]:
    """The attribute names `args_cls.from_hf_config(hf_config)` looks up, in the config and in its
    text config. Raises what `from_hf_config` raises for a config it refuses."""
    read: set[str] = set()
    args_cls.from_hf_config(_RecordingConfig(hf_config, read))
    return read


def config_fields(hf_config: Any) -> set[str]:
    """The fields of the language-model part of `hf_config` (the text config of a composite)."""
    return set(hf_config.get_text_config().to_dict())


def unaccounted_fields(spec, hf_config: Any) -> list[str]:
    """Fields of `hf_config` that `spec`'s family neither reads nor declares inert (sorted)."""
    accounted = fields_read(spec.args_cls, hf_config) | set(GENERIC_INERT_FIELDS) | set(spec.inert_hf_config_fields)
    return sorted(config_fields(hf_config) - accounted)
