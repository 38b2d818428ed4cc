"""What the renderer tests share: test tokenizers, generated conversations, and the episode simulation
that compares a renderer's trajectory with the family's chat template.

The families' real tokenizers are not available offline, so each test builds a byte-level BPE
tokenizer with the family's special tokens as single tokens and merges trained on text like the
conversations it renders: a newline merges with what follows, a space with the next word, as in the
real tokenizers, so the boundaries where re-tokenization differs from the sampled ids exist here too.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer
from transformers import PreTrainedTokenizerFast

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"

# The split the Qwen2/Qwen3 and Llama 3 tokenizers make before their byte-level BPE: newlines run
# together (with the spaces before them), punctuation takes the newlines after it, a letter run takes
# one character before it.
PRE_TOKENIZER_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_bpe_tokenizer(special_tokens, corpus, vocab_size, chat_template=None) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer: `special_tokens` as special tokens, merges trained over `corpus`
    (an iterable of texts) up to `vocab_size`, and `chat_template` when given."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(special_tokens), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, extra_special_tokens=list(special_tokens), clean_up_tokenization_spaces=False
    )
    if chat_template is not None:
        fast.chat_template = chat_template
    return fast


def read_template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")


# ---- generated conversations ----------------------------------------------------------------------------

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web — returns the top results.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "python",
            "description": "Run Python code and return what it prints.",
            "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo d'une ville (°C).",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    },
]

_WORDS = [
    "the",
    "value",
    "is",
    "x",
    "résumé",
    "naïve",
    "日本語",
    "数据",
    "Привет",
    "🙂",
    "🚀",
    "def",
    "print(1)",
    "a+b",
    "3.14",
    "-7",
    "{",
    "}",
    "[1, 2]",
    '"quoted"',
    "back\\slash",
    "tab\there",
    "<b>",
    "a<b>c",
    "#",
    "*",
]
_SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "\n ", "\r\n", "\u00a0"]


def random_text(rng: random.Random, forbidden: tuple[str, ...], max_words: int = 12, empty_ok: bool = False) -> str:
    """Words, unicode and whitespace (newlines at either end too), never containing a `forbidden` string."""
    while True:
        n = rng.randint(0 if empty_ok else 1, max_words)
        text = "".join(rng.choice(_WORDS) + rng.choice(_SPACES) for _ in range(n))
        if n and rng.random() < 0.5:
            text = text.rstrip()
        if rng.random() < 0.2:
            text = rng.choice(_SPACES) + text
        if not any(token in text for token in forbidden):
            return text


def random_arguments(rng: random.Random, forbidden: tuple[str, ...], depth: int = 0) -> dict:
    arguments = {}
    for _ in range(rng.randint(0, 3)):
        key = rng.choice(["query", "code", "city", "limit", "days", "flag", "nested", "items", "ключ", "名前", "a b"])
        kind = rng.choice(["str", "str", "int", "float", "bool", "none", "list", "dict"])
        if kind == "str":
            value = random_text(rng, forbidden, max_words=6, empty_ok=True)
        elif kind == "int":
            value = rng.randint(-1000, 10**6)
        elif kind == "float":
            value = round(rng.uniform(-100, 100), rng.randint(0, 4))
        elif kind == "bool":
            value = rng.random() < 0.5
        elif kind == "none":
            value = None
        elif kind == "list":
            value = [random_text(rng, forbidden, max_words=2), rng.randint(0, 9)]
        else:
            value = random_arguments(rng, forbidden, depth + 1) if depth < 2 else {}
        arguments[key] = value
    return arguments


@dataclass
class Conversation:
    """A generated episode: the first messages, then per turn the assistant message and what the
    environment answered it with (empty after the last turn)."""

    first: list[dict]
    tools: list[dict] | None
    turns: list[tuple[dict, list[dict]]] = field(default_factory=list)

    def messages(self) -> list[dict]:
        messages = list(self.first)
        for assistant, environment in self.turns:
            messages += [assistant, *environment]
        return messages


def random_conversation(
    rng: random.Random,
    forbidden: tuple[str, ...],
    *,
    reasoning: bool,
    max_calls: int = 4,
    tool_roles: tuple[str, ...] = ("tool",),
    max_turns: int = 5,
    offered: list[dict] = TOOLS,
    arguments=None,
) -> Conversation:
    """An episode of 1..max_turns assistant turns with 1..max_calls tool calls each but the last, tool
    results (some errors) in one of `tool_roles`, now and then a user follow-up; reasoning on each turn
    (sometimes empty) when `reasoning`. The calls are to the `offered` tools, with arguments from
    `arguments(rng, forbidden, tool)` when given (else random_arguments, whatever the schema says)."""
    first = [{"role": "system", "content": random_text(rng, forbidden)}] if rng.random() < 0.7 else []
    first.append({"role": "user", "content": random_text(rng, forbidden)})
    tools = offered if rng.random() < 0.85 else None
    conversation = Conversation(first=first, tools=tools)
    n_turns = rng.randint(1, max_turns)
    for turn in range(n_turns):
        last = turn == n_turns - 1
        assistant = {"role": "assistant", "content": random_text(rng, forbidden, empty_ok=not last)}
        if reasoning:
            assistant["reasoning_content"] = random_text(rng, forbidden, empty_ok=True) if rng.random() < 0.9 else ""
        environment = []
        if not last and tools and rng.random() < 0.85:
            calls = []
            for _ in range(rng.randint(1, max_calls)):
                tool = rng.choice(offered)
                calls.append(
                    {
                        "type": "function",
                        "function": {
                            "name": tool["function"]["name"],
                            "arguments": arguments(rng, forbidden, tool)
                            if arguments
                            else random_arguments(rng, forbidden),
                        },
                    }
                )
            assistant["tool_calls"] = calls
            role = rng.choice(tool_roles)
            for call in calls:
                result = random_text(rng, forbidden, empty_ok=True)
                if rng.random() < 0.2:
                    result = f"Error: {call['function']['name']} failed: {result}"
                environment.append({"role": role, "content": result})
            if rng.random() < 0.3:
                environment.append({"role": "user", "content": random_text(rng, forbidden)})
        elif not last:
            environment.append({"role": "user", "content": random_text(rng, forbidden)})
        conversation.turns.append((assistant, environment))
    return conversation


# ---- the episode, simulated ----------------------------------------------------------------------------


@dataclass
class Episode:
    """A simulated episode: the renderer's trajectory and, beside it, the template's pieces.

    segments: ("prompt" | "turn" | "environment", text, ids) in order; a turn's text and ids are the
    template's rendering of that assistant message (what the model would have sampled), the others
    what the renderer produced, with the template's text for them.
    """

    conversation: Conversation
    segments: list[tuple[str, str, list[int]]]
    trajectory: list[int]
    parsed: list = field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(text for _, text, _ in self.segments)


def simulate_episode(
    renderer, tokenizer, conversation: Conversation, header: str, stops: tuple[str, ...], **template_options
) -> Episode:
    """Run `conversation` through `renderer` as an episode loop would, checking each piece against the
    chat template (`tokenizer.chat_template`; `template_options` go to it, e.g. enable_thinking).

    header: the text that opens an assistant turn (the generation prompt's start); stops: the texts of
    the stop tokens. A sampled turn is the template's text after the generation prompt, up to and
    including the first stop; the environment's text is what the template writes after that turn's stop,
    up to the next generation prompt included.
    """

    def render(messages, generation_prompt):
        return tokenizer.apply_chat_template(
            messages,
            tools=conversation.tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **template_options,
        )

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    messages = list(conversation.first)
    prompt_text = render(messages, True)
    prompt_ids = renderer.render_prompt(messages, tools=conversation.tools)
    assert prompt_ids == encode(prompt_text), "render_prompt differs from the template's tokenized prompt"
    segments = [("prompt", prompt_text, prompt_ids)]
    trajectory = list(prompt_ids)
    parsed = []
    for assistant, environment in conversation.turns:
        with_turn = render(messages + [assistant], False)
        assert with_turn.startswith(prompt_text), "the template re-rendered the prompt when a turn was added"
        sampled = with_turn[len(prompt_text) :]
        stop_at = min(sampled.find(stop) + len(stop) for stop in stops if stop in sampled)
        sampled_text = sampled[:stop_at]
        sampled_ids = encode(sampled_text)
        segments.append(("turn", sampled_text, sampled_ids))
        trajectory += sampled_ids
        parsed.append(renderer.parse_turn(sampled_ids))
        messages += [assistant]
        if not environment:
            continue
        messages += environment
        prompt_text = render(messages, True)
        generation_at = prompt_text.rfind(header)
        turn_at = prompt_text.rfind(header, 0, generation_at)
        turn_end = min(prompt_text.find(stop, turn_at) + len(stop) for stop in stops if stop in prompt_text[turn_at:])
        environment_text = prompt_text[turn_end:]
        bridged = renderer.bridge(sampled_ids, environment)
        assert bridged == encode(environment_text), (
            "bridge differs from the template's text after the turn: "
            f"{renderer.decode(bridged)!r} != {environment_text!r}"
        )
        segments.append(("environment", environment_text, bridged))
        trajectory += bridged
    return Episode(conversation=conversation, segments=segments, trajectory=trajectory, parsed=parsed)


def typed_arguments(rng: random.Random, forbidden: tuple[str, ...], tool: dict) -> dict:
    """Arguments of the types the tool's schema gives its parameters (a string, an integer, one of an
    enum's values), for formats that write a call's values as text and read them back by the schema;
    a string may read as a number or as JSON."""
    arguments = {}
    properties = tool["function"]["parameters"]["properties"]
    for key in rng.sample(sorted(properties), rng.randint(0, len(properties))):
        schema = properties[key]
        if "enum" in schema:
            arguments[key] = rng.choice(schema["enum"])
        elif schema.get("type") == "integer":
            arguments[key] = rng.randint(-1000, 10**6)
        else:
            look_alikes = ["3.14", "-7", "[1, 2]", "true", "null", '{"a": 1}']
            arguments[key] = rng.choice([random_text(rng, forbidden, max_words=6, empty_ok=True), *look_alikes])
    return arguments
