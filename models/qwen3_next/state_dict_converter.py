"""HF Qwen3-Next keys <-> archon.

- Module names follow HF without `model.`; multi-token-prediction weights (`mtp.*`) are read into
  archon's MTP layer (`mtp.0.*`, models/common/mtp.py) when the model builds it, and skipped otherwise.
- `conv1d` channels are stored per key head in archon ([q_h | k_h | v of h's value heads], as the
  rows of in_proj_qkvz they convolve) and q | k | v in HF. in_proj_qkvz and in_proj_ba are already
  grouped per key head in HF, so they, and their LoRA factors, map unchanged.
- MoE experts: stacked, per-expert checkpoints (`mlp.experts.<e>.gate_proj.weight`, as released) read
  and written too (`StackedExpertsAdapter`).
"""

from __future__ import annotations

import re

import torch

from archon.models.common.linear_attention import qkv_rows_by_key_head
from archon.models.common.mtp import HYBRID_MTP_PARTS, mtp_hf_name
from archon.models.common.state_dict import StackedExpertsAdapter

_CONV_WEIGHT = re.compile(r"layers\.\d+\.linear_attn\.conv1d\.weight")


class Qwen3NextStateDictConverter(StackedExpertsAdapter):
    ignored_hf_keys = (*StackedExpertsAdapter.ignored_hf_keys, r"^mtp\.")

    def __init__(self, args) -> None:
        super().__init__(args)
        self._archon_channels = qkv_rows_by_key_head(args)  # archon channel i is HF channel _archon_channels[i]

    def hf_name(self, archon_key: str) -> str:
        name = mtp_hf_name(archon_key, "mtp.layers.{i}", HYBRID_MTP_PARTS)
        return super().hf_name(archon_key) if name is None else name

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        tensor = super().combine(archon_key, tensors)
        if not _CONV_WEIGHT.fullmatch(archon_key):
            return tensor
        return tensor.index_select(0, self._archon_channels.to(tensor.device))

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if _CONV_WEIGHT.fullmatch(archon_key):
            tensor = tensor.new_empty(tensor.shape).index_copy_(0, self._archon_channels.to(tensor.device), tensor)
        return super().to_hf(archon_key, tensor)
