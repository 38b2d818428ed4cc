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
archon.rl.reasoning_gym) has its own rows: the question as a chat after a system prompt, the
reasoning-gym entry as the reference, the task as data_source.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence
from urllib.parse import parse_qsl

from archon.rl import reasoning_gym

logger = logging.getLogger(__name__)

MAX_REPORTED_ROWS = 10
SCHEMAS = ("auto", "plain", "verl")
VERL_FIELDS = ("prompt", "reward_model.ground_truth")
"""Where a verl row holds its prompt and its reference."""


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


def _hub_cache_dir(name: str) -> Path:
    """Where datasets keeps the prepared copy of Hugging Face dataset `name` (owner/name)."""
    import datasets
    from datasets.naming import camelcase_to_snakecase

    owner, repo = name.split("/")
    return Path(datasets.config.HF_DATASETS_CACHE) / f"{owner}___{camelcase_to_snakecase(repo)}"


def _open_hub(name: str, subset: str | None, split: str) -> Iterator[tuple[int, Any, str | None]]:
    """The rows of a Hugging Face dataset, through datasets.load_dataset: its cache first, the Hub
    only when online (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE make it use the cache alone)."""
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    try:
        loaded = datasets.load_dataset(name, subset, split=split)
    except (ConnectionError, FileNotFoundError, ValueError, DatasetNotFoundError) as e:
        raise ValueError(_hub_problem(name, subset, split, e)) from e
    return ((index, row, None) for index, row in enumerate(loaded))


def _hub_problem(name: str, subset: str | None, split: str, error: Exception) -> str:
    import datasets

    which = f"Hugging Face dataset {name!r}" + (f" (subset {subset!r})" if subset else "") + f", split {split!r}"
    cached = _hub_cache_dir(name)
    message = f"data path: {which} could not be loaded: {type(error).__name__}: {error}"
    if cached.is_dir():
        return message
    offline = " (offline mode is on: HF_DATASETS_OFFLINE or HF_HUB_OFFLINE)" if datasets.config.HF_HUB_OFFLINE else ""
    load = f"datasets.load_dataset({name!r}" + (f", {subset!r}" if subset else "") + ")"
    return (
        f"{message}. It is not in the local datasets cache (looked in {cached}) and the Hub could not be "
        f"reached{offline}. Download it first where the Hub can be reached, with the same HF_HOME or "
        f'HF_DATASETS_CACHE: python -c "import datasets; {load}"; or set data.path to a local '
        ".jsonl/.parquet file or save_to_disk directory (a local path that exists is always used as one)."
    )


def _plain(value: Any) -> Any:
    """The value with numpy arrays and scalars (as pandas reads Parquet back) made lists and Python numbers."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    if type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        return _plain(value.tolist())
    return value


def _iter_reasoning_gym(path: str, system_prompt: str | None) -> Iterator[tuple[int, Any, str | None]]:
    if (problem := reasoning_gym.source_problem(path)) is not None:
        raise ValueError(f"data path {path!r}: {problem}")
    source = reasoning_gym.parse_source(path)
    for index, (messages, entry) in enumerate(reasoning_gym.load_entries(source, system_prompt)):
        yield index, {"data_source": source.task, "prompt": messages, "entry": entry}, None


HUB_OPTIONS = ("subset", "split")
"""What a Hugging Face dataset name may set after a "?" (owner/name?split=test), over data.subset and data.split."""
_HUB_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def hub_name(path: str) -> tuple[str, dict[str, str]] | None:
    """(owner/name, options) when `path` names a Hugging Face dataset rather than a local file, else
    None. A name does not exist locally, has exactly one slash between two names, no file suffix
    of ours, and may end in ?subset=...&split=... (see HUB_OPTIONS; checked by data_path_problem)."""
    if not path or Path(path).exists():
        return None
    name, _, query = path.partition("?")
    if name.count("/") != 1:
        return None
    owner, repo = name.split("/")
    if not (_HUB_PART.fullmatch(owner) and _HUB_PART.fullmatch(repo)):
        return None
    if repo.lower().endswith((".jsonl", ".ndjson", ".parquet")):
        return None
    return name, dict(parse_qsl(query, keep_blank_values=True))


def _hub_options_problem(path: str) -> str | None:
    _, _, query = path.partition("?")
    try:
        pairs = parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError as e:
        return f"cannot read the options after '?': {e}"
    keys = [key for key, _ in pairs]
    unknown = sorted(set(keys) - set(HUB_OPTIONS))
    if unknown:
        return (
            f"unknown option {', '.join(map(repr, unknown))} after the dataset name (options: {', '.join(HUB_OPTIONS)})"
        )
    if len(keys) != len(set(keys)) or any(not value for _, value in pairs):
        return "each option after the dataset name is given once, with a value"
    return None


def data_path_problem(path: str) -> str | None:
    """What is wrong with a data or eval path that can be told without loading it, or None: a
    reasoning-gym source with a bad form, task or setting, a Hugging Face dataset name with bad
    options, or a local path that does not exist and is not shaped like a dataset name (whose cache
    is looked at only when loading)."""
    if reasoning_gym.is_source(path):
        return reasoning_gym.source_problem(path)
    if Path(path).exists():
        return None
    if hub_name(path) is not None:
        return _hub_options_problem(path)
    return "no such file or directory (nor a Hugging Face dataset name, owner/name)"


def _rows(config: DataConfig) -> tuple[Iterator[tuple[int, Any, str | None]], bool]:
    path = Path(config.path)
    if reasoning_gym.is_source(config.path):
        return _iter_reasoning_gym(config.path, config.system_prompt), False
    if (named := hub_name(config.path)) is not None:
        if (problem := _hub_options_problem(config.path)) is not None:
            raise ValueError(f"data path {config.path!r}: {problem}")
        name, options = named
        subset, split = options.get("subset", config.subset), options.get("split", config.split)
        return _open_hub(name, subset, split), False
    if path.is_dir():
        if not any((path / name).exists() for name in ("dataset_info.json", "state.json", "dataset_dict.json")):
            raise ValueError(f"{path} is a directory but not one written by datasets' save_to_disk")
        return _iter_datasets_dir(path, config.split), False
    if not path.exists():
        raise FileNotFoundError(f"prompt dataset {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson"):
        return _iter_jsonl(path), True
    if suffix == ".parquet":
        return _iter_parquet(path), False
    raise ValueError(f"{path}: unknown dataset format {suffix!r}; expected .jsonl, .parquet or a datasets directory")


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


def data_sources_of(config: DataConfig) -> set[str]:
    """The `data_source` values of the rows of config.path ("" for rows without one), read without
    tokenizing: what the reward routing is checked against before a model is loaded. Malformed
    rows are left out (loading reports them)."""
    rows, _ = _rows(config)
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
    The tokenizer is needed for the chat template (apply_chat_template, verl rows, reasoning_gym
    sources), max_prompt_tokens and context_length. Raises only for problems with the whole dataset:
    a missing file, an unknown format, a Hugging Face dataset that cannot be loaded, a bad
    reasoning-gym source, a missing tokenizer, or no valid row.
    """
    if (config.apply_chat_template or config.max_prompt_tokens or context_length is not None) and tokenizer is None:
        raise ValueError("apply_chat_template, max_prompt_tokens and context_length need a tokenizer")
    rows, line_numbered = _rows(config)
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
