"""HF <-> archon state-dict mapping: the contract every model family fulfils.

By default an archon FQN is the HF key without the `model.` prefix (`lm_head.*` keeps its name),
and a LoRA parameter `<module>.lora_a.weight` maps to PEFT's
`base_model.model.<hf module path>.lora_A.weight`. Families override the hooks for keys that do not
map one to one (stacked experts, fused projections).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

LORA_PARAM_MARKERS = ("lora_a", "lora_b")
"""The module names of a LoRA adapter's factors in archon's parameter names."""


def is_lora_param(name: str) -> bool:
    """A LoRA factor's parameter (`<module>.lora_a.weight`, or a task's under a multi-task module)."""
    return any(part in LORA_PARAM_MARKERS for part in name.split("."))


PEFT_PREFIX = "base_model.model."


class StateDictConverter:
    hf_prefix = "model."
    peft_reserved_module_names: tuple[str, ...] = ()
    top_level = ("lm_head.",)
    # HF keys that some checkpoints carry and that archon recomputes.
    ignored_hf_keys: tuple[str, ...] = (r"(^|\.)rotary_emb\.inv_freq$",)
    # Ignored HF keys of weights archon does not build but that a merged export copies over unchanged
    # from the source checkpoint (a vision-language model's vision tower), so it loads as the original.
    carried_hf_keys: tuple[str, ...] = ()

    def __init__(self, args) -> None:
        self.args = args

    # ---- base weights -------------------------------------------------------------------------
    def hf_name(self, archon_key: str) -> str:
        if archon_key.startswith(self.top_level):
            return archon_key
        return self.hf_prefix + archon_key

    def is_ignored(self, hf_key: str) -> bool:
        if getattr(self.args, "tie_word_embeddings", False) and hf_key == "lm_head.weight":
            return True
        return any(re.search(pattern, hf_key) for pattern in self.ignored_hf_keys)

    def is_carried(self, hf_key: str) -> bool:
        return any(re.search(pattern, hf_key) for pattern in self.carried_hf_keys)

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        """The HF keys that make up archon parameter `archon_key` (in the order `combine` expects)."""
        return [self.hf_name(archon_key)]

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        (tensor,) = tensors
        return tensor

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """One archon tensor as the HF checkpoint tensor(s) it stands for."""
        return [(self.hf_name(archon_key), tensor)]

    def iter_to_hf(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Streaming conversion, one tensor at a time (used by weight sync)."""
        for key, tensor in named_tensors:
            yield from self.to_hf(key, tensor)

    def state_dict_to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(self.iter_to_hf(state_dict.items()))

    # ---- LoRA <-> PEFT ------------------------------------------------------------------------
    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """`<module>.lora_a.weight` -> `base_model.model.<hf module>.lora_A.weight` (likewise B)."""
        match = re.fullmatch(r"(.+)\.lora_([ab])\.weight", archon_key)
        if match is None:
            raise KeyError(f"LoRA parameter {archon_key!r} has no PEFT mapping in {type(self).__name__}")
        module, which = match.groups()
        return [(f"{PEFT_PREFIX}{self.hf_name(module)}.lora_{which.upper()}.weight", tensor)]

    def lora_state_dict_to_peft(self, lora_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for key, tensor in lora_state.items():
            out.update(self.lora_to_peft(key, tensor))
        return out

    def lora_state_dict_from_peft(
        self, peft_state: dict[str, torch.Tensor], expected: dict[str, torch.Size]
    ) -> dict[str, torch.Tensor]:
        """Invert `lora_to_peft` for the archon LoRA parameters `expected` (name -> shape)."""
        out: dict[str, torch.Tensor] = {}
        used: set[str] = set()
        for key, shape in expected.items():
            dummy = torch.empty(shape, device="meta")
            sources = [peft_key for peft_key, _ in self.lora_to_peft(key, dummy)]
            missing = [s for s in sources if s not in peft_state]
            if missing:
                raise KeyError(f"adapter is missing key {missing[0]!r} (for archon parameter {key!r})")
            out[key] = self.lora_from_peft(key, [peft_state[s] for s in sources], shape)
            used.update(sources)
        unexpected = sorted(set(peft_state) - used)
        if unexpected:
            raise KeyError(
                f"adapter has {len(unexpected)} key(s) this model's LoRA does not have, e.g. {unexpected[0]!r}; "
                "was it trained with other target_modules?"
            )
        return out

    def lora_from_peft(self, archon_key: str, tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        (tensor,) = tensors
        if tensor.shape != shape:
            raise ValueError(
                f"adapter tensor for {archon_key!r} has shape {tuple(tensor.shape)}, expected {tuple(shape)} "
                "(different rank or model size?)"
            )
        return tensor

    def peft_target_parameters(self, lora_keys: Iterable[str]) -> list[str]:
        """PEFT `target_parameters` for LoRA on raw (e.g. stacked expert) parameters; none by default."""
        return []

    def peft_targets(self, module_names: Iterable[str], lora_keys: Iterable[str]) -> tuple[list[str], list[str]]:
        """PEFT (`target_modules`, `target_parameters`) for an adapter on the LoRALinear modules with
        these HF leaf names and with these archon LoRA parameter keys."""
        return sorted(set(module_names)), self.peft_target_parameters(lora_keys)
