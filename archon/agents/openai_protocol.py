"""The OpenAI chat-completions protocol in the renderer's terms: a request body checked and its
messages converted to the form chat templates take (`parse_request`, `ChatRequest`), the error a
refused request gets (`OpenAIError`), a body decoded with its nesting bounded (`decode_body`), a
sampled turn as an OpenAI assistant message (`assistant_message`) and back (`template_form`), and
what two messages must share to be the same turn of a conversation (`canonical`).
The endpoint that serves it is archon.agents.openai_server.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from archon.agents.renderer import AssistantTurn, Message

ROLES = ("system", "user", "assistant", "tool")
UNSUPPORTED_WHEN_SET = {
    # field: the value that leaves it unused
    "stop": None,
    "stream": False,
    "logit_bias": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
}


class OpenAIError(Exception):
    """A request the endpoint refuses: an HTTP status, an OpenAI-style error body, and the headers
    the answer carries besides (e.g. Retry-After)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.code, self.headers = code, headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def json_depth(value, limit: int) -> int:
    """How deep parsed JSON nests (each array and object is a level), counted up to limit + 1."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if deepest > limit:
                return deepest
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def decode_body(raw: bytes, max_depth: int):
    """A request body parsed as JSON, refused (400) when it is not JSON or nests deeper than
    `max_depth` (the request's checks and copies recurse into it)."""
    too_deep = OpenAIError(
        400, f"the request body nests arrays and objects more than max_json_depth={max_depth} levels deep"
    )
    try:
        body = json.loads(raw)
    except RecursionError:  # the decoder's own bound (the interpreter's recursion limit)
        raise too_deep from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise OpenAIError(400, f"the request body is not valid JSON ({e})") from None
    if json_depth(body, max_depth) > max_depth:
        raise too_deep
    return body


@dataclass
class ChatRequest:
    """A chat-completions request, checked: the messages (in the renderer's form), the tools offered
    (None with tool_choice "none"), and what the sampling asks for."""

    messages: list[Message]
    tools: list[dict] | None
    temperature: float | None
    top_p: float | None
    max_tokens: int | None
    seed: int | None


def _number(body: dict, name: str, low: float, high: float, integer: bool = False, above_low: bool = False):
    """body[name] (None when absent) checked to be a number (an integer) in [low, high], or in
    (low, high] when above_low."""
    value = body.get(name)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    in_range = isinstance(value, kinds) and (low < value if above_low else low <= value) and value <= high
    if isinstance(value, bool) or not in_range:
        what = "an integer" if integer else "a number"
        raise OpenAIError(
            400, f"'{name}' must be {what} in {'(' if above_low else '['}{low}, {high}], got {value!r}", name
        )
    return value


def _text(content, where: str) -> str:
    """A message's content as text: a string, null, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    400,
                    f"'{where}[{j}]' is not a text part ({{'type': 'text', 'text': ...}}): only text content is served",
                    f"{where}[{j}]",
                )
            texts.append(part["text"])
        return "".join(texts)
    raise OpenAIError(
        400, f"'{where}' must be a string, a list of text parts or null, got {type(content).__name__}", where
    )


def _arguments(arguments, where: str) -> dict:
    """A tool call's arguments, a JSON object (OpenAI sends it as a string), as a dict."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise OpenAIError(400, f"'{where}' is not valid JSON ({e})", where) from None
    if not isinstance(arguments, dict):
        raise OpenAIError(400, f"'{where}' must be a JSON object, got {arguments!r}", where)
    return arguments


def _template_message(message, i: int, call_names: dict[str, str]) -> Message:
    """An OpenAI message as chat templates take it (tool-call arguments a dict). call_names: the
    names of the tool calls seen so far by id, for tool results that do not name their tool."""
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise OpenAIError(400, f"'{where}' must be an object, got {type(message).__name__}", where)
    role = message.get("role")
    if role not in ROLES:
        raise OpenAIError(400, f"'{where}.role' must be one of {list(ROLES)}, got {role!r}", f"{where}.role")
    converted: Message = {"role": role, "content": _text(message.get("content"), f"{where}.content")}
    if role == "assistant":
        reasoning = message.get("reasoning_content")
        if isinstance(reasoning, str):
            converted["reasoning_content"] = reasoning
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise OpenAIError(400, f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
        converted_calls = []
        for j, call in enumerate(calls):
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise OpenAIError(
                    400, f"'{where}.tool_calls[{j}].function.name' is missing", f"{where}.tool_calls[{j}].function.name"
                )
            arguments = _arguments(function.get("arguments", "{}"), f"{where}.tool_calls[{j}].function.arguments")
            converted_call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
            if isinstance(call.get("id"), str):
                converted_call["id"] = call["id"]
                call_names[call["id"]] = function["name"]
            converted_calls.append(converted_call)
        if converted_calls:
            converted["tool_calls"] = converted_calls
    if role == "tool":
        call_id = message.get("tool_call_id")
        if call_id is not None:
            converted["tool_call_id"] = call_id
        name = message.get("name") or call_names.get(call_id)
        if name is not None:
            converted["name"] = name
    return converted


def parse_request(body) -> ChatRequest:
    """A chat-completions body checked and converted; an OpenAIError naming the field otherwise."""
    if not isinstance(body, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    for name, unused in UNSUPPORTED_WHEN_SET.items():
        if body.get(name, unused) not in (unused, None):
            raise OpenAIError(400, f"'{name}' is not supported by this endpoint (got {body[name]!r})", name)
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise OpenAIError(400, f"'n' must be 1: one choice per request, got {n!r}", "n")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise OpenAIError(400, "'messages' is required: a non-empty list of chat messages", "messages")
    call_names: dict[str, str] = {}
    converted = [_template_message(m, i, call_names) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise OpenAIError(400, "'tools' must be a list of function tools", "tools")
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if (
                not isinstance(function, dict)
                or tool.get("type") != "function"
                or not isinstance(function.get("name"), str)
            ):
                raise OpenAIError(
                    400, f"'tools[{i}]' must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", f"tools[{i}]"
                )
    tool_choice = body.get("tool_choice", "auto")
    if tool_choice not in ("auto", "none", None):
        raise OpenAIError(400, f"'tool_choice' must be 'auto' or 'none', got {tool_choice!r}", "tool_choice")
    max_tokens = _number(body, "max_completion_tokens", 1, 2**31, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 2**31, integer=True)
    return ChatRequest(
        messages=converted,
        tools=(tools or None) if tool_choice != "none" else None,
        temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1, above_low=True),
        max_tokens=max_tokens,
        seed=_number(body, "seed", -(2**63), 2**63 - 1, integer=True),
    )


def canonical(message: Message) -> tuple:
    """What two messages must share to be the same turn of a conversation: role, text, tool calls
    (names and arguments), the result's call id. Reasoning is left out: clients drop it."""
    calls = tuple(
        (call["function"]["name"], json.dumps(call["function"]["arguments"], sort_keys=True))
        for call in message.get("tool_calls", ())
    )
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def assistant_message(turn: AssistantTurn, first_call: int) -> tuple[dict, int]:
    """The turn as an OpenAI assistant message (tool calls numbered from `first_call`: call_<n>,
    arguments a JSON string), and the next call number."""
    message: dict = {"role": "assistant", "content": turn.content if turn.content or not turn.tool_calls else None}
    if turn.reasoning is not None:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": f"call_{first_call + k}",
                "type": "function",
                "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
            }
            for k, call in enumerate(turn.tool_calls)
        ]
    return message, first_call + len(turn.tool_calls)


def template_form(message: dict) -> Message:
    converted = _template_message(message, 0, {})
    if "reasoning_content" in message:
        converted["reasoning_content"] = message["reasoning_content"]
    return converted
