"""Prompt datasets for RL: JSONL, Parquet, a local HF `datasets` directory, a Hugging Face dataset by
name, or a reasoning-gym task; and a resumable batch iterator.

    dataset = load_prompt_dataset(DataConfig(path="train.jsonl", apply_chat_template=True), tokenizer)
    batches = PromptBatchIterator(dataset.examples, batch_size=8, seed=0)
    batch = next(batches)                      # list[PromptExample]
    state = batches.state_dict()               # save with the checkpoint ...
    batches.load_state_dict(state)             # ... and the next batch is the same after a resume

A malformed row (bad JSON, bytes that are not UTF-8, a missing field, a value of the wrong type)
is skipped, counted and reported with its file and row number; it never stops loading. So is a
prompt too long for the model's context (see load_prompt_dataset): prompts are never truncated
or altered. Row numbers: JSONL rows are 1-based line numbers (as an editor shows them), Parquet
and `datasets` rows are 0-based indices.

Schemas (DataConfig.schema): "plain" rows hold the prompt and reference in prompt_field and
answer_field; "verl" rows are verl's (data_source, prompt as a chat message list, ability,
reward_model.ground_truth as the reference, extra_info), always rendered with the chat template;
"auto" picks verl when the first row has a reward_model object. A reasoning_gym:<task> source (see
archon.rl.data.reasoning_gym) has its own rows: the question as a chat after a system prompt, the
reasoning-gym entry as the reference, the task as data_source.

    config          DataConfig, the data section
    sources         reading a source's rows; which paths are sources (data_path_problem)
    prompts         rows -> PromptDataset (schemas, chat templates, length limits)
    batches         PromptBatchIterator
    reasoning_gym   reasoning-gym tasks as a source, and their scorers as a reward function
    tasks           the synthetic arithmetic task and the character tokenizer of the demo and tests

No module here imports torch: reward worker processes load reasoning_gym's scorers.
"""

from archon.rl.data.batches import PromptBatchIterator
from archon.rl.data.config import SCHEMAS, DataConfig
from archon.rl.data.prompts import (
    MAX_REPORTED_ROWS,
    VERL_FIELDS,
    MalformedRow,
    PromptDataset,
    PromptExample,
    load_prompt_dataset,
    tokenize_prompt,
)
from archon.rl.data.sources import HUB_OPTIONS, data_path_problem, data_sources_of, hub_name

__all__ = [
    "HUB_OPTIONS",
    "MAX_REPORTED_ROWS",
    "SCHEMAS",
    "VERL_FIELDS",
    "DataConfig",
    "MalformedRow",
    "PromptBatchIterator",
    "PromptDataset",
    "PromptExample",
    "data_path_problem",
    "data_sources_of",
    "hub_name",
    "load_prompt_dataset",
    "tokenize_prompt",
]
