"""Pieces the families' renderers (archon.agents.renderer) share: reading and checking HF chat
messages the way chat templates read them, JSON as the templates' `tojson` writes it, the reading
of a sampled turn's ids, and the reading of tool calls and of their arguments (typed, for formats
that write arguments as text, by the offered tools' schemas)."""

from __future__ import annotations

import json
from typing import Any

from archon.agents.renderer import Message, ToolCall

ROLES = ("system", "user", "assistant", "tool")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def template_json(value: Any, indent: int | None = None) -> str:
    """`value | tojson` in an HF chat template: json.dumps with ensure_ascii=False, default separators."""
    return json.dumps(value, ensure_ascii=False, indent=indent)


def json_type(value: Any) -> str:
    """The JSON type name of a decoded JSON value."""
    names = {
        list: "array",
        dict: "object",
        str: "string",
        int: "number",
        float: "number",
        bool: "boolean",
        type(None): "null",
    }
    return names.get(type(value), type(value).__name__)


def call_function(call: Any) -> dict | None:
    """A tool call's or a tool's {"name", ...} dict, the OpenAI {"function": ...} wrapper unwrapped;
    None when it is not a dict."""
    return call.get("function", call) if isinstance(call, dict) else None


# ---- messages -------------------------------------------------------------------------------------
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
    raise ValueError(
        f"message {index} ({message.get('role')}): content must be a string or text parts, not {content!r}"
    )


def message_reasoning(message: Message) -> str | None:
    """An assistant message's reasoning: "reasoning_content" (the contract's name), else "thinking"."""
    reasoning = message.get("reasoning_content", message.get("thinking"))
    return reasoning if isinstance(reasoning, str) else None


REASONING_NOT_CLOSED = f"the reasoning is never closed by {THINK_CLOSE}"


def split_reasoning(text: str) -> tuple[str, str, str | None]:
    """A sampled turn's text that starts with its reasoning, split at the first `</think>`:
    (reasoning, the text after `</think>`, None); with no `</think>`, all of it is reasoning:
    (text, "", REASONING_NOT_CLOSED)."""
    reasoning, closed, rest = text.partition(THINK_CLOSE)
    if not closed:
        return text, "", REASONING_NOT_CLOSED
    return reasoning, rest, None


def reasoning_and_content(reasoning: str | None, content: str) -> tuple[str, str]:
    """An assistant message's reasoning and content as the templates that write `<think>` read them:
    the message's own reasoning, else the reasoning its content opens with (`...</think>`, which
    the content then loses), else ""."""
    if reasoning is not None:
        return reasoning, content
    if THINK_CLOSE not in content:
        return "", content
    reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
    return reasoning, content.split(THINK_CLOSE)[-1].lstrip("\n")


def message_tool_calls(message: Message, index: int) -> list[ToolCall]:
    """An assistant message's tool calls, arguments as a dict (a JSON object string is read)."""
    calls = []
    for j, call in enumerate(message.get("tool_calls") or []):
        function = call_function(call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"message {index}: tool call {j} has no function name: {call!r}")
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"message {index}: tool call {j} ({function['name']}): arguments are not JSON: {e}"
                ) from e
        if not isinstance(arguments, dict):
            raise ValueError(
                f"message {index}: tool call {j} ({function['name']}): arguments must be an object, not {arguments!r}"
            )
        calls.append(ToolCall(function["name"], arguments, call.get("id")))
    return calls


def check_messages(renderer_name: str, messages: list, roles: tuple[str, ...] = ROLES) -> None:
    """For renderers that read messages as they are: each message is a dict with a known role and
    string content; an assistant's tool calls carry a function name and arguments as a dict. An
    error names the message and what is wrong."""
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
            function = call_function(call)
            if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
                raise ValueError(f"{where}: tool call {number} has no function name")
            if not isinstance(function.get("arguments"), dict):
                raise ValueError(
                    f"{where}: tool call {number} ({function['name']}) needs arguments as a dict, "
                    f"got {type(function.get('arguments')).__name__}"
                )


def check_environment_messages(messages: list[Message]) -> None:
    """What bridge() takes after a sampled turn: tool results and user turns, nothing else."""
    for index, message in enumerate(messages):
        role = message_role(message, index)
        if role not in ("tool", "user"):
            raise ValueError(f"message {index}: an environment adds tool results and user turns, not {role!r} messages")


# ---- a sampled turn -------------------------------------------------------------------------------
def split_stop(renderer, sampled_ids: list[int]) -> tuple[list[int], int | None]:
    """The sampled turn without its stop token, and the stop token (None when it reached none)."""
    if sampled_ids and sampled_ids[-1] in renderer.stop_token_ids:
        return list(sampled_ids[:-1]), sampled_ids[-1]
    return list(sampled_ids), None


def turn_text(renderer, sampled_ids: list[int]) -> str:
    """The sampled turn as text, without the stop token that ended it."""
    body_ids, _ = split_stop(renderer, sampled_ids)
    return renderer.decode(body_ids)


def require_stop(renderer, sampled_ids: list[int]) -> int:
    """The stop token a bridged turn must end with; an error naming the ones allowed otherwise."""
    _, stop = split_stop(renderer, sampled_ids)
    if stop is None:
        last = sampled_ids[-1] if sampled_ids else None
        raise ValueError(
            f"renderer {renderer.name!r}: bridge() needs a turn that ended with a stop token "
            f"{list(renderer.stop_token_ids)}; this one ends with {last!r} (a truncated turn cannot be continued)"
        )
    return stop


