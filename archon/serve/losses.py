"""The Tinker API's built-in loss functions, as plain functions of one datum's tensors.

Every loss takes the datum's `target_logprobs` [N] (log p_theta of `target_tokens` under the model
being trained, with gradient) and its `loss_fn_inputs` (1-D [N] tensors named as the Tinker API
names them), and returns the datum's loss summed over its tokens (the API's `loss:sum`). With q the
sampling policy (`logprobs`), ratio = p_theta / q per token and A the `advantages`:

    cross_entropy        sum_t -log p_theta(x_t) * weights_t
    importance_sampling  sum_t -ratio_t * A_t
    ppo                  sum_t -min(ratio_t * A_t, clip(ratio_t, lo, hi) * A_t)
    cispo                sum_t -sg(clip(ratio_t, lo, hi)) * log p_theta(x_t) * A_t
    dro                  sum_t -(log p_theta(x_t) * A_t - beta / 2 * (log p_theta(x_t) - log q(x_t))^2)
    gspo                 ppo's objective with every token's ratio replaced by the sequence ratio
                         s = exp(mean_{t in M} log ratio_t) (M: `sequence_ratio_mask`), which each
                         token carries with its own log-prob's gradient: s_t = sg(s) * p_t / sg(p_t)

`clip_low_threshold` (lo, default 0.8) and `clip_high_threshold` (hi, default 1.2) come from the
request's `loss_fn_config`, as does dro's `beta` (required). `stable_reinforce` is not served: it
needs stability records taken at sampling time, whose use the API does not document.
"""

from __future__ import annotations

import torch

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2

FLOAT_INPUTS = ("weights", "logprobs", "advantages", "sequence_ratio_mask")
"""Loss inputs that are float32 on the wire; `target_tokens` is int64."""

LOSS_INPUTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "cross_entropy": (("target_tokens",), ("weights",)),
    "importance_sampling": (("target_tokens", "logprobs", "advantages"), ()),
    "ppo": (("target_tokens", "logprobs", "advantages"), ()),
    "cispo": (("target_tokens", "logprobs", "advantages"), ()),
    "dro": (("target_tokens", "logprobs", "advantages"), ()),
    "gspo": (("target_tokens", "logprobs", "advantages"), ("sequence_ratio_mask",)),
}
"""Each served loss's (required, optional) loss_fn_inputs."""

CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low_threshold", "clip_high_threshold"),
    "cispo": ("clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "gspo": ("clip_low_threshold", "clip_high_threshold"),
}
"""The loss_fn_config keys each loss reads."""


def cross_entropy(target_logprobs: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    if weights is None:
        return -target_logprobs.sum()
    return -(target_logprobs * weights).sum()


def importance_sampling(
    target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor
) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - sampling_logprobs)
    return -(ratio * advantages).sum()


def _clipped_objective(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float) -> torch.Tensor:
    clipped = torch.clamp(ratio, low, high)
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def ppo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = DEFAULT_CLIP_LOW,
    clip_high_threshold: float = DEFAULT_CLIP_HIGH,
) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - sampling_logprobs)
    return _clipped_objective(ratio, advantages, clip_low_threshold, clip_high_threshold)


def cispo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    clip_low_threshold: float = DEFAULT_CLIP_LOW,
    clip_high_threshold: float = DEFAULT_CLIP_HIGH,
) -> torch.Tensor:
    ratio = torch.exp(target_logprobs - sampling_logprobs)
    coefficient = torch.clamp(ratio, clip_low_threshold, clip_high_threshold).detach()
    return -(coefficient * target_logprobs * advantages).sum()


def dro(
    target_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, advantages: torch.Tensor, beta: float
) -> torch.Tensor:
    penalty = (target_logprobs - sampling_logprobs) ** 2
    return -(target_logprobs * advantages - 0.5 * beta * penalty).sum()


def gspo(
    target_logprobs: torch.Tensor,
    sampling_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    sequence_ratio_mask: torch.Tensor | None = None,
    clip_low_threshold: float = DEFAULT_CLIP_LOW,
    clip_high_threshold: float = DEFAULT_CLIP_HIGH,
) -> torch.Tensor:
    """sequence_ratio_mask [N]: the tokens whose log-ratios the sequence ratio averages (None: all)."""
    in_ratio = (
        torch.ones_like(target_logprobs, dtype=torch.bool) if sequence_ratio_mask is None else sequence_ratio_mask != 0
    )
    if not bool(in_ratio.any()):
        return (target_logprobs * 0).sum()
    log_ratio = (target_logprobs.detach() - sampling_logprobs)[in_ratio].mean()
    ratio = torch.exp(log_ratio + target_logprobs - target_logprobs.detach())
    return _clipped_objective(ratio, advantages, clip_low_threshold, clip_high_threshold)


def check_config(loss_fn: str, config: dict) -> None:
    """Refuse loss_fn_config keys the loss does not read, and a dro without its beta."""
    unknown = sorted(set(config) - set(CONFIG_KEYS[loss_fn]))
    if unknown:
        raise ValueError(
            f"loss_fn_config has {unknown}, which loss_fn {loss_fn!r} does not read "
            f"(it reads {list(CONFIG_KEYS[loss_fn])})"
        )
    for key, value in config.items():
        if isinstance(value, str):
            raise ValueError(f"loss_fn_config[{key!r}] must be a number, got {value!r}")
    if loss_fn == "dro" and "beta" not in config:
        raise ValueError("loss_fn 'dro' needs loss_fn_config['beta'] (the weight of its quadratic penalty)")


def datum_loss(
    loss_fn: str, target_logprobs: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """The loss `loss_fn` of one datum (its inputs already checked against LOSS_INPUTS)."""
    if loss_fn == "cross_entropy":
        return cross_entropy(target_logprobs, inputs.get("weights"))
    sampling, advantages = inputs["logprobs"], inputs["advantages"]
    if loss_fn == "importance_sampling":
        return importance_sampling(target_logprobs, sampling, advantages)
    if loss_fn == "dro":
        return dro(target_logprobs, sampling, advantages, float(config["beta"]))
    clip = {
        "clip_low_threshold": float(config.get("clip_low_threshold", DEFAULT_CLIP_LOW)),
        "clip_high_threshold": float(config.get("clip_high_threshold", DEFAULT_CLIP_HIGH)),
    }
    if loss_fn == "ppo":
        return ppo(target_logprobs, sampling, advantages, **clip)
    if loss_fn == "cispo":
        return cispo(target_logprobs, sampling, advantages, **clip)
    if loss_fn == "gspo":
        return gspo(target_logprobs, sampling, advantages, inputs.get("sequence_ratio_mask"), **clip)
    raise ValueError(f"loss_fn {loss_fn!r} is not one of the served losses {sorted(LOSS_INPUTS)}")
