"""State-dict mapping for stacked MoE experts (`GroupedExperts`), shared by the MoE families.

Expert LoRA is exported in PEFT's `target_parameters` layout (`StackedExpertLoRAAdapter`, which a
family points at its experts' names): with both stacked weights targeted, PEFT nests the wrappers, so
gate_up_proj's factors live at `experts.base_layer.lora_*` and down_proj's at `experts.lora_*`;
lora_A is [E*r, in] (expert-major rows) and lora_B is [out, r*E] (expert-minor columns). `in`/`out`
are the projection's input and output sizes whichever way the base weight is stored.

Some HF checkpoints store experts one by one (`mlp.experts.<e>.gate_proj.weight`, ...) while archon
and HF's in-memory model stack them (`mlp.experts.gate_up_proj` [E, 2I, D], `mlp.experts.down_proj`
[E, D, I]); `StackedExpertsAdapter` also maps those.
"""

from __future__ import annotations

import re

import torch

from archon.checkpoint.state_dict_converter import PEFT_PREFIX, StateDictConverter
from archon.models.common.mtp import mtp_hf_name


def stacked_lora_to_peft(factor: str, tensor: torch.Tensor) -> torch.Tensor:
    """An expert LoRA factor ("a" or "b") from archon's stacked layout to PEFT's: lora_a [E, r, in] ->
    [E*r, in]; lora_b [E, out, r] -> [out, r*E], column rank_index * E + expert."""
    if factor == "a":
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.permute(1, 2, 0).reshape(tensor.shape[1], -1)


