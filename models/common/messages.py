"""What the renderers of several families share: the checks on the messages they are given, the
chat templates' `tojson`, and the reading of a sampled turn's ids."""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")


def to_json(value: Any) -> str:
    """The chat templates' `tojson` filter as transformers defines it (non-ASCII kept, default separators)."""
    return json.dumps(value, ensure_ascii=False)


def check_messages(renderer_name: str, messages: list, roles: tuple[str, ...] = ROLES) -> None:
    """Each message is a dict with a known role and string content; an assistant's tool calls carry a
    function name and arguments as a dict. An error names the message and what is wrong."""
    if not isinstance(messages, list):
        raise TypeError(f"renderer {renderer_name!r}: messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        where = f"renderer {renderer_name!r}: message {index}"
        if not isinstance(message, dict):
            raise TypeError(f"{where} is a {type(message).__name__}, not a dict")
        role = message.get("role")
        if role not in roles:
            raise ValueError(f"{where} has role {role!r}; this format takes {list(roles)}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where} ({role}) needs string content, got {type(message.get('content')).__name__}")
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"{where}: reasoning_content must be a string, got {type(reasoning).__name__}")
        for number, call in enumerate(message.get("tool_calls") or [], 1):
            function = call.get("function", call) if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError(f"{where}: tool call {number} has no function name")
            if not isinstance(function.get("arguments"), dict):
                raise ValueError(
                    f"{where}: tool call {number} ({function['name']}) needs arguments as a dict, "
                    f"got {type(function.get('arguments')).__name__}"
                )


def tool_call_functions(message: dict) -> list[dict]:
    """An assistant message's tool calls as {"name", "arguments"} (the OpenAI wrapper unwrapped)."""
    return [call.get("function", call) for call in message.get("tool_calls") or []]


def check_turn_closed(renderer, sampled_ids: list[int]) -> None:
    """bridge() follows a finished turn: its last id must be one of the renderer's stop tokens."""
    if not sampled_ids or sampled_ids[-1] not in renderer.stop_token_ids:
        last = sampled_ids[-1] if sampled_ids else None
        raise ValueError(
            f"renderer {renderer.name!r}: bridge() needs a turn that ended with a stop token "
            f"{list(renderer.stop_token_ids)}; this one ends with {last!r} (a truncated turn cannot be continued)"
        )


def turn_text(renderer, sampled_ids: list[int]) -> str:
    """The sampled turn as text, without the stop token that ended it."""
    if sampled_ids and sampled_ids[-1] in renderer.stop_token_ids:
        sampled_ids = sampled_ids[:-1]
    return renderer.decode(sampled_ids)
