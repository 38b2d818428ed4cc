"""The optimizer and learning-rate schedule of a trained adapter: AdamW with warm-up and decay.

Every adapter a Trainer trains (one, or one per task) has its own AdamW, schedule and count of
applied updates, an `AdapterOptimizer`.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Literal

import torch

from archon.parallel.grad import clip_grad_norm


@dataclass
class OptimConfig:
    """AdamW (fp32 states for the fp32 LoRA factors) with warm-up and decay.

    Schedule lengths count training steps: in the RL loop an RL step (all its minibatches and PPO
    epochs take the same learning rate), for `Trainer.train_step` on its own one call.
    """

    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this; None or 0 only measures it."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = 0
    """Linear warm-up from lr/(warmup_steps+1) to lr over the first warmup_steps steps."""
    total_steps: int | None = None
    """Steps over which linear/cosine decay to min_lr_ratio * lr. None: the run's length (the RL
    recipe fills in `steps`); set it only to decay over a different length."""
    min_lr_ratio: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ValueError(f"OptimConfig.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"OptimConfig.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.total_steps is not None and self.schedule != "constant" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.schedule={self.schedule!r} needs total_steps > warmup_steps "
                f"(got total_steps={self.total_steps}, warmup_steps={self.warmup_steps})"
            )

    def for_run(self, steps: int) -> OptimConfig:
        """This config with total_steps set to the run's `steps` when it is unset."""
        if self.total_steps is not None:
            return self
        if self.schedule != "constant" and steps <= self.warmup_steps:
            raise ValueError(
                f"OptimConfig.schedule={self.schedule!r} decays over the run's {steps} steps, which must be "
                f"more than optim.warmup_steps={self.warmup_steps}"
            )
        return replace(self, total_steps=steps)


def lr_multiplier(step: int, config: OptimConfig) -> float:
    """Multiplier of config.lr for training step `step` (0-based)."""
    if step < config.warmup_steps:
        return (step + 1) / (config.warmup_steps + 1)
    if config.schedule == "constant":
        return 1.0
    _require_total_steps(config)
    progress = min(1.0, (step - config.warmup_steps) / max(1, config.total_steps - config.warmup_steps))
    if config.schedule == "linear":
        decay = 1.0 - progress
    else:
        decay = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * decay


def _require_total_steps(config: OptimConfig) -> None:
    if config.schedule != "constant" and config.total_steps is None:
        raise ValueError(
            f"OptimConfig.schedule={config.schedule!r} needs total_steps; set it or fill it in with for_run(steps)"
        )


class _LRLambda:
    def __init__(self, config: OptimConfig) -> None:
        _require_total_steps(config)  # now, not at the first step past the warm-up
        self.config = config

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.config)


class AdapterOptimizer:
    """One adapter's (or, without LoRA, the whole model's) trainable parameters, AdamW and LR schedule."""

    def __init__(self, params: list[torch.nn.Parameter], config: OptimConfig) -> None:
        self.params = params
        self.config = config
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _LRLambda(config))
        self.steps = 0
        """AdamW updates applied (skipped ones not counted); the schedule position is the scheduler's."""

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def clip(self) -> float:
        """The global gradient norm of the parameters (before clipping), clipped to max_grad_norm."""
        return clip_grad_norm(self.params, self.config.max_grad_norm).item()

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1

    def advance_schedule(self) -> None:
        """Move the LR schedule on by one training step. It moves whether or not the step's updates
        were skipped: the learning rate is a function of the step, so a skipped step does not shift
        the rest of the schedule."""
        with warnings.catch_warnings():
            # Raised when the very first update was skipped; that order is intended.
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()

    def schedule_state(self) -> dict:
        """The schedule's position (the schedule itself comes from the config)."""
        return {k: v for k, v in self.scheduler.state_dict().items() if k != "lr_lambdas"}

    def load_schedule_state(self, state: dict) -> None:
        self.scheduler.load_state_dict({**state, "lr_lambdas": [None]})
