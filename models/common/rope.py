"""Rotary position embeddings, with the inverse frequencies computed as HF computes them from
`config.rope_parameters` (rope_type default, linear, llama3, yarn)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def _default_inv_freq(base: float, dim: int) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params["original_max_position_embeddings"]
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1.0 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def yarn_softmax_mscale(rope_parameters: dict[str, Any]) -> float:
    """The factor DeepSeek's MLA multiplies its softmax scale by under scaled RoPE:
    mscale(factor, mscale_all_dim)**2, or 1.0 for rope_type default or without mscale_all_dim."""
    if rope_parameters.get("rope_type", "default") == "default" or not rope_parameters.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(rope_parameters["factor"], rope_parameters["mscale_all_dim"]) ** 2


ROPE_TYPES = ("default", "linear", "llama3", "yarn")
"""The `rope_parameters["rope_type"]` values `rope_inv_freq` implements."""


def rope_inv_freq(
    rope_parameters: dict[str, Any], rotary_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (fp32, CPU) and the cos/sin scaling factor."""
    rope_type = rope_parameters.get("rope_type", "default")
    base = rope_parameters["rope_theta"]
    if rope_type == "default":
        return _default_inv_freq(base, rotary_dim), 1.0
    if rope_type == "linear":
        return _default_inv_freq(base, rotary_dim) / rope_parameters["factor"], 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(_default_inv_freq(base, rotary_dim), rope_parameters), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, rope_parameters, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope_type!r} in rope_parameters; supported: {', '.join(ROPE_TYPES)}")


class RotaryEmbedding(nn.Module):
    """cos/sin tables [T, rotary_dim] for packed positions[T].

    inv_freq is a plain CPU tensor rather than a buffer, so building on the meta device and
    materialising later needs no re-initialisation.
    """

    def __init__(self, rope_parameters: dict[str, Any], rotary_dim: int, max_position_embeddings: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        with torch.device("cpu"):
            inv_freq, self.attention_scaling = rope_inv_freq(rope_parameters, rotary_dim, max_position_embeddings)
        self._inv_freq = {torch.device("cpu"): inv_freq}

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)


class LayerTypeRotaryEmbedding(nn.Module):
    """One RoPE per layer type (`config.layer_types`), each with its own `rope_parameters` entry:
    OLMo 3 scales only its full-attention layers with YaRN. Returns {layer type: (cos, sin)}, and
    `PackedDecoderLM` hands each layer the tables of its type.

    fp32_tables: keep cos/sin in fp32 whatever the model dtype (OLMo 3 rotates in fp32, then casts
    q and k back).
    """

    def __init__(
        self,
        rope_parameters_by_layer_type: dict[str, dict[str, Any]],
        rotary_dim: int,
        max_position_embeddings: int,
        fp32_tables: bool = False,
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.fp32_tables = fp32_tables
        self.by_layer_type = nn.ModuleDict(
            {
                layer_type: RotaryEmbedding(params, rotary_dim, max_position_embeddings)
                for layer_type, params in rope_parameters_by_layer_type.items()
            }
        )

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        dtype = torch.float32 if self.fp32_tables else dtype
        return {layer_type: rotary(positions, dtype) for layer_type, rotary in self.by_layer_type.items()}


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """x[T, H, D] with cos/sin [T, R], R <= D (half-split layout, as HF's rotate_half). The result
    has x's dtype (fp32 tables rotate a bf16 x in fp32).

    With R < D only the first R features of each head rotate and the rest pass through (partial
    rotary, e.g. GLM-4.5). `interleaved`: the R rotary features are stored as pairs (x0, x1),
    (x2, x3), ... (DeepSeek's rope_interleave); they come out in half-split order, as HF returns them.
    """
    rotary_dim = cos.shape[-1]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        rot = torch.cat((rot[..., 0::2], rot[..., 1::2]), dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = (rot * cos + rotate_half(rot) * sin).to(x.dtype)
    return rot if rest.shape[-1] == 0 else torch.cat((rot, rest), dim=-1)
