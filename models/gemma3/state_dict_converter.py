import re

from archon.checkpoint.state_dict_converter import StateDictConverter

# The vision-language composite's vision tower and projector, in the layout HF saves (and releases
# hold) and in its in-memory one.
_VISION_KEYS = (r"^(model\.)?vision_tower\.", r"^(model\.)?multi_modal_projector\.")


class Gemma3StateDictConverter(StateDictConverter):
    """HF Gemma 3 keys: a rename, `lm_head` top-level and absent when tied.

    Text-only (gemma3_text): the language model under `model.`. Vision-language composite (gemma3):
    HF's module paths (`hf_name`, which PEFT adapters follow) are `model.language_model.*` and
    `lm_head`, but `save_pretrained` writes, and released checkpoints hold, `language_model.model.*`
    and `language_model.lm_head`; both layouts are read, the saved one is written. The vision tower and
    projector are not built, and a merged export copies them unchanged. The composite's adapter names
    each adapted module by its path: the vision tower's attention has q/k/v_proj too, which PEFT would
    wrap for a leaf name.
    """

    ignored_hf_keys = (*StateDictConverter.ignored_hf_keys, *_VISION_KEYS)
    carried_hf_keys = _VISION_KEYS

    def __init__(self, args) -> None:
        super().__init__(args)
        self.vision_language = args.vision_language
        if self.vision_language:
            self.hf_prefix = "model.language_model."

    def checkpoint_name(self, archon_key: str) -> str:
        """The key HF's save_pretrained writes for archon parameter `archon_key`."""
        name = self.hf_name(archon_key)
        if not self.vision_language:
            return name
        if archon_key.startswith(self.top_level):
            return f"language_model.{name}"
        return f"language_model.model.{name.removeprefix(self.hf_prefix)}"

    def is_ignored(self, hf_key: str) -> bool:
        if self.vision_language and self.args.tie_word_embeddings and hf_key == "language_model.lm_head.weight":
            return True
        return super().is_ignored(hf_key)

    def hf_sources(self, archon_key: str, hf_keys: set[str]) -> list[str]:
        saved = self.checkpoint_name(archon_key)
        return [saved if saved in hf_keys else self.hf_name(archon_key)]

    def to_hf(self, archon_key: str, tensor):
        return [(self.checkpoint_name(archon_key), tensor)]

    def peft_targets(self, module_names, lora_keys) -> tuple[list[str], list[str]]:
        target_modules, target_parameters = super().peft_targets(module_names, lora_keys)
        if not self.vision_language:
            return target_modules, target_parameters
        modules = {re.fullmatch(r"(.+)\.lora_[ab]\.weight", key).group(1) for key in lora_keys}
        return sorted(self.hf_name(module) for module in modules), target_parameters
