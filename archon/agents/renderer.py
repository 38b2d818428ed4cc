"""Renderers: a family's chat format, on token ids.

A renderer turns a conversation (HF chat-template messages, with tools) into the token ids the
model is prompted with, reads the model's sampled turn back into a message (its text, its reasoning
and its tool calls, in the family's own tool-call syntax), and renders what an environment adds
after a sampled turn without touching the sampled tokens:

    renderer = get_renderer("qwen3", tokenizer)
    prompt_ids = renderer.render_prompt(messages, tools=[tool.schema() for tool in tools])
    ... the model samples turn_ids, ending with one of renderer.stop_token_ids ...
    turn = renderer.parse_turn(turn_ids)                 # AssistantTurn: content, reasoning, tool_calls
    next_ids = renderer.bridge(turn_ids, tool_messages)  # the turn's closing, the new messages, the
                                                         # next assistant header
    trajectory = prompt_ids + turn_ids + next_ids + ...  # the model is prompted with this, verbatim

Why not re-apply the chat template to the whole conversation each turn: decoding the sampled ids
and tokenizing the text again does not always give the same ids (a merge across a boundary, a
whitespace the template trims, reasoning the template drops from earlier turns), and a trajectory
trained on other ids than were sampled has wrong importance ratios. Here the sampled ids are never
re-tokenized; only the environment's messages are rendered, and `bridge` writes exactly what the
family's template puts between an assistant turn and the next one.

Families register their renderers from `models/<family>/renderer.py` (by name) and name the one
of each HF model_type in their ModelSpec (`renderers`).

Untrusted text is encoded as plain text: a special token's string inside the content of a tool
result, or of any message an environment adds (`bridge`), becomes ordinary tokens, never the special
token, so a tool result holding `<|im_end|>\n<|im_start|>system` cannot open a turn of its own. The
base class does this for every family: it marks those strings in the messages before the family's
`render_prompt` or `bridge` writes its text, and `encode` encodes what is marked without special
tokens (content without a special token's string is encoded exactly as before).
"""

from __future__ import annotations

import functools
import inspect
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from archon.spec import _load_families, get_spec

Message = dict[str, Any]
"""A chat message as HF chat templates take it: {"role", "content"} and, for an assistant,
"reasoning_content" and "tool_calls" ([{"type": "function", "function": {"name", "arguments"}}],
arguments a dict), for a tool result "tool_call_id" / "name"."""


@dataclass
class ToolCall:
    """A call the model made: the tool's name and its arguments (an object, or the JSON text of one
    as the model wrote it)."""

    name: str
    arguments: dict[str, Any] | str
    id: str | None = None


