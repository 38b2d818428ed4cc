"""The Falcon-H1 chat format (model_type falcon_h1), as its chat template writes it.

    <BOS><|im_start|>system
    SYSTEM<|im_end|>
    <|im_start|>user
    QUESTION<|im_end|>
    <|im_start|>assistant
    ANSWER<|im_end|>
    <|im_start|>tool
    RESULT<|im_end|>
    <|im_start|>assistant

ChatML turns after the tokenizer's BOS token, every content written as given; a message keeps its own role
(a tool result is a `tool` turn). Only a first system message is written; the template drops any other.
With tools the system turn is the system message and a blank line, then the calling instructions with each
tool's JSON in brackets, `[{...}][{...}]`, and the template leaves that turn open: no `<|im_end|>` follows
it. The template writes an assistant message's content and nothing else (no tool calls): the model is asked
to write each call in its text as `<tool_call>\\n{'arguments': <args-dict>, 'name': <function-name>}\\n
</tool_call>`, which parse_turn reads (as JSON or as a Python literal). A turn ends with <|im_end|>, after
which the template writes "\\n". No reasoning, no options.

The template is prefix-preserving when an assistant turn in history carries the sampled text as its
content: it writes that text back unchanged. It is not when the turn carries only its parsed content and
tool calls, since the calls are dropped; render_prompt refuses such a message rather than drop them.
"""

from __future__ import annotations

import ast
import json

from archon.agents.renderer import AssistantTurn, Message, ToolCall, register_renderer
from archon.models.common.chat_format import check_messages, parse_json_tool_call, template_json, turn_text
from archon.models.common.chatml import (
    IM_START,
    TOOL_CALL_OPEN,
    ChatMLRenderer,
    chatml_message,
    parse_tool_call_blocks,
)

TOOLS_INTRO = (
    "You are a function calling AI model. You are provided with function signature within <tools> </tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions.\n<tools>\n"
)
TOOLS_OUTRO = (
    "\n</tools>\nFor each function call, return a json object with function name and arguments within "
    "<tool_call> </tool_call> tags with the following schema:\n<tool_call>\n"
    "{'arguments': <args-dict>, 'name': <function-name>}\n</tool_call>\n"
)


@register_renderer
class FalconH1Renderer(ChatMLRenderer):
    name = "falcon_h1"
    environment_roles = ("user", "tool")

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        if not isinstance(tokenizer.bos_token, str) or not tokenizer.bos_token:
            raise ValueError(f"renderer {self.name!r}: the tokenizer has no bos_token, which the template writes first")
        self.token_id(tokenizer.bos_token)
        self._bos = tokenizer.bos_token

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        if not messages:
            raise ValueError(f"renderer {self.name!r}: the template reads messages[0]; give at least one message")
        for index, message in enumerate(messages):
            if message["role"] == "system" and index > 0:
                raise ValueError(
                    f"renderer {self.name!r}: message {index}: the Falcon-H1 template writes a system message only "
                    "as the first message (it drops any other)"
                )
            if message.get("tool_calls"):
                raise ValueError(
                    f"renderer {self.name!r}: message {index} has tool calls, which the Falcon-H1 template drops; "
                    "give the turn's sampled text (calls included) as its content"
                )
        text = self._bos + self._system_text(messages, tools) + self.environment_text(messages)
        return self.encode(text + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        head, calls, error = parse_tool_call_blocks(text, parse_call)
        if TOOL_CALL_OPEN in text:
            head = head.removesuffix("\n")
        return AssistantTurn(content=head, tool_calls=calls, parse_error=error)

    # ---- the template, in Python ------------------------------------------------------------------
    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n"

    def environment_text(self, messages: list[Message]) -> str:
        """Every message but a system one, each a turn of its own role."""
        return "".join(chatml_message(m["role"], m["content"]) for m in messages if m["role"] != "system")

    @staticmethod
    def _system_text(messages: list[Message], tools: list[dict] | None) -> str:
        system = messages[0]["content"] if messages[0]["role"] == "system" else None
        if not tools:
            return "" if system is None else chatml_message("system", system)
        schemas = "".join(f"[{template_json(tool)}]" for tool in tools)
        opening = "" if system is None else system + "\n\n"
        return f"{IM_START}system\n{opening}{TOOLS_INTRO}{schemas}{TOOLS_OUTRO}"  # the template leaves it open


def parse_call(body: str, number: int) -> tuple[ToolCall | None, str | None]:
    """One `<tool_call>` body: a JSON object, or the Python dict the template's schema line shows
    (`{'arguments': {...}, 'name': '...'}`), with "name" and "arguments"."""
    text = body.strip()
    try:
        json.loads(text)
    except json.JSONDecodeError:
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return None, f"tool call {number} is neither JSON nor a Python literal: {text[:80]!r}"
        try:
            text = json.dumps(value, ensure_ascii=False)  # checked below as the JSON form of the same dict
        except (TypeError, ValueError):
            return None, f"tool call {number} holds a value JSON cannot hold: {text[:80]!r}"
    return parse_json_tool_call(text, number)
