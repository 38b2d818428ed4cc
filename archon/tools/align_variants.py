"""The tiny configs gate v2 checks a type with: the family's registered tiny config, and one more per
boolean or enumerated config field the family reads (archon.config_coverage records which), with that
field flipped, and one with another partial-rotary factor when the family has one. A feature the
registered config leaves off (a tied head, a bias, `norm_topk_prob`) is then exercised both ways,
and a port that ignores the field fails in one of the two.

A flipped value the family refuses by name (`from_hf_config` raises ValueError) is not a config the
family serves; it is listed as refused, with the reason, rather than checked. So is one that the HF
config class itself refuses.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from archon.config_coverage import GENERIC_INERT_FIELDS, fields_read
from archon.spec import get_spec
from archon.tools.tiny_checkpoint import tiny_hf_config

# Enumerated config fields and the values of each that some family implements: a variant is made for
# every value but the tiny config's.
ENUMERATED_FIELDS: dict[str, tuple[str, ...]] = {
    "scoring_func": ("softmax", "sigmoid"),
    "topk_method": ("greedy", "noaux_tc"),
    "hidden_act": ("silu", "gelu_pytorch_tanh"),
    "hidden_activation": ("silu", "gelu_pytorch_tanh"),
}


def _flipped_values(name: str, value: Any) -> list[Any]:
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, str) and value in ENUMERATED_FIELDS.get(name, ()):
        return [v for v in ENUMERATED_FIELDS[name] if v != value]
    return []


def config_variants(model_type: str, overrides: dict[str, Any]) -> tuple[dict[str, dict], dict[str, str]]:
    """({variant name: config overrides}, {variant name: why it is not checked}). The first variant is
    "tiny" (the registered tiny config with `overrides`); the others are named FIELD=VALUE."""
    spec = get_spec(model_type)
    config = tiny_hf_config(model_type, **overrides)
    text = config.get_text_config()
    skipped = set(GENERIC_INERT_FIELDS) | set(spec.inert_hf_config_fields)
    candidates = {
        f"{name}={value}": {**overrides, name: value}
        for name in sorted(fields_read(spec.args_cls, config) - skipped)
        for value in _flipped_values(name, getattr(text, name, None))
    }
    rope = getattr(text, "rope_parameters", None)
    if "partial_rotary_factor" in {f.name for f in dataclasses.fields(spec.args_cls)} and rope and "rope_theta" in rope:
        # a float, not a flag, but a port that hard-codes the tiny config's value passes without it
        factor = 1.0 if rope.get("partial_rotary_factor", 1.0) != 1.0 else 0.5
        candidates[f"partial_rotary_factor={factor}"] = {
            **overrides,
            "rope_parameters": {**rope, "partial_rotary_factor": factor},
        }
    variants, refused = {"tiny": dict(overrides)}, {}
    for key, candidate in candidates.items():
        try:
            spec.args_cls.from_hf_config(tiny_hf_config(model_type, **candidate))
        except (ValueError, TypeError) as e:
            refused[key] = f"{type(e).__name__}: {e}"
            continue
        variants[key] = candidate
    return variants, refused
