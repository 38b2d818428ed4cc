"""Prompt datasets: a source's rows read with a schema (plain, verl or reasoning_gym) into prompts,
malformed and too-long rows skipped and reported (see the package doc)."""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Iterator

from archon.rl.data import reasoning_gym
from archon.rl.data.config import DataConfig
from archon.rl.data.sources import open_rows

logger = logging.getLogger("archon.rl.data")

MAX_REPORTED_ROWS = 10
VERL_FIELDS = ("prompt", "reward_model.ground_truth")
"""Where a verl row holds its prompt and its reference."""


@dataclass
class PromptExample:
    prompt: str
    """The text given to the model (chat template already applied when configured)."""
    reference: Any
    """The reference answer (None without answer_field)."""
    source: str
    """Where the row came from, e.g. "data/train.jsonl:12" or "data/train.parquet row 11"."""
    prompt_ids: list[int] | None = None
    """The prompt's token ids, when loading tokenized it (for a length limit)."""
    row: dict | None = None
    """The whole row, as read (what a multi-turn environment starts from)."""
    data_source: str = ""
    """The row's `data_source` (verl's field: which dataset it came from, which routes its reward
    and its teacher); "" when the row has none."""
    extra_info: Any = None
    """The row's `extra_info` (verl's field: anything a reward function needs beside the reference,
    passed to functions that take it); None when the row has none."""


@dataclass
class MalformedRow:
    path: str
    row: int
    """1-based line number for JSONL, 0-based row index for Parquet and datasets directories."""
    reason: str
    line_numbered: bool = False

    @property
    def location(self) -> str:
        return _location(self.path, self.row, self.line_numbered)

    def __str__(self) -> str:
        return f"{self.location}: {self.reason}"


@dataclass
class PromptDataset:
    examples: list[PromptExample]
    malformed: list[MalformedRow] = field(default_factory=list)
    """Rows skipped because they were malformed."""
    too_long: list[MalformedRow] = field(default_factory=list)
    """Rows skipped because the prompt had more tokens than max_prompt_tokens or than the model's
    context leaves for it."""
    chat_template_applied: bool = False
    schema: str = "plain"
    """How the rows were read: plain, verl or reasoning_gym."""
    schema_reason: str = ""
    """Why that schema: set by data.schema, or what auto detection saw."""

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> PromptExample:
        return self.examples[index]

    def report(self) -> str:
        """One line with the counts, then up to MAX_REPORTED_ROWS skipped rows with their locations."""
        lines = [f"{len(self.examples)} prompts, {len(self.malformed)} malformed rows, {len(self.too_long)} too long"]
        skipped = self.malformed + self.too_long
        lines += [f"  {row}" for row in skipped[:MAX_REPORTED_ROWS]]
        if len(skipped) > MAX_REPORTED_ROWS:
            lines.append(f"  ... and {len(skipped) - MAX_REPORTED_ROWS} more")
        return "\n".join(lines)


def _location(path: str, row: int, line_numbered: bool) -> str:
    return f"{path}:{row}" if line_numbered else f"{path} row {row}"


def _get_field(row: dict, name: str) -> Any:
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _check_messages(value: list) -> str | None:
    if not value:
        return "is an empty message list"
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            return f"message {i} is not a {{role: str, content: str}} object"
    return None


def _plain(value: Any) -> Any:
    """The value with numpy arrays and scalars (as pandas reads Parquet back) made lists and Python numbers."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _plain(value.tolist())
    return value


def _detect_schema(
    rows: Iterator[tuple[int, Any, str | None]], config: DataConfig
) -> tuple[Iterator[tuple[int, Any, str | None]], str, str]:
    """(the same rows, the schema to read them with, why). A reasoning_gym source has its own; auto
    looks at the first row that is an object."""
    if reasoning_gym.is_source(config.path):
        return rows, "reasoning_gym", "a reasoning-gym source"
    if config.schema != "auto":
        return rows, config.schema, "set by data.schema"
    seen = []
    for item in rows:
        seen.append(item)
        if isinstance(item[1], dict):
            break
    rows = itertools.chain(seen, rows)
    if seen and isinstance(seen[-1][1], dict) and isinstance(seen[-1][1].get("reward_model"), dict):
        return rows, "verl", "detected: the first row has a reward_model object"
    return rows, "plain", "detected: the first row has no reward_model object"


def tokenize_prompt(tokenizer, text: str, chat_template_applied: bool) -> list[int]:
    """Token ids of a prompt. A rendered chat template already holds its special tokens, so none are
    added then; a raw prompt gets the tokenizer's usual ones (a BOS, for example)."""
    return tokenizer(text, add_special_tokens=not chat_template_applied)["input_ids"]


