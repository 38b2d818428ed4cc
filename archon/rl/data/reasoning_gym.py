"""reasoning-gym tasks as a prompt source (`data.path: reasoning_gym:<task>?size=N&seed=S&...`) and
their own scorers as the `reasoning_gym` reward function.

    spec = parse_source("reasoning_gym:chain_sum?size=200&seed=1000&max_terms=3")
    for messages, entry in load_entries(spec, system_prompt=None): ...
    reasoning_gym_reward(prompt, "<answer>7</answer>", entry)   # the task's score_answer, a float in [0, 1]

A source names a task and its settings: `size` (entries, default 1000), `seed` (default 0) and any
field of the task's config dataclass (`max_terms=3`; values are read as JSON when they parse, so
`3` is an int and `[1, 2]` a list, else kept as strings). reasoning-gym makes entry i from the
random seed `seed + i`, so two sources of the same task and settings share no entry when their
ranges [seed, seed + size) do not overlap: a held-out set at `seed` = train seed + train size.

Each entry becomes a chat with a system message (reasoning-gym's own default instruction, which
asks for the final answer inside <answer> </answer> tags, unless one is configured) and the
question as the user message. The reference is the entry (question, answer, metadata) plus the key
`reasoning_gym` = {"task", "config"} so the scorer rebuilds the dataset exactly as it was made (some
scorers read the task's settings). This module does not import torch: reward workers load it.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl

SOURCE_PREFIX = "reasoning_gym:"
DEFAULT_SIZE = 1000
DEFAULT_SEED = 0
MAX_SIZE = 1_000_000
"""The most entries one source makes: they are generated, rendered and tokenized in memory when the
run starts (about a kilobyte each), so a million is a gigabyte; 100 million ran out of memory. A
run of 10,000 steps of 32 prompts draws 320,000."""
MAX_SEED = 2**63 - 1
REFERENCE_KEY = "reasoning_gym"
"""The reference's key holding the task name and the settings the entry was made with."""


@dataclass(frozen=True)
class ReasoningGymSource:
    task: str
    size: int = DEFAULT_SIZE
    seed: int = DEFAULT_SEED
    settings: dict[str, Any] = field(default_factory=dict)
    """The task config's own fields (everything in the query but size and seed)."""

    def indices(self) -> range:
        """The random seeds of its entries (entry i is made from seed + i)."""
        return range(self.seed, self.seed + self.size)

    def config(self) -> dict[str, Any]:
        """Keyword arguments of reasoning_gym.create_dataset (besides the task name)."""
        return {**self.settings, "size": self.size, "seed": self.seed}


def is_source(path: str | None) -> bool:
    return bool(path) and path.startswith(SOURCE_PREFIX)


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_source(path: str) -> ReasoningGymSource:
    """`reasoning_gym:<task>[?key=value&...]` -> the source. Checks the form only (see source_problem)."""
    if not is_source(path):
        raise ValueError("not a reasoning-gym source (reasoning_gym:<task>?size=N&seed=S)")
    body = path[len(SOURCE_PREFIX) :]
    task, _, query = body.partition("?")
    if not task:
        raise ValueError("names no task: write reasoning_gym:<task>, e.g. reasoning_gym:chain_sum")
    settings = {}
    for key, text in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if key in settings:
            raise ValueError(f"setting {key!r} is given twice")
        settings[key] = _value(text)
    size, seed = settings.pop("size", DEFAULT_SIZE), settings.pop("seed", DEFAULT_SEED)
    for name, value, low, high in (("size", size, 1, MAX_SIZE), ("seed", seed, 0, MAX_SEED - MAX_SIZE)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name}={value!r} must be an integer >= {low}")
        if value > high:
            raise ValueError(f"{name}={value!r} must be at most {high}")
    return ReasoningGymSource(task, size, seed, settings)


def reasoning_gym_overlap(train_path: str, eval_path: str) -> str | None:
    """Why a held-out reasoning-gym source shares entries with the training one (the same task and
    settings, and overlapping seed ranges), or None."""
    if not (is_source(train_path) and is_source(eval_path)):
        return None
    try:
        train, held_out = parse_source(train_path), parse_source(eval_path)
    except ValueError:
        return None  # reported as a bad source
    if train.task != held_out.task or train.settings != held_out.settings:
        return None
    shared = range(max(train.seed, held_out.seed), min(train.indices().stop, held_out.indices().stop))
    if not shared:
        return None
    return (
        f"its entries are made from seeds {held_out.indices().start}..{held_out.indices().stop - 1} and the "
        f"training set's (data.path={train_path!r}) from {train.indices().start}..{train.indices().stop - 1}: "
        f"{len(shared)} held-out entries would be training entries (reasoning-gym makes entry i from seed + i); "
        f"use seed={train.indices().stop} or more"
    )


