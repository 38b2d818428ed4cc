from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal


@dataclass
class LoRAConfig:
    """LoRA settings, numerically the same as PEFT's LoraConfig.

    target_modules: HF leaf module names (e.g. ("q_proj", "v_proj")) or "all-linear".
        "experts" names the stacked MoE expert weights.
    experts: with "all-linear", also adapt MoE experts.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | Literal["all-linear"] = "all-linear"
    use_rslora: bool = False
    experts: bool = True

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

    @property
    def scaling(self) -> float:
        return self.alpha / math.sqrt(self.rank) if self.use_rslora else self.alpha / self.rank

    def targets(self, name: str) -> bool:
        """Whether the module with HF leaf name `name` gets LoRA."""
        if self.target_modules == "all-linear":
            return name != "experts" or self.experts
        return name in self.target_modules

    def validate(self, available: tuple[str, ...], family: str) -> None:
        """Fail on a target the model family does not have."""
        if self.target_modules == "all-linear":
            return
        unknown = [t for t in self.target_modules if t not in available]
        if unknown:
            raise ValueError(
                f"LoRA target(s) {unknown} do not exist in model family {family!r}; "
                f"targetable modules: {', '.join(available)} (or 'all-linear')"
            )