def stacked_lora_from_peft(archon_key: str, factor: str, tensor: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The inverse of `stacked_lora_to_peft` for the archon parameter `archon_key` of `shape` [E, ...]."""
    n_experts = shape[0]
    if tensor.numel() != torch.Size(shape).numel():
        raise ValueError(
            f"adapter tensor for {archon_key!r} has shape {tuple(tensor.shape)}, which does not hold "
            f"{n_experts} experts of {tuple(shape[1:])}"
        )
    if factor == "a":
        return tensor.reshape(shape)
    out_features, rank = shape[1], shape[2]
    return tensor.reshape(out_features, rank, n_experts).permute(2, 0, 1).contiguous()


class StackedExpertLoRAAdapter(StateDictConverter):
    """LoRA on stacked experts <-> PEFT `target_parameters`; base weights keep the default mapping.

    A family says where its experts are: `expert_layers` (a pattern of the archon module paths that
    hold them), `expert_module` (the experts' path below such a module) and `expert_weights` (the
    stacked weights, in the order of PEFT's `target_parameters`)."""

    # a decoder layer, or an MTP layer's block (models/common/mtp.py)
    expert_layers = r"(?:layers\.\d+|mtp\.\d+\.block)"
    expert_module = "mlp.experts"
    expert_weights = ("gate_up_proj", "down_proj")

    def _experts_pattern(self) -> str:
        weights = "|".join(re.escape(name) for name in self.expert_weights)
        return rf"({self.expert_layers}\.{re.escape(self.expert_module)})\.({weights})"

    def expert_weight_match(self, archon_key: str) -> re.Match | None:
        """(experts module, stacked weight) of a stacked expert weight's archon key, else None."""
        return re.fullmatch(self._experts_pattern(), archon_key)

    def expert_lora_match(self, archon_key: str) -> re.Match | None:
        """(experts module, stacked weight, factor "a"/"b") of an expert LoRA factor's key, else None."""
        return re.fullmatch(self._experts_pattern() + r"_lora\.lora_([ab])", archon_key)

    def peft_wrapper(self, weight: str) -> str:
        """Where PEFT keeps the factors of stacked weight `weight`, below the experts' parent module.
        PEFT wraps the experts once per targeted weight, the first innermost: with (gate_up_proj,
        down_proj) gate_up_proj's factors are at `experts.base_layer.lora_*`, down_proj's at
        `experts.lora_*`."""
        depth = len(self.expert_weights) - 1 - self.expert_weights.index(weight)
        return ".".join([self.expert_module.rsplit(".", 1)[-1], *["base_layer"] * depth])

    def lora_to_peft(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = self.expert_lora_match(archon_key)
        if match is None:
            return super().lora_to_peft(archon_key, tensor)
        experts, which, factor = match.groups()
        parent = self.hf_name(experts.rsplit(".", 1)[0])
        key = f"{PEFT_PREFIX}{parent}.{self.peft_wrapper(which)}.lora_{factor.upper()}.weight"
        return [(key, stacked_lora_to_peft(factor, tensor))]

    def lora_from_peft(self, archon_key: str, tensors: list[torch.Tensor], shape: torch.Size) -> torch.Tensor:
        match = self.expert_lora_match(archon_key)
        if match is None:
            return super().lora_from_peft(archon_key, tensors, shape)
        (tensor,) = tensors
        return stacked_lora_from_peft(archon_key, match.group(3), tensor, shape)

    def peft_target_parameters(self, lora_keys) -> list[str]:
        if any(self.expert_lora_match(k) for k in lora_keys):
            return [f"{self.expert_module}.{name}" for name in self.expert_weights]
        return []


class StackedExpertsAdapter(StackedExpertLoRAAdapter):
    """Stacked-expert LoRA, plus base experts read from (and written as) per-expert HF tensors."""

    # In an MoE model PEFT (under transformers v5) reads these target_modules names as per-expert
    # projections and refolds them into the stacked experts.
    peft_reserved_module_names = ("gate_proj", "up_proj", "down_proj", "gate")
    # The per-expert checkpoint weights each stacked weight is made of, in row order.
    hf_expert_parts = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

    def per_expert_hf_name(self, experts: str) -> str:
        """The checkpoint name of the experts module `experts` (an archon name), whose per-expert
        weights are `<name>.<e>.<part>.weight`."""
        return self.hf_name(experts)

    def _num_experts(self) -> int:
        return self.args.num_experts

    def peft_targets(self, module_names, lora_keys) -> tuple[list[str], list[str]]:
        """Dense modules with a reserved name (a dense MLP layer, shared experts) are exported as
        `target_parameters` "<name>.weight" in an MoE model: as target_modules PEFT would turn them into
        expert LoRA. Their adapter keys are the same either way (`<module>.lora_A.weight`)."""
        target_modules, target_parameters = super().peft_targets(module_names, lora_keys)
        if self._num_experts() == 0:
            return target_modules, target_parameters
        reserved = [name for name in target_modules if name in self.peft_reserved_module_names]
        kept = [name for name in target_modules if name not in reserved]
        return kept, target_parameters + [f"{name}.weight" for name in reserved]

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        match = self.expert_weight_match(archon_key)
        if match is None:
            return super().hf_sources(archon_key, hf_keys)
        stacked = self.hf_name(archon_key)
        if stacked in hf_keys:
            return [stacked]
        prefix, which = match.groups()
        return [
            f"{self.per_expert_hf_name(prefix)}.{e}.{part}.weight"
            for e in range(self._num_experts())
            for part in self.hf_expert_parts[which]
        ]

    def combine(self, archon_key: str, tensors: list[torch.Tensor]) -> torch.Tensor:
        match = self.expert_weight_match(archon_key)
        if match is None or len(tensors) == 1:
            return super().combine(archon_key, tensors)
        n_parts = len(self.hf_expert_parts[match.group(2)])
        shapes = {tuple(t.shape) for t in tensors}
        if len(shapes) != 1:
            raise ValueError(f"per-expert tensors for {archon_key!r} have differing shapes {sorted(shapes)}")
        return torch.stack(
            [torch.cat(tensors[e * n_parts : (e + 1) * n_parts], dim=0) for e in range(self._num_experts())]
        )

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        match = self.expert_weight_match(archon_key)
        if match is None:
            return super().to_hf(archon_key, tensor)
        prefix, which = match.groups()
        parts = self.hf_expert_parts[which]
        out = []
        for e in range(tensor.shape[0]):
            for part, chunk in zip(parts, tensor[e].chunk(len(parts), dim=0)):
                out.append((f"{self.per_expert_hf_name(prefix)}.{e}.{part}.weight", chunk))
        return out


class MultiTokenPredictionCheckpointAdapter(StackedExpertsAdapter):
    """For checkpoints that carry multi-token-prediction layers (`num_nextn_predict_layers`,
    GLM-4.5 and DeepSeek-V3): decoder layers numbered from `num_hidden_layers` on, which HF's causal
    LM does not build. Archon's MTP layers (`mtp.<i>.*`, models/common/mtp.py, built only when asked
    for) are read from layer `num_hidden_layers + i`: its `hnorm`, `enorm`, `eh_proj`,
    `shared_head.norm` and the decoder block's weights; its copies of the embedding and the output
    head (`embed_tokens`, `shared_head.head`) are the model's own, so they are skipped when loading
    and written from the model's when saving. Every other such layer is skipped."""

    _LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")
    _MTP_PARTS = {
        "hidden_norm": "model.layers.{layer}.hnorm",
        "embedding_norm": "model.layers.{layer}.enorm",
        "projection": "model.layers.{layer}.eh_proj",
        "norm": "model.layers.{layer}.shared_head.norm",
    }

    def hf_name(self, archon_key: str) -> str:
        name = mtp_hf_name(archon_key, "model.layers.{layer}", self._MTP_PARTS, self.args.num_hidden_layers)
        return super().hf_name(archon_key) if name is None else name

    def is_ignored(self, hf_key: str) -> bool:
        match = self._LAYER_INDEX.match(hf_key)
        if match is not None and int(match.group(1)) >= self.args.num_hidden_layers:
            return True
        return super().is_ignored(hf_key)

    def to_hf(self, archon_key: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        out = super().to_hf(archon_key, tensor)
        first, count = self.args.num_hidden_layers, getattr(self.args, "num_mtp_layers", 0)
        tied = getattr(self.args, "tie_word_embeddings", False)
        copies = []
        if archon_key == "embed_tokens.weight":
            copies.append("embed_tokens.weight")
            if tied:
                copies.append("shared_head.head.weight")
        elif archon_key == "lm_head.weight":
            copies.append("shared_head.head.weight")
        # separate copies: safetensors refuses to write one storage under two names
        return out + [(f"model.layers.{first + i}.{name}", tensor.clone()) for i in range(count) for name in copies]
