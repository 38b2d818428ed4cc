from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Literal


@dataclass
class LoRAConfig:
    """LoRA settings, numerically the same as PEFT's LoraConfig.

    target_modules: HF module names (e.g. ("q_proj", "v_proj")) or "all-linear". As in PEFT, an entry
        targets every module whose HF path is the entry or ends in "." + the entry, so a full path
        ("model.layers.0.self_attn.q_proj") targets that one module. "experts" names the stacked MoE
        expert weights.
    experts: with "all-linear", also adapt MoE experts.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | Literal["all-linear"] = "all-linear"
    use_rslora: bool = False
    experts: bool = True
    rank_pattern: dict[str, int] = field(default_factory=dict)
    """Per-module rank, as PEFT's: a key is a regular expression that matches a module whose HF path
    ends in it (after a "."), e.g. "q_proj" or "layers\\.1\\.mlp\\.down_proj"; the first matching key wins."""
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    """Per-module alpha, matched like rank_pattern."""

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, list):
            self.target_modules = tuple(self.target_modules)
        if self.rank <= 0:
            raise ValueError(f"LoRAConfig.rank must be positive, got {self.rank}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRAConfig.dropout must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules != "all-linear":
            raise ValueError(
                f"LoRAConfig.target_modules must be 'all-linear' or a list of module names, got {self.target_modules!r}"
            )
        for name, patterns in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for key, value in patterns.items():
                try:
                    re.compile(key)
                except re.error as e:
                    raise ValueError(f"LoRAConfig.{name} key {key!r} is not a regular expression: {e}") from None
                if name == "rank_pattern" and (not isinstance(value, int) or value <= 0):
                    raise ValueError(f"LoRAConfig.rank_pattern[{key!r}] must be a positive integer, got {value!r}")

    @property
    def scaling(self) -> float:
        return self.scaling_for(self.rank, self.alpha)

    def scaling_for(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    @property
    def max_rank(self) -> int:
        """The largest rank of any module (what a LoRA server must be sized for)."""
        return max([self.rank, *self.rank_pattern.values()])

    def targets(self, name: str) -> bool:
        """Whether modules with HF leaf name `name` may get LoRA; `module_settings` decides per module."""
        if self.target_modules == "all-linear":
            return name != "experts" or self.experts
        return any(t.rsplit(".", 1)[-1] == name for t in self.target_modules)

    def module_settings(self, hf_path: str) -> tuple[int, float] | None:
        """(rank, scaling) of the module at HF path `hf_path` (e.g. "model.layers.0.self_attn.q_proj"),
        or None when it gets no LoRA. Matching follows PEFT's rules for target lists and patterns."""
        leaf = hf_path.rsplit(".", 1)[-1]
        if self.target_modules == "all-linear":
            if not self.targets(leaf):
                return None
        elif not any(hf_path == t or hf_path.endswith("." + t) for t in self.target_modules):
            return None
        rank = self.rank_pattern.get(_first_pattern_match(self.rank_pattern, hf_path), self.rank)
        alpha = self.alpha_pattern.get(_first_pattern_match(self.alpha_pattern, hf_path), self.alpha)
        return rank, self.scaling_for(rank, alpha)

    def pattern_keys_matching(self, hf_path: str) -> list[str]:
        """The rank/alpha pattern keys that apply to the module at `hf_path`."""
        keys = (_first_pattern_match(self.rank_pattern, hf_path), _first_pattern_match(self.alpha_pattern, hf_path))
        return [key for key in keys if key is not None]

    def validate(self, available: tuple[str, ...], family: str) -> None:
        """Fail on a target the model family does not have."""
        if self.target_modules == "all-linear":
            return
        unknown = [t for t in self.target_modules if t.rsplit(".", 1)[-1] not in available]
        if unknown:
            raise ValueError(
                f"LoRA target(s) {unknown} do not exist in model family {family!r}; "
                f"targetable modules: {', '.join(available)} (or 'all-linear')"
            )


def _first_pattern_match(patterns: dict, hf_path: str) -> str | None:
    """The first key of `patterns` that matches the end of `hf_path` at a "." boundary (PEFT's rule)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", hf_path):
            return key
    return None
