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
"""

from __future__ import annotations

import inspect
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


class Renderer:
    """One family's chat format over a tokenizer that has the family's special tokens.

    Subclasses set `name` and implement `render_prompt`, `stop_token_ids`, `parse_turn` and `bridge`.
    """

    name: ClassVar[str]

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    # ---- helpers for subclasses -----------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """text -> ids with the tokenizer, special-token strings in `text` becoming their ids."""
        return list(self.tokenizer.encode(text, add_special_tokens=False))

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