# ---- tool calls the model wrote -------------------------------------------------------------------
def parse_arguments(text: str, name: str) -> tuple[dict | None, str | None]:
    """A tool call's JSON arguments: (the object, None), or (None, what is wrong)."""
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"tool call {name!r}: arguments are not valid JSON ({e}): {text!r}"
    if not isinstance(arguments, dict):
        return None, f"tool call {name!r}: arguments must be a JSON object, not {type(arguments).__name__}: {text!r}"
    return arguments, None


def parse_json_tool_call(
    body: str, number: int, arguments_key: str = "arguments"
) -> tuple[ToolCall | None, str | None]:
    """A call written as one JSON object `{"name": ..., ARGUMENTS_KEY: {...}}` -> (call, error); the
    error names call `number` and what is wrong."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return (
            None,
            f"tool call {number} is not valid JSON "
            f"({e.msg} at line {e.lineno} column {e.colno}): {body.strip()[:80]!r}",
        )
    if not isinstance(value, dict):
        return None, f'tool call {number} is a JSON {json_type(value)}, not an object with "name" and "{arguments_key}"'
    unknown = sorted(set(value) - {"name", arguments_key})
    if unknown:
        return None, f'tool call {number} has keys other than "name" and "{arguments_key}": {unknown}'
    name = value.get("name")
    if not isinstance(name, str) or not name:
        return None, f'tool call {number} has no "name" (a non-empty string)'
    if arguments_key not in value:
        return None, f'tool call {number} ({name}) has no "{arguments_key}"'
    if not isinstance(value[arguments_key], dict):
        return (
            None,
            f'tool call {number} ({name}): "{arguments_key}" is a JSON '
            f"{json_type(value[arguments_key])}, not an object",
        )
    return ToolCall(name=name, arguments=value[arguments_key]), None


def tool_parameter_schemas(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """The offered tools' parameter schemas by function name: {name: {parameter: JSON schema}}."""
    schemas = {}
    for tool in tools or []:
        function = call_function(tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        schemas[function["name"]] = properties if isinstance(properties, dict) else {}
    return schemas


def schema_types(schema: Any) -> set[str] | None:
    """The JSON types a parameter's schema allows ("type", a list of them, "anyOf"/"oneOf", or the
    types of an "enum"); None when the schema does not say."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list) and all(isinstance(name, str) for name in declared):
        return set(declared)
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            alternatives = [schema_types(alternative) for alternative in schema[key]]
            if any(types is None for types in alternatives):
                return None
            return set().union(*alternatives)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return {
            "integer" if isinstance(value, int) and not isinstance(value, bool) else json_type(value)
            for value in schema["enum"]
        }
    return None


# Python's spellings, which templates that write a value with Jinja's `string` filter use.
_PYTHON_LITERALS = {"True": True, "False": False, "None": None}
_TYPE_READERS_ORDER = ("null", "boolean", "integer", "number", "object", "array")


def typed_argument(text: str, schema: Any) -> tuple[Any, str | None]:
    """An argument the model wrote as text (a string as itself, anything else as JSON or Python's
    spelling) -> (value, error), typed by its parameter's JSON schema: the first of the schema's
    types that reads the text, a string last. Without a type in the schema: JSON, else a Python
    literal (True, False, None), else the text."""
    types = schema_types(schema)
    if types is None:
        if text in _PYTHON_LITERALS:
            return _PYTHON_LITERALS[text], None
        try:
            return json.loads(text), None
        except json.JSONDecodeError:
            return text, None
    for name in _TYPE_READERS_ORDER:
        if name in types:
            found, value = _read_as(name, text)
            if found:
                return value, None
    if "string" in types:
        return text, None
    return None, f"{text[:80]!r} is not {' or '.join(sorted(types))} as its schema says"


def _read_as(type_name: str, text: str) -> tuple[bool, Any]:
    if type_name == "null":
        return text in ("null", "None"), None
    if type_name == "boolean":
        values = {"true": True, "false": False, "True": True, "False": False}
        return text in values, values.get(text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, None
    expected = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list,)}[type_name]
    return isinstance(value, expected) and not isinstance(value, bool), value


def delimited_tool_calls(
    text: str, section_begin: str, section_end: str, call_begin: str, call_end: str, errors: list[str]
) -> tuple[str, list[tuple[int, str]]]:
    """A turn whose tool calls form one section of delimited calls (DeepSeek, Kimi K2): the content
    before the section, and (index, body) of each call closed in it; what is malformed (an unclosed
    section or call, text around the calls) is added to `errors`."""
    content, opened, section = text.partition(section_begin)
    bodies: list[tuple[int, str]] = []
    if not opened:
        return content, bodies
    section, closed, after = section.partition(section_end)
    if not closed:
        errors.append(f"the tool calls are not closed by {section_end}")
    elif after:
        errors.append(f"text after the tool calls: {after!r}")
    for number, part in enumerate(section.split(call_begin)):
        if number == 0:
            if part:
                errors.append(f"text between {section_begin} and the first call: {part!r}")
            continue
        body, call_closed, rest = part.partition(call_end)
        if not call_closed:
            errors.append(f"tool call {number - 1} is not closed by {call_end}: {part!r}")
            continue
        if rest:
            errors.append(f"text after tool call {number - 1}: {rest!r}")
        bodies.append((number - 1, body))
    return content, bodies
