"""Pieces the families' renderers (archon.agents.renderer) share: reading HF chat messages the way
chat templates read them, JSON as the templates' `tojson` writes it, and the checks on a sampled turn."""

from __future__ import annotations

import json

from archon.agents.renderer import Message
from archon.agents.tools import ToolCall


def template_json(value) -> str:
    """`value | tojson` in an HF chat template: json.dumps with ensure_ascii=False, default separators."""
    return json.dumps(value, ensure_ascii=False)


def message_role(message: Message, index: int) -> str:
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"message {index} is not a chat message with a 'role': {message!r}")
    return message["role"]


def message_text(message: Message, index: int) -> str:
    """A message's content as text: a string, None (no text), or a list of {"type": "text"} parts."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"message {index} ({message.get('role')}): content part {part!r} is not text")
        return "".join(parts)
    raise ValueError(f"message {index} ({message.get('role')}): content must be a string or text parts, not {content!r}")


def message_reasoning(message: Message) -> str | None:
    """An assistant message's reasoning: "reasoning_content" (the contract's name), else "thinking"."""
    reasoning = message.get("reasoning_content", message.get("thinking"))
    return reasoning if isinstance(reasoning, str) else None


def message_tool_calls(message: Message, index: int) -> list[ToolCall]:
    """An assistant message's tool calls, arguments as a dict (a JSON object string is read)."""
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"message {index}: tool call {j} has no function name: {call!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(f"message {index}: tool call {j} ({function['name']}): arguments are not JSON: {e}") from e
        if not isinstance(arguments, dict):
            raise ValueError(f"message {index}: tool call {j} ({function['name']}): arguments must be an object, not {arguments!r}")
        calls.append(ToolCall(function["name"], arguments, call.get("id")))
    return calls


def parse_arguments(text: str, name: str) -> tuple[dict | None, str | None]:
    """A tool call's JSON arguments: (the object, None), or (None, what is wrong)."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"tool call {name!r}: arguments are not valid JSON ({e}): {text!r}"
    if not isinstance(arguments, dict):
        return None, f"tool call {name!r}: arguments must be a JSON object, not {type(arguments).__name__}: {text!r}"
    return arguments, None


def split_stop(renderer, sampled_ids: list[int]) -> tuple[list[int], int | None]:
    """The sampled turn without its stop token, and the stop token (None when it reached none)."""
    if sampled_ids and sampled_ids[-1] in renderer.stop_token_ids:
        return list(sampled_ids[:-1]), sampled_ids[-1]
    return list(sampled_ids), None


def require_stop(renderer, sampled_ids: list[int]) -> int:
    """The stop token a bridged turn must end with; an error naming the ones allowed otherwise."""
    _, stop = split_stop(renderer, sampled_ids)
    if stop is None:
        last = sampled_ids[-1] if sampled_ids else None
        raise ValueError(
            f"renderer {renderer.name!r}: a turn is bridged only after it ended with a stop token "
            f"{list(renderer.stop_token_ids)}; this one ends with {last!r}"
        )
    return stop
