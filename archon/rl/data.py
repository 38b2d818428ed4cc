"""Prompt datasets for RL: JSONL, Parquet or a local HF `datasets` directory, and a resumable batch iterator.

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
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

logger = logging.getLogger(__name__)

MAX_REPORTED_ROWS = 10


@dataclass
class DataConfig:
    """Where the prompts come from and how batches are drawn (the recipe takes rollout.prompts_per_step
    prompts per batch)."""

    path: str = ""
    """A .jsonl file, a .parquet file, or a directory written by datasets' save_to_disk."""
    split: str = "train"
    """The split to use when the datasets directory holds a DatasetDict."""
    prompt_field: str = "prompt"
    """Field with the prompt: a string, or a list of {role, content} chat messages. Dots reach
    into nested objects (e.g. extra.question) when no field has the dotted name itself."""
    answer_field: str | None = "answer"
    """Field with the reference answer given to the reward function; None for no references."""
    apply_chat_template: bool = False
    """Render prompts with the tokenizer's chat template (with the generation prompt appended)."""
    system_prompt: str | None = None
    """A system message put before each prompt when the chat template is applied."""
    max_prompt_tokens: int | None = None
    """Skip (and count) prompts longer than this many tokens; needs a tokenizer."""
    shuffle: bool = True
    seed: int = 0
    """Seed of the per-epoch shuffle: the same seed gives the same batches."""
    drop_last: bool = True
    """Skip an epoch's last, incomplete batch, so every batch is full."""


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
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(
            message.get("content"), str
        ):
            return f"message {i} is not a {{role: str, content: str}} object"
    return None


def _iter_jsonl(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    """(line number, row, problem) for each non-blank line. A line that is not valid UTF-8 is a
    problem row, never decoded with replacement characters."""
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            try:
                # a byte-order mark may open the file
                line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                yield line_number, None, f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at byte offset {exc.start})"
                continue
            if not line.strip():
                continue
            try:
                yield line_number, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield line_number, None, f"invalid JSON ({exc.msg} at column {exc.colno})"


def _iter_parquet(path: Path) -> Iterator[tuple[int, Any, str | None]]:
    import pyarrow.parquet as pq

    for index, row in enumerate(pq.read_table(path).to_pylist()):
        yield index, row, None


def _iter_datasets_dir(path: Path, split: str) -> Iterator[tuple[int, Any, str | None]]:
    import datasets

    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ValueError(f"{path} has splits {sorted(loaded)}, not {split!r}; set the data split")
        loaded = loaded[split]
    for index, row in enumerate(loaded):
        yield index, row, None


