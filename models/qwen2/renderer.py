"""The Qwen2.5 chat format (model_type qwen2), as its chat template writes it.

    <|im_start|>system
    SYSTEM

    # Tools ... <tools>
    {tool schema as JSON}
    </tools> ... <|im_end|>
    <|im_start|>user
    QUESTION<|im_end|>
    <|im_start|>assistant
    CONTENT
    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    RESULT
    </tool_response><|im_end|>
    <|im_start|>assistant

ChatML turns, contents written as given. The system turn is always there: the system message, or
"You are Qwen, created by Alibaba Cloud. You are a helpful assistant."; with tools, followed by a
blank line and the hermes tool block. A later system message is a turn of its own. Tool results are
a user turn, consecutive tool messages grouped into one. A turn ends with <|im_end|>, after which the
template writes "\\n". No reasoning.

Where the template is not prefix-preserving (rendering the longer conversation again does not extend
the ids the model was prompted with and sampled):

- A call is written again as `{"name": "NAME", "arguments": ` + the arguments' JSON + `}`: a call
  sampled with other spacing, key order or escapes is rendered differently.
- The generation prompt ends with "assistant\\n"; tokenizing the whole text again merges that newline
  with the whitespace a content starts with, which the sampled ids did not.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, register_renderer
from archon.models.common.chat_format import check_messages, message_tool_calls, turn_text
from archon.models.common.chatml import (
    IM_END,
    IM_START,
    ChatMLRenderer,
    chatml_message,
    hermes_tool_call,
    hermes_tools_block,
    parse_hermes_turn,
    render_tool_responses,
)

DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


@register_renderer
class Qwen2Renderer(ChatMLRenderer):
    name = "qwen2"

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        return self.encode(self._render(messages, tools) + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        content, calls, error = parse_hermes_turn(turn_text(self, sampled_ids))
        return AssistantTurn(content=content, tool_calls=calls, parse_error=error)

    # ---- the template, in Python ------------------------------------------------------------------
    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n"

    def environment_text(self, messages: list[Message]) -> str:
        return "".join(self._render_message(messages, index) for index in range(len(messages)))

    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        has_system = bool(messages) and messages[0]["role"] == "system"
        system = messages[0]["content"] if has_system else DEFAULT_SYSTEM
        text = chatml_message("system", system + "\n\n" + hermes_tools_block(tools) if tools else system)
        first = 1 if has_system else 0
        return text + "".join(self._render_message(messages, index) for index in range(first, len(messages)))

    def _render_message(self, messages: list[Message], index: int) -> str:
        message = messages[index]
        if message["role"] == "tool":
            return render_tool_responses(messages, index)
        calls = message_tool_calls(message, index) if message["role"] == "assistant" else []
        if not calls:
            return chatml_message(message["role"], message["content"])
        text = f"{IM_START}assistant" + ("\n" + message["content"] if message["content"] else "")
        return text + "".join("\n" + hermes_tool_call(call) for call in calls) + f"{IM_END}\n"