def _registry() -> dict[str, tuple[type, type]]:
    try:
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ImportError(
            "reasoning_gym sources and rewards need the reasoning-gym package: pip install 'archon[reasoning-gym]'"
        ) from e
    return DATASETS


def task_problem(task: str) -> str | None:
    """Why `task` is not a reasoning-gym task (with the closest names), or None."""
    registry = _registry()
    if task in registry:
        return None
    close = difflib.get_close_matches(task, list(registry), n=5, cutoff=0.6)
    hint = f"close matches: {', '.join(close)}" if close else "no close match"
    return (
        f"reasoning-gym has no task {task!r} ({hint}; all {len(registry)} tasks: "
        "python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))')"
    )


def source_problem(path: str) -> str | None:
    """What is wrong with the reasoning-gym source `path` (its form, the task name, a setting the
    task's config lacks), or None. Makes no entries."""
    try:
        source = parse_source(path)
    except (ValueError, ImportError) as e:
        return str(e)
    try:
        if (problem := task_problem(source.task)) is not None:
            return problem
    except ImportError as e:
        return str(e)
    _, config_cls = _registry()[source.task]
    known = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(source.settings) - known)
    if unknown:
        settable = sorted(known - {"size", "seed"})
        return (
            f"task {source.task!r} has no setting {', '.join(map(repr, unknown))} (its settings: {', '.join(settable)})"
        )
    return None


def _create(task: str, config: dict[str, Any]):
    import reasoning_gym

    if (problem := task_problem(task)) is not None:
        raise ValueError(problem)
    try:
        return reasoning_gym.create_dataset(task, **config)
    except (TypeError, ValueError, AssertionError) as e:
        raise ValueError(f"reasoning-gym task {task!r} rejected its settings {config}: {type(e).__name__}: {e}") from e


def default_system_prompt() -> str:
    """reasoning-gym's own instruction: think step by step, then the answer inside <answer> </answer>."""
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def load_entries(source: ReasoningGymSource, system_prompt: str | None) -> list[tuple[list[dict], dict]]:
    """(chat messages, reference) for each entry of the source, in order. system_prompt: None for
    reasoning-gym's default instruction."""
    dataset = _create(source.task, source.config())
    system = default_system_prompt() if system_prompt is None else system_prompt
    made_with = {"task": source.task, "config": source.config()}
    entries = []
    for index in range(source.size):
        entry = dataset[index]
        messages = [{"role": "system", "content": system}, {"role": "user", "content": entry["question"]}]
        entries.append((messages, {**entry, REFERENCE_KEY: made_with}))
    return entries


@functools.lru_cache(maxsize=64)
def _scoring_dataset(task: str, config_json: str):
    return _create(task, json.loads(config_json))


def extract_answer(completion: str) -> str | None:
    """The last <answer>...</answer> of the completion, as reasoning-gym's prompt asks for it and its
    own extract_answer reads it (None when there is none)."""
    from reasoning_gym.utils import extract_answer as rg_extract_answer

    return rg_extract_answer(completion, tag_name="answer", strip=True)


def reasoning_gym_reward(prompt: str, completion: str, reference: Any) -> float:
    """The task's own score_answer of the completion's <answer> (0.0 when it has none).

    reference: an entry from a reasoning_gym source (or any reasoning-gym entry, whose
    metadata.source_dataset names the task; it is then scored with the task's default settings).
    """
    if not isinstance(reference, dict) or "answer" not in reference:
        raise ValueError(
            f"the reasoning_gym reward needs a reasoning-gym entry as the reference, got {type(reference).__name__}"
        )
    entry = {key: value for key, value in reference.items() if key != REFERENCE_KEY}
    made_with = reference.get(REFERENCE_KEY)
    if isinstance(made_with, dict):
        task, config = made_with["task"], made_with["config"]
    else:
        task = (entry.get("metadata") or {}).get("source_dataset")
        if not isinstance(task, str):
            raise ValueError("the reference names no reasoning-gym task (no metadata.source_dataset)")
        config = {}
    dataset = _scoring_dataset(task, json.dumps(config, sort_keys=True))
    return float(dataset.score_answer(extract_answer(completion), entry))