@dataclass
class AssistantTurn:
    """The model's sampled turn, read back. parse_error says what was malformed (an unclosed or
    unparsable tool call); the calls that did parse are kept."""

    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    parse_error: str | None = None

    def message(self) -> Message:
        """The turn as an assistant message (the form environments and chat templates take)."""
        message: Message = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            message["reasoning_content"] = self.reasoning
        if self.tool_calls:
            message["tool_calls"] = [
                {"type": "function", "id": call.id, "function": {"name": call.name, "arguments": call.arguments}}
                if call.id is not None
                else {"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                for call in self.tool_calls
            ]
        return message


# A special token's string in untrusted content is written between these markers; the nonce keeps
# content from forging them.
_NONCE = secrets.token_hex(8)
_PLAIN_OPEN, _PLAIN_CLOSE = f"\ue000{_NONCE}\ue001", f"\ue000{_NONCE}\ue002"
_PLAIN_SPAN = re.compile(re.escape(_PLAIN_OPEN) + "(.*?)" + re.escape(_PLAIN_CLOSE), re.DOTALL)
_rendering = threading.local()
"""`active` while a render_prompt or bridge call marks its messages (a nested call marks nothing)."""


def _with_plain_text(method, roles_of):
    """`method` (a render_prompt or bridge taking `messages`), its messages' untrusted content
    marked first: the content of the messages whose role is in roles_of(renderer)."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def marked(self, *args, **kwargs):
        if getattr(_rendering, "active", False):
            return method(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs)
        roles = roles_of(self)
        if roles and isinstance(bound.arguments.get("messages"), list):
            bound.arguments["messages"] = self.plain_text_messages(bound.arguments["messages"], roles)
        _rendering.active = True
        try:
            return method(*bound.args, **bound.kwargs)
        finally:
            _rendering.active = False

    return marked


ALL_ROLES = ("system", "user", "assistant", "tool")


class Renderer:
    """One family's chat format over a tokenizer that has the family's special tokens.

    Subclasses set `name` and implement `render_prompt`, `stop_token_ids`, `parse_turn` and `bridge`
    (writing the text and encoding it with `encode`); the base class wraps their `render_prompt`
    and `bridge` so that untrusted content is encoded as plain text (see the module docstring).
    """

    name: ClassVar[str]

    plain_text_roles: tuple[str, ...] = ("tool",)
    """The roles whose content render_prompt encodes as plain text (tool results by default; () turns
    it off, ALL_ROLES makes every message plain text). Settable per renderer."""
    plain_text_environment: bool = True
    """Whether bridge encodes the messages it adds (an environment's tool results and user turns) as
    plain text. Settable per renderer."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if "render_prompt" in cls.__dict__:
            cls.render_prompt = _with_plain_text(cls.__dict__["render_prompt"], lambda self: self.plain_text_roles)
        if "bridge" in cls.__dict__:
            cls.bridge = _with_plain_text(
                cls.__dict__["bridge"], lambda self: ALL_ROLES if self.plain_text_environment else ()
            )

    # ---- untrusted text ---------------------------------------------------------------------------
    @functools.cached_property
    def _special_strings(self) -> re.Pattern | None:
        """A pattern of the tokenizer's added tokens' strings (special tokens and others it matches
        whole), longest first; None when it has none."""
        added = sorted((t for t in getattr(self.tokenizer, "get_added_vocab", dict)() if t), key=len, reverse=True)
        return re.compile("|".join(re.escape(token) for token in added)) if added else None

    def plain_text(self, text: str) -> str:
        """`text` with every special token's string in it marked, for `encode` to encode as plain text."""
        pattern = self._special_strings
        if pattern is None or not isinstance(text, str):
            return text
        return pattern.sub(lambda match: _PLAIN_OPEN + match.group(0) + _PLAIN_CLOSE, text)

    def plain_text_messages(self, messages: list[Message], roles) -> list[Message]:
        """Copies of the messages whose role is in `roles`, their content (a string, or text parts)
        marked as plain text; the other messages as they are."""
        marked = []
        for message in messages:
            if not isinstance(message, dict) or message.get("role") not in roles:
                marked.append(message)
                continue
            content = message.get("content")
            if isinstance(content, str):
                content = self.plain_text(content)
            elif isinstance(content, list):
                content = [
                    {**part, "text": self.plain_text(part["text"])}
                    if isinstance(part, dict) and isinstance(part.get("text"), str)
                    else self.plain_text(part)
                    for part in content
                ]
            marked.append({**message, "content": content})
        return marked

    def encode_plain(self, text: str) -> list[int]:
        """text -> ids with no special token: each special token's string is encoded as its first
        character, then the rest (itself read the same way)."""
        pattern, ids, start = self._special_strings, [], 0
        for match in pattern.finditer(text) if pattern is not None else ():
            ids += self._encode_text(text[start : match.start()])
            ids += self._encode_text(match.group(0)[:1]) + self.encode_plain(match.group(0)[1:])
            start = match.end()
        return ids + self._encode_text(text[start:])

    def _encode_text(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    # ---- helpers for subclasses -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """text -> ids with the tokenizer, special-token strings in `text` becoming their ids, except
        those marked as plain text (`plain_text`), which become ordinary tokens."""
        if _PLAIN_OPEN not in text:
            return self._encode_text(text)
        ids, start = [], 0
        for match in _PLAIN_SPAN.finditer(text):
            ids += self._encode_text(text[start : match.start()]) + self.encode_plain(match.group(1))
            start = match.end()
        return ids + self._encode_text(text[start:])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int:
        """The id of a special token the format needs; an error naming it when the tokenizer lacks it."""
        ids = self.encode(token)
        if len(ids) != 1:
            raise ValueError(
                f"renderer {self.name!r}: the tokenizer has no single token for {token!r} (it encodes to {ids}); "
                f"use the family's tokenizer, or add {token!r} as a special token"
            )
        return ids[0]

    # ---- the format ---------------------------------------------------------------------------------
    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The conversation (with the tools offered, OpenAI function-tool schemas) and the opening of
        the assistant turn the model samples next, as its chat template renders them."""
        raise NotImplementedError

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The tokens that end an assistant turn."""
        raise NotImplementedError

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        """The sampled turn (up to and including its stop token, if it reached one) read back."""
        raise NotImplementedError

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        """The ids that follow a sampled turn that ended with a stop token: whatever the template
        writes after that turn's stop token, `messages` (tool results, user turns) as it renders them,
        then the opening of the next assistant turn."""
        raise NotImplementedError


_RENDERERS: dict[str, type[Renderer]] = {}


def register_renderer(cls: type[Renderer]) -> type[Renderer]:
    """Class decorator: make `cls` available as get_renderer(cls.name, ...)."""
    existing = _RENDERERS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ValueError(
            f"renderer {cls.name!r} is already registered by {existing.__module__}.{existing.__qualname__}"
        )
    _RENDERERS[cls.name] = cls
    return cls


def renderer_names() -> list[str]:

    _load_families()
    return sorted(_RENDERERS)


def get_renderer(name: str, tokenizer, **options) -> Renderer:
    """The renderer registered as `name`, on `tokenizer`; options go to its constructor (e.g.
    enable_thinking for the families that have a thinking switch)."""
    names = renderer_names()
    if name not in _RENDERERS:
        raise ValueError(f"unknown renderer {name!r}; registered renderers: {names}")
    accepted = inspect.signature(_RENDERERS[name].__init__).parameters
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"renderer {name!r} has no option {unknown[0]!r}; "
            f"its options: {sorted(set(accepted) - {'self', 'tokenizer'})}"
        )
    return _RENDERERS[name](tokenizer, **options)


def default_renderer_name(model_type: str) -> str:
    """The renderer a family names for an HF model_type (ModelSpec.renderers)."""

    spec = get_spec(model_type)
    if model_type not in spec.renderers:
        raise ValueError(
            f"family {spec.name!r} names no renderer for model_type {model_type!r}; set the environment's "
            f"renderer to one of {renderer_names()}"
        )
    return spec.renderers[model_type]
