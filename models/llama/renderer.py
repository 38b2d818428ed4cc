"""The Llama 3 chat format (Llama 3.1 and 3.3, the same template), as its chat template writes it.

    <|begin_of_text|><|start_header_id|>system<|end_header_id|>

    Environment: ipython
    Cutting Knowledge Date: December 2023
    Today Date: 26 Jul 2024

    SYSTEM<|eot_id|><|start_header_id|>user<|end_header_id|>

    Given the following functions, ... Do not use variables.

    {tool schema as JSON, indented by 4}

    QUESTION<|eot_id|><|start_header_id|>assistant<|end_header_id|>

    {"name": "NAME", "parameters": {...}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>

    "RESULT"<|eot_id|><|start_header_id|>assistant<|end_header_id|>

The system turn is always there, with the knowledge cut-off and `date_string` (the template's
default "26 Jul 2024"; Llama 3.2's template, otherwise the same, fills in the day of rendering). With
tools (any list, empty too) it opens with "Environment: ipython", and the tools go into the first user
message (`tools_in_user_message=True`, the template's default) or after the dates in the system turn.
Every content is trimmed but a tool result's, which is written as a JSON string. An assistant turn
with a tool call is only that call, one JSON object (its content is not written); the template takes
one call a turn. parse_turn reads a turn that starts with `{"name"` (or `<|python_tag|>`) as a call,
any other as content. Tool results take the `ipython` role (`tool` or `ipython` messages). A turn
ends with <|eot_id|>, or <|eom_id|> (the end of a built-in tool call); nothing follows it.

Where the template is not prefix-preserving (rendering the longer conversation again does not extend
the ids the model was prompted with and sampled):

- A call is written again as `{"name": "NAME", "parameters": ` + the arguments' JSON + `}`: a call
  sampled with other spacing, key order or escapes (`\\u00e9`) is rendered differently.
- Content is trimmed: a turn sampled with whitespace around its text is rendered differently.
- A turn that ended with <|eom_id|> is rendered ending with <|eot_id|> (built-in tools, the only
  ones the template ends with <|eom_id|>, are not part of this format).
"""

from __future__ import annotations

import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, register_renderer
from archon.models.common.chat_format import (
    ROLES,
    check_messages,
    message_tool_calls,
    parse_json_tool_call,
    require_stop,
    template_json,
    turn_text,
)

BEGIN_OF_TEXT = "<|begin_of_text|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
EOM = "<|eom_id|>"
PYTHON_TAG = "<|python_tag|>"
DEFAULT_DATE = "26 Jul 2024"

CALL_FORMAT = 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
# A turn that opens a JSON object with one of these keys is a tool call.
CALL_START = re.compile(r'\{\s*"(name|parameters)"')


@register_renderer
class Llama3Renderer(Renderer):
    name = "llama3"

    def __init__(self, tokenizer, date_string: str = DEFAULT_DATE, tools_in_user_message: bool = True) -> None:
        super().__init__(tokenizer)
        if not isinstance(date_string, str) or not date_string.strip():
            raise ValueError(
                f"renderer {self.name!r}: date_string must be a non-empty string such as {DEFAULT_DATE!r}, "
                f"got {date_string!r}"
            )
        self.date_string = date_string
        self.tools_in_user_message = tools_in_user_message
        for token in (BEGIN_OF_TEXT, START_HEADER, END_HEADER):
            self.token_id(token)
        self._stop_ids = (self.token_id(EOT), self.token_id(EOM))

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stop_ids

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages, roles=(*ROLES, "ipython"))
        return self.encode(self._render(messages, tools) + _header("assistant"))

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_messages(self.name, messages, roles=("system", "user", "tool", "ipython"))
        body = "".join(self._render_message(message, index) for index, message in enumerate(messages))
        return self.encode(body + _header("assistant"))

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids).strip()
        if text.startswith(PYTHON_TAG) or CALL_START.match(text):
            call, error = parse_json_tool_call(text.removeprefix(PYTHON_TAG), 1, arguments_key="parameters")
            return AssistantTurn(content="", tool_calls=[call] if call is not None else [], parse_error=error)
        return AssistantTurn(content=text)

    # ---- the template, in Python ------------------------------------------------------------------
    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        system_message, first = "", 0
        if messages and messages[0]["role"] == "system":
            system_message, first = messages[0]["content"].strip(), 1
        text = BEGIN_OF_TEXT + _header("system")
        if tools is not None:
            text += "Environment: ipython\n"
        text += f"Cutting Knowledge Date: December 2023\nToday Date: {self.date_string}\n\n"
        if tools is not None and not self.tools_in_user_message:
            text += (
                "You have access to the following functions. To call a function, please respond with JSON "
                "for a function call." + CALL_FORMAT + "Do not use variables.\n\n" + _tool_schemas(tools)
            )
        text += system_message + EOT
        if tools is not None and self.tools_in_user_message:
            if first == len(messages) or messages[first]["role"] != "user":
                raise ValueError(
                    f"renderer {self.name!r}: with tools, the first message after the system message must be a "
                    f"user message (the template writes the tools into it)"
                )
            text += _header("user") + (
                "Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\n"
                + CALL_FORMAT
                + "Do not use variables.\n\n"
                + _tool_schemas(tools)
                + messages[first]["content"].strip()
                + EOT
            )
            first += 1
        return text + "".join(self._render_message(messages[index], index) for index in range(first, len(messages)))

    def _render_message(self, message: Message, index: int) -> str:
        if message["role"] in ("tool", "ipython"):
            return _header("ipython") + template_json(message["content"]) + EOT
        if "tool_calls" not in message:
            return _header(message["role"]) + message["content"].strip() + EOT
        calls = message_tool_calls(message, index)
        if len(calls) != 1:
            raise ValueError(
                f"renderer {self.name!r}: message {index} ({message['role']}) has {len(calls)} tool calls; "
                f"the Llama 3 template takes exactly one a turn"
            )
        call = f'{{"name": "{calls[0].name}", "parameters": {template_json(calls[0].arguments)}}}'
        return _header("assistant") + call + EOT


def _header(role: str) -> str:
    return f"{START_HEADER}{role}{END_HEADER}\n\n"


def _tool_schemas(tools: list[dict]) -> str:
    return "".join(template_json(tool, indent=4) + "\n\n" for tool in tools)