def load_prompt_dataset(
    config: DataConfig, tokenizer=None, context_length: int | None = None, max_new_tokens: int = 0
) -> PromptDataset:
    """Read every row of config.path, keep the valid ones and record the rest (see PromptDataset.report()).

    context_length: the model's context (max_position_embeddings). A prompt that leaves less than
    max_new_tokens of it for the response is skipped and counted, like one over max_prompt_tokens.
    The tokenizer is needed for the chat template (apply_chat_template, verl rows, reasoning_gym
    sources), max_prompt_tokens and context_length. Raises only for problems with the whole dataset:
    a missing file, an unknown format, a Hugging Face dataset that cannot be loaded, a bad
    reasoning-gym source, a missing tokenizer, or no valid row.
    """
    if (config.apply_chat_template or config.max_prompt_tokens or context_length is not None) and tokenizer is None:
        raise ValueError("apply_chat_template, max_prompt_tokens and context_length need a tokenizer")
    rows, line_numbered = open_rows(config)
    rows, schema, why = _detect_schema(rows, config)
    render = config.apply_chat_template or schema in ("verl", "reasoning_gym")
    if render and tokenizer is None:
        raise ValueError(f"prompt dataset {config.path}: {schema} rows are chat messages, which need a tokenizer")
    if render and not getattr(tokenizer, "chat_template", None):
        setting = "apply_chat_template is set" if config.apply_chat_template else f"{schema} rows are chat messages"
        raise ValueError(f"prompt dataset {config.path}: {setting}, but the tokenizer has no chat template")
    logger.info("prompt dataset %s: schema %s (%s)", config.path, schema, why)
    path = config.path
    dataset = PromptDataset(examples=[], chat_template_applied=render, schema=schema, schema_reason=why)

    for row_number, row, problem in rows:
        location = _location(path, row_number, line_numbered)
        prompt, reference = "", None
        if problem is None:
            if schema != "reasoning_gym":  # its entries go to the task's scorer exactly as made
                row = _plain(row)
            prompt, reference, problem = _parse_row(row, config, tokenizer, schema, render)
        if problem is not None:
            dataset.malformed.append(MalformedRow(path, row_number, problem, line_numbered))
            continue
        prompt_ids = None
        if config.max_prompt_tokens is not None or context_length is not None:
            prompt_ids = tokenize_prompt(tokenizer, prompt, render)
            if (problem := _length_problem(len(prompt_ids), config, context_length, max_new_tokens)) is not None:
                dataset.too_long.append(MalformedRow(path, row_number, problem, line_numbered))
                continue
        source = row.get("data_source") if isinstance(row.get("data_source"), str) else ""
        dataset.examples.append(
            PromptExample(prompt, reference, location, prompt_ids, row, source, row.get("extra_info"))
        )

    if dataset.malformed or dataset.too_long:
        logger.warning("prompt dataset %s: %s", path, dataset.report())
    if not dataset.examples:
        raise ValueError(f"prompt dataset {path} has no usable rows: {dataset.report()}")
    return dataset


def _length_problem(num_tokens: int, config: DataConfig, context_length: int | None, max_new_tokens: int) -> str | None:
    if config.max_prompt_tokens is not None and num_tokens > config.max_prompt_tokens:
        return f"prompt has {num_tokens} tokens > max_prompt_tokens={config.max_prompt_tokens}"
    if context_length is not None and num_tokens + max_new_tokens > context_length:
        return (
            f"prompt has {num_tokens} tokens; with {max_new_tokens} new tokens that is more than the "
            f"model's context of {context_length}"
        )
    return None


def _fields(config: DataConfig, schema: str) -> tuple[str, str | None]:
    """(prompt field, reference field) of a row read with `schema`."""
    if schema == "verl":
        return VERL_FIELDS
    if schema == "reasoning_gym":
        return "prompt", "entry"
    return config.prompt_field, config.answer_field


def _parse_row(row: Any, config: DataConfig, tokenizer, schema: str, render: bool) -> tuple[str, Any, str | None]:
    """(prompt text, reference, None) or ("", None, why the row is malformed). render: apply the chat template."""
    if not isinstance(row, dict):
        return "", None, f"row is a JSON {type(row).__name__}, not an object"
    prompt_field, answer_field = _fields(config, schema)
    prompt = _get_field(row, prompt_field)
    if prompt is None:
        return "", None, f"missing field {prompt_field!r}"
    reference = None
    if answer_field is not None:
        reference = _get_field(row, answer_field)
        if reference is None:
            return "", None, f"missing field {answer_field!r}"
        if not isinstance(reference, (str, int, float, list, dict)) or isinstance(reference, bool):
            return "", None, f"field {answer_field!r} is {type(reference).__name__}, expected a string or number"
    if isinstance(prompt, str) and schema == "verl":  # verl's rows hold a chat, as verl itself requires
        return "", None, f"field {prompt_field!r} is a string; a verl row's prompt is a message list"
    if isinstance(prompt, str):
        if not prompt.strip():
            return "", None, f"field {prompt_field!r} is empty"
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if (problem := _check_messages(prompt)) is not None:
            return "", None, f"field {prompt_field!r} {problem}"
        if not render:
            return "", None, f"field {prompt_field!r} is a message list; set apply_chat_template"
        messages = list(prompt)
    else:
        return "", None, f"field {prompt_field!r} is {type(prompt).__name__}, expected a string or message list"
    if not render:
        return prompt, reference, None
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a row the template rejects is a malformed row
        return "", None, f"chat template failed: {type(exc).__name__}: {exc}"
    return text, reference, None
