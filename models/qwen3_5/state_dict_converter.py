"""HF Qwen3.5 keys <-> archon.

- A vision-language checkpoint keeps the language model under `model.language_model.` (and the
  vision tower under `model.visual.`, which archon neither loads nor changes); a text-only one
  under `model.`. `lm_head` is top-level in both. Multi-token-prediction weights (`mtp.*`, top-level
  in both) are read into archon's MTP layer (`mtp.0.*`, models/common/mtp.py) when the model builds
  it, and skipped otherwise.
- `in_proj_qkv` rows and `conv1d` channels are stored per key head in archon (see model.py) and
  q | k | v in HF; the rows of in_proj_qkv's LoRA B follow its weight.
- MoE experts: stacked, per-expert checkpoints read too (`StackedExpertsAdapter`).
"""

from __future__ import annotations

import re

import torch

from archon.models.common.linear_attention import qkv_rows_by_key_head
from archon.models.common.mtp import HYBRID_MTP_PARTS, mtp_hf_name
from archon.models.common.state_dict import StackedExpertsAdapter

_GROUPED_ROWS = re.compile(
    r"layers\.\d+\.linear_attn\.(in_proj_qkv\.weight|conv1d\.weight|in_proj_qkv\.lora_b\.weight)"
)


class Qwen3_5StateDictConverter(StackedExpertsAdapter):
    ignored_hf_keys = (*StackedExpertsAdapter.ignored_hf_keys, r"^mtp\.", r"^model\.visual\.")
    carried_hf_keys = (r"^model\.visual\.",)

    def __init__(self, args) -> None:
        super().__init__(args)
        self.hf_prefix = "model.language_model." if args.vision_language else "model."
        self._archon_rows = qkv_rows_by_key_head(args)  # archon row i is HF row _archon_rows[i]

    def hf_name(self, archon_key: str) -> str:
        name = mtp_hf_name(archon_key, "mtp.layers.{i}", HYBRID_MTP_PARTS)
        return super().hf_name(archon_key) if name is None else name

    def _to_archon_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if not _GROUPED_ROWS.fullmatch(key):
            return tensor
        return tensor.index_select(0, self._archon_rows.to(tensor.device))

    def _to_hf_rows(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if not _GROUPED_ROWS.fullmatch(key):
            return tensor
        return tensor.new_empty(tensor.shape).index_copy_(0, self._archon_rows.to(tensor.device), tensor)

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        return self._to_archon_rows(archon_key, super().combine(archon_key, tensors))

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return super().to_hf(archon_key, self._to_hf_rows(archon_key, tensor))

    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return super().lora_to_peft(archon_key, self._to_hf_rows(archon_key, tensor))

    def lora_from_peft(self, archon_key: str, tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        return self._to_archon_rows(archon_key, super().lora_from_peft(archon_key, tensors, shape))
