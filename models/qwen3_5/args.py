from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from archon.models.common.args import HybridDeltaNetArgs, hybrid_deltanet_fields_from_hf, language_model_fields_from_hf


@dataclass
class Qwen3_5Args(HybridDeltaNetArgs):
    """Qwen3.5 / Qwen3.6 (dense and MoE) hyper-parameters, named as in the HF text config. With
    num_experts > 0 every layer's MLP is routed experts plus a gated shared expert, else a dense one.

    vision_language: the checkpoint is a vision-language composite (`text_config` and
        `vision_config`; language-model weights under `model.language_model.`), of which archon
        builds and trains the language model only.
    """

    mtp_config_field: ClassVar[str] = "mtp_num_hidden_layers"

    vision_language: bool = False

    @classmethod
    def from_hf_config(cls, config) -> "Qwen3_5Args":
        """`config`: a text config (qwen3_5_text, qwen3_5_moe_text) or a composite one (qwen3_5,
        qwen3_5_moe) whose `text_config` is read, but for `tie_word_embeddings`, read at the top
        level as HF's vision-language model reads it."""
        text = config.get_text_config()
        fields = language_model_fields_from_hf(config, hybrid_deltanet_fields_from_hf)
        args = cls(
            **fields,
            vision_language=text is not config,
            checkpoint_mtp_layers=int(getattr(text, "mtp_num_hidden_layers", 0) or 0),
        )
        args.validate()
        return args

    def validate(self) -> None:
        super().validate()
        if self.num_experts == 0 and self.intermediate_size <= 0:
            raise ValueError("a dense Qwen3.5 config needs intermediate_size > 0")
