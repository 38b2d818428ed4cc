"""ChatML, the message framing of the Qwen families: `<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`.

Also the pieces their chat templates share: tool results rendered inside a user turn (consecutive
tool messages grouped into one) and hermes-style tool calls (`<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`).
"""

from __future__ import annotations

from collections.abc import Callable

from archon.agents.renderer import Message, Renderer, ToolCall
from archon.models.common.chat_format import check_messages, parse_json_tool_call, require_stop, template_json

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>"
TOOL_RESPONSE_CLOSE = "</tool_response>"


class ChatMLRenderer(Renderer):
    """A renderer of ChatML turns: a turn ends with <|im_end|>, after which the templates write "\\n"
    (the first thing bridge() writes), then the environment's messages and the next generation prompt.

    Subclasses set `environment_roles` and implement `environment_text` and `generation_prompt`."""

    environment_roles: tuple[str, ...] = ("system", "user", "tool")
    """The roles of the messages bridge() takes."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.token_id(IM_START)
        self._im_end_id = self.token_id(IM_END)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._im_end_id,)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_messages(self.name, messages, roles=self.environment_roles)
        return self.encode("\n" + self.environment_text(messages) + self.generation_prompt())

    def environment_text(self, messages: list[Message]) -> str:
        """The messages an environment adds after a sampled turn, as the template writes them there."""
        raise NotImplementedError

    def generation_prompt(self) -> str:
        """What opens the assistant turn the model samples next."""
        raise NotImplementedError


def chatml_message(role: str, content: str) -> str:
    return f"{IM_START}{role}\n{content}{IM_END}\n"


def last_query_index(messages: list[Message]) -> int | None:
    """The index of the last user query: a user message that is not a tool result wrapped in
    <tool_response> (None when there is none)."""
    for index in range(len(messages) - 1, -1, -1):
        content = messages[index]["content"]
        if messages[index]["role"] == "user" and not (
            content.startswith(TOOL_RESPONSE_OPEN) and content.endswith(TOOL_RESPONSE_CLOSE)
        ):
            return index
    return None


def render_tool_responses(messages: list[dict], index: int) -> str:
    """Tool message `index` as the Qwen templates write it: a user turn opens at the first of a run of
    consecutive tool messages and closes after the last, each result in its own <tool_response>."""
    text = ""
    if index == 0 or messages[index - 1]["role"] != "tool":
        text += f"{IM_START}user"
    text += f"\n{TOOL_RESPONSE_OPEN}\n{messages[index]['content']}\n{TOOL_RESPONSE_CLOSE}"
    if index == len(messages) - 1 or messages[index + 1]["role"] != "tool":
        text += f"{IM_END}\n"
    return text


def hermes_tools_block(tools: list[dict]) -> str:
    """The tool schemas and calling instructions the Qwen2.5 and Qwen3 templates put in the system turn."""
    schemas = "".join("\n" + template_json(tool) for tool in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{schemas}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def hermes_tool_call(call: ToolCall) -> str:
    return (
        f'{TOOL_CALL_OPEN}\n{{"name": "{call.name}", "arguments": {template_json(call.arguments)}}}\n{TOOL_CALL_CLOSE}'
    )


def parse_hermes_turn(text: str) -> tuple[str, list[ToolCall], str | None]:
    """A turn's text (reasoning and stop token removed) -> (content, tool calls, parse error).

    The content is the text before the first <tool_call>, less the newline the templates write between
    content and a call. Only whitespace may stand between and after the calls. A malformed call is
    named in the error and skipped; the calls that parse are kept.
    """
    head, calls, error = parse_tool_call_blocks(text, parse_json_tool_call)
    if TOOL_CALL_OPEN in text and head.endswith("\n"):
        head = head[:-1]
    return head, calls, error


def parse_tool_call_blocks(
    text: str, parse_call: Callable[[str, int], tuple[ToolCall | None, str | None]]
) -> tuple[str, list[ToolCall], str | None]:
    """The `<tool_call>...</tool_call>` blocks of a turn's text, each body read by
    `parse_call(body, number)` -> (call, error): (the text before the first block, the calls that
    parsed, the errors joined or None). Only whitespace may stand between and after the blocks."""
    first = text.find(TOOL_CALL_OPEN)
    head = text if first == -1 else text[:first]
    errors = []
    if TOOL_CALL_CLOSE in head:
        errors.append(f"a {TOOL_CALL_CLOSE} with no {TOOL_CALL_OPEN} before it")
    if first == -1:
        return head, [], "; ".join(errors) or None
    calls: list[ToolCall] = []
    rest, number = text[first:], 0
    while rest:
        if not rest.startswith(TOOL_CALL_OPEN):
            next_open = rest.find(TOOL_CALL_OPEN)
            between = rest if next_open == -1 else rest[:next_open]
            if between.strip():
                errors.append(f"text outside a tool call after call {number}: {between.strip()[:80]!r}")
            if next_open == -1:
                break
            rest = rest[next_open:]
        number += 1
        body_start = len(TOOL_CALL_OPEN)
        end = rest.find(TOOL_CALL_CLOSE)
        nested = rest.find(TOOL_CALL_OPEN, body_start)
        if end == -1 or (nested != -1 and nested < end):
            errors.append(f"tool call {number} is never closed by {TOOL_CALL_CLOSE}")
            if nested == -1:
                break
            rest = rest[nested:]
            continue
        call, error = parse_call(rest[body_start:end], number)
        if error is not None:
            errors.append(error)
        else:
            calls.append(call)
        rest = rest[end + len(TOOL_CALL_CLOSE) :]
    return head, calls, "; ".join(errors) or None
