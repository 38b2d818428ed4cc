"""The data section of the config (`data`, and each task's `tasks[i].data`): where the prompts come
from and how batches are drawn."""

from __future__ import annotations

from dataclasses import dataclass

SCHEMAS = ("auto", "plain", "verl")


@dataclass
class DataConfig:
    """Where the prompts come from and how batches are drawn (the recipe takes rollout.prompts_per_step
    prompts per batch)."""

    path: str = ""
    """A .jsonl file, a .parquet file, a directory written by datasets' save_to_disk, a Hugging Face
    dataset name (owner/name, loaded with datasets.load_dataset; a local path that exists wins;
    owner/name?split=test&subset=main overrides split and subset), or
    reasoning_gym:<task>?size=N&seed=S&<task setting>=<value>... (see docs/datasets.md)."""
    schema: str = "auto"
    """How rows are read: plain (prompt_field and answer_field), verl (verl's rows: the prompt is a
    chat message list rendered with the chat template, the reference reward_model.ground_truth), or
    auto (verl when the first row has a reward_model object, else plain). The log says which."""
    split: str = "train"
    """The split of a Hugging Face dataset, or of a datasets directory holding a DatasetDict."""
    subset: str | None = None
    """The configuration (subset) of a Hugging Face dataset named by path, e.g. "main" for openai/gsm8k."""
    prompt_field: str = "prompt"
    """Field with the prompt: a string, or a list of {role, content} chat messages. Dots reach
    into nested objects (e.g. extra.question) when no field has the dotted name itself."""
    answer_field: str | None = "answer"
    """Field with the reference answer given to the reward function; None for no references."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (with the generation prompt appended)."""
    system_prompt: str | None = None
    """A system message put before each prompt when the chat template is applied (for a reasoning_gym
    source it replaces reasoning-gym's own instruction to answer inside <answer> </answer>)."""
    max_prompt_tokens: int | None = None
    """Skip (and count) prompts longer than this many tokens; needs a tokenizer."""
    shuffle: bool = True
    seed: int = 0
    """Seed of the per-epoch shuffle: the same seed gives the same batches."""
    drop_last: bool = True
    """Skip an epoch's last, incomplete batch, so every batch is full."""

    def __post_init__(self) -> None:
        if self.schema not in SCHEMAS:
            raise ValueError(f"DataConfig.schema must be one of {', '.join(SCHEMAS)}, got {self.schema!r}")
