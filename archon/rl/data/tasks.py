"""A synthetic task for the demo and the tests: multi-digit arithmetic, and a character-level tokenizer.

    train, held_out = arithmetic_splits(ArithmeticTaskConfig(max_digits=2))
    write_jsonl(train, "train.jsonl")          # rows {"prompt": "12+34=", "answer": "46", "operation": "+"}
    tokenizer = build_char_tokenizer()         # a real HF tokenizer; save_pretrained() works

Every problem appears once; the held-out split shares no problem with the training split. The
tokenizer has one token per character and a short chat template, so a tiny Qwen3-architecture
model can be trained on the task with no downloads.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

OPERATIONS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


@dataclass
class ArithmeticTaskConfig:
    """Random problems `a op b` with operands of min_digits..max_digits digits."""

    operations: tuple[str, ...] = ("+", "-", "*")
    """Any of +, - and *."""
    min_digits: int = 1
    max_digits: int = 2
    num_train: int = 2000
    num_held_out: int = 200
    seed: int = 0
    prompt_format: str = "{a}{op}{b}="
    """How a problem is written; fields a, op and b."""

    def __post_init__(self) -> None:
        if isinstance(self.operations, list):
            self.operations = tuple(self.operations)
        unknown = [op for op in self.operations if op not in OPERATIONS]
        if unknown or not self.operations:
            raise ValueError(
                f"operations must be a non-empty subset of {list(OPERATIONS)}, got {list(self.operations)}"
            )
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.num_train < 0 or self.num_held_out < 0:
            raise ValueError("num_train and num_held_out must be >= 0")


def _digit_range(digits: int) -> tuple[int, int]:
    return (0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def num_distinct_problems(config: ArithmeticTaskConfig) -> int:
    operands = sum(hi - lo + 1 for lo, hi in map(_digit_range, range(config.min_digits, config.max_digits + 1)))
    return operands * operands * len(config.operations)


def _random_operand(rng: random.Random, config: ArithmeticTaskConfig) -> int:
    # Pick the digit count first, so short operands are as common as long ones.
    lo, hi = _digit_range(rng.randint(config.min_digits, config.max_digits))
    return rng.randint(lo, hi)


def _row(config: ArithmeticTaskConfig, a: int, op: str, b: int) -> dict[str, str]:
    prompt = config.prompt_format.format(a=a, op=op, b=b)
    return {"prompt": prompt, "answer": str(OPERATIONS[op](a, b)), "operation": op}


def arithmetic_splits(config: ArithmeticTaskConfig) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """(train, held_out): rows {"prompt", "answer", "operation"}, distinct problems, deterministic per seed.

    The held-out problems are drawn first, so they do not change with num_train.
    """
    total = config.num_train + config.num_held_out
    available = num_distinct_problems(config)
    if total > available:
        raise ValueError(f"{total} problems requested but only {available} distinct ones exist for {config}")
    rng = random.Random(f"archon-arithmetic:{config.seed}")
    problems: dict[tuple[int, str, int], None] = {}  # insertion-ordered set
    if total * 2 > available:
        digit_counts = range(config.min_digits, config.max_digits + 1)
        operands = [n for d in digit_counts for n in range(_digit_range(d)[0], _digit_range(d)[1] + 1)]
        every = [(a, op, b) for a in operands for op in config.operations for b in operands]
        rng.shuffle(every)
        problems = dict.fromkeys(every[:total])
    else:
        while len(problems) < total:
            key = (_random_operand(rng, config), rng.choice(config.operations), _random_operand(rng, config))
            problems.setdefault(key, None)
    ordered = [_row(config, *key) for key in problems]
    return ordered[config.num_held_out :], ordered[: config.num_held_out]


def write_jsonl(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSON Lines (the format `archon.rl.data` reads)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


PAD_TOKEN = "<|pad|>"
UNK_TOKEN = "<|unk|>"
END_TOKEN = "<|end|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD_TOKEN, UNK_TOKEN, END_TOKEN, *ROLE_TOKENS.values()]
CHARACTERS = "\n\t" + "".join(chr(c) for c in range(32, 127))

# <|user|>12+34=<|end|><|assistant|>46<|end|> ; roles other than system/user/assistant are rejected.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported role: ' + message['role']) }}"
    "{%- endif -%}"
    "<|{{ message['role'] }}|>{{ message['content'] }}<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def build_char_tokenizer(extra_characters: str = ""):
    """A character-level HF tokenizer (PreTrainedTokenizerFast) with a chat template.

    Vocabulary: the special tokens <|pad|> (pad), <|unk|> (unk), <|end|> (eos, ends every chat turn),
    <|system|>, <|user|>, <|assistant|>, then newline, tab, printable ASCII and extra_characters,
    one token each. Any other character encodes to <|unk|>. save_pretrained() writes a directory that
    AutoTokenizer loads.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    characters = list(dict.fromkeys(CHARACTERS + extra_characters))
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + characters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=UNK_TOKEN))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        eos_token=END_TOKEN,
        chat_template=CHAT_TEMPLATE,
        padding_side="left",
    )