def _rows(path: Path, split: str) -> tuple[Iterator[tuple[int, Any, str | None]], bool]:
    if path.is_dir():
        if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"{path} is a directory but not one written by datasets' save_to_disk")
        return _iter_datasets_dir(path, split), False
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path), True
    if suffix == ".parquet":
        return _iter_parquet(path), False
    raise ValueError(f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .parquet or a datasets directory")


def data_sources_of(path: str, split: str = "train") -> set[str]:
    """The `data_source` values of a dataset's rows ("" for rows without one), read without
    tokenizing: what the reward routing is checked against before a model is loaded. Malformed
    rows are left out (loading reports them)."""
    rows, _ = _rows(Path(path), split)
    found = set()
    for _, row, problem in rows:
        if problem is None and isinstance(row, dict):
            source = row.get("data_source")
            found.add(source if isinstance(source, str) else "")
    return found


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
    The tokenizer is needed for apply_chat_template, max_prompt_tokens and context_length. Raises only
    for problems with the whole dataset: a missing file, an unknown format, a missing tokenizer, or
    no valid row.
    """
    if (config.apply_chat_template or config.max_prompt_tokens or context_length is not None) and tokenizer is None:
        raise ValueError("apply_chat_template, max_prompt_tokens and context_length need a tokenizer")
    if config.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        raise ValueError("apply_chat_template is set but the tokenizer has no chat template")
    path = Path(config.path)
    rows, line_numbered = _rows(path, config.split)
    dataset = PromptDataset(examples=[], chat_template_applied=config.apply_chat_template)

    for row_number, row, problem in rows:
        location = _location(str(path), row_number, line_numbered)
        if problem is None:
            prompt, reference, problem = _parse_row(row, config, tokenizer)
        if problem is not None:
            dataset.malformed.append(MalformedRow(str(path), row_number, problem, line_numbered))
            continue
        prompt_ids = None
        if config.max_prompt_tokens is not None or context_length is not None:
            prompt_ids = tokenize_prompt(tokenizer, prompt, config.apply_chat_template)
            if (problem := _length_problem(len(prompt_ids), config, context_length, max_new_tokens)) is not None:
                dataset.too_long.append(MalformedRow(str(path), row_number, problem, line_numbered))
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


def _parse_row(row: Any, config: DataConfig, tokenizer) -> tuple[str, Any, str | None]:
    """(prompt text, reference, None) or ("", None, why the row is malformed)."""
    if not isinstance(row, dict):
        return "", None, f"row is a JSON {type(row).__name__}, not an object"
    prompt = _get_field(row, config.prompt_field)
    if prompt is None:
        return "", None, f"missing field {config.prompt_field!r}"
    reference = None
    if config.answer_field is not None:
        reference = _get_field(row, config.answer_field)
        if reference is None:
            return "", None, f"missing field {config.answer_field!r}"
        if not isinstance(reference, (str, int, float, list, dict)) or isinstance(reference, bool):
            return "", None, f"field {config.answer_field!r} is {type(reference).__name__}, expected a string or number"
    if isinstance(prompt, str):
        if not prompt.strip():
            return "", None, f"field {config.prompt_field!r} is empty"
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        if (problem := _check_messages(prompt)) is not None:
            return "", None, f"field {config.prompt_field!r} {problem}"
        if not config.apply_chat_template:
            return "", None, f"field {config.prompt_field!r} is a message list; set apply_chat_template"
        messages = list(prompt)
    else:
        return "", None, f"field {config.prompt_field!r} is {type(prompt).__name__}, expected a string or message list"
    if not config.apply_chat_template:
        return prompt, reference, None
    if config.system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": config.system_prompt}, *messages]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # noqa: BLE001 - a row the template rejects is a malformed row
        return "", None, f"chat template failed: {type(exc).__name__}: {exc}"
    return text, reference, None


class PromptBatchIterator:
    """Endless batches of examples, reshuffled every epoch, deterministic per seed, and resumable.

    The order of epoch e depends only on (seed, e). state_dict() records the epoch and the position
    of the next batch in it; after load_state_dict() the iterator yields exactly the batches the
    original would have yielded next. With several data-parallel ranks, build the same iterator on
    every rank and have rank r take `batch[r::world_size]`.
    """

    def __init__(
        self,
        examples: Sequence[PromptExample],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if drop_last and len(examples) < batch_size:
            raise ValueError(f"{len(examples)} examples are fewer than one batch of {batch_size} (drop_last=True)")
        if not examples:
            raise ValueError("no examples to iterate over")
        self.examples = examples
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        if self.shuffle:
            random.Random(f"archon-prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    def __iter__(self) -> "PromptBatchIterator":
        return self

    def __next__(self) -> list[PromptExample]:
        remaining = len(self.examples) - self.position
        if remaining <= 0 or (self.drop_last and remaining < self.batch_size):
            self.epoch += 1
            self.position = 0
            self._order = self._epoch_order(self.epoch)
        indices = self._order[self.position : self.position + self.batch_size]
        self.position += len(indices)
        return [self.examples[i] for i in indices]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. Fails if the dataset or the batching differ from when it was saved."""
        expected = {
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }
        different = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if different:
            details = ", ".join(f"{k}: saved {saved!r}, now {now!r}" for k, (saved, now) in different.items())
            raise ValueError(f"cannot resume the prompt iterator: {details}")
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
