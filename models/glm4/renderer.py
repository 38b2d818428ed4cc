"""The GLM-4-0414 chat format, as its chat template writes it.

    [gMASK]<sop><|system|>
    # 可用工具

    ## NAME

    {the function's JSON, indented by 4}
    在调用上述函数时，请使用 Json 格式表示调用的参数。<|system|>
    SYSTEM<|user|>
    QUESTION<|assistant|>
    ANSWER<|user|>
    ...<|assistant|>

The template writes every system message first, then the others in order: `<|user|>\\n{text}`,
`<|assistant|>\\n{text}`, and a call as an assistant message whose `metadata` is the function's name
and whose content is its arguments, `<|assistant|>NAME \\n{content}` (a space ends the name's
line); a tool result is an `observation` message, `<|observation|>\\n{text}`. This renderer takes
the contract's messages and writes them so: an assistant message with one tool call (and no
content) as the call, a `tool` message as an observation. A turn is its text after a newline, or a
call, `NAME \\n{JSON arguments}`; one call a turn. The model ends a turn with the next message's
role token (`<|observation|>` after a call, `<|user|>`) or `<|endoftext|>`; the bridge writes the
rest of that message. No reasoning, no options.

The template is prefix-preserving for what an environment adds (tool results and user turns: it
writes contents as given); a system message after the first turn would move to the front.
"""

from __future__ import annotations

import json

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    call_function,
    check_environment_messages,
    check_messages,
    message_tool_calls,
    parse_arguments,
    require_stop,
    template_json,
    turn_text,
)

CALL_INSTRUCTION = "在调用上述函数时，请使用 Json 格式表示调用的参数。"
ROLE_TOKENS = {"user": "<|user|>", "tool": "<|observation|>"}


@register_renderer
class Glm4Renderer(Renderer):
    name = "glm4"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        for token in ("[gMASK]", "<sop>", "<|system|>", "<|assistant|>"):
            self.token_id(token)
        self._role_ids = {role: self.token_id(token) for role, token in ROLE_TOKENS.items()}
        self._endoftext = self.token_id("<|endoftext|>")

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._role_ids["user"], self._role_ids["tool"], self._endoftext)

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        text = "[gMASK]<sop>"
        if tools:
            text += "<|system|>\n# 可用工具\n" + "".join(_tool_text(tool) for tool in tools)
        text += "".join(f"<|system|>\n{m['content']}" for m in messages if m["role"] == "system")
        others = [(index, m) for index, m in enumerate(messages) if m["role"] != "system"]
        return self.encode(text + "".join(self._message_text(m, index) for index, m in others) + "<|assistant|>")

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        stop = require_stop(self, sampled_ids)
        check_environment_messages(messages)
        check_messages(self.name, messages, roles=("user", "tool"))
        text = "".join(self._message_text(m, index) for index, m in enumerate(messages))
        if messages and stop == self._role_ids[messages[0]["role"]]:
            text = text[len(ROLE_TOKENS[messages[0]["role"]]) :]  # the model sampled the role token
        return self.encode(text + "<|assistant|>")

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        if not text or text.startswith("\n"):
            return AssistantTurn(content=text.removeprefix("\n"))
        name, newline, arguments_text = text.partition("\n")
        if not newline or not name.strip():
            return AssistantTurn(
                content=text,
                parse_error=f"a turn is a newline and its text, or a call NAME\\n{{arguments}}: {text[:80]!r}",
            )
        arguments, error = parse_arguments(arguments_text, name.strip())
        if error is not None:
            return AssistantTurn(content="", parse_error=error)
        return AssistantTurn(content="", tool_calls=[ToolCall(name.strip(), arguments)])

    def _message_text(self, message: Message, index: int) -> str:
        role = message["role"]
        if role == "user":
            return f"<|user|>\n{message['content']}"
        if role == "tool":
            return f"<|observation|>\n{message['content']}"
        calls = message_tool_calls(message, index)
        if not calls:
            return f"<|assistant|>\n{message['content']}"
        if len(calls) > 1 or message["content"]:
            raise ValueError(
                f"renderer {self.name!r}: message {index} has {len(calls)} tool calls and "
                f"{'content' if message['content'] else 'no content'}; the GLM-4 format writes one call a turn, "
                f"with no content"
            )
        return f"<|assistant|>{calls[0].name} \n{template_json(calls[0].arguments)}"


def _tool_text(tool: dict) -> str:
    function = call_function(tool)
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(f"renderer 'glm4': a tool must be a function with a name, got {tool!r}")
    return f"\n## {function['name']}\n\n{json.dumps(function, indent=4, ensure_ascii=False)}\n{CALL_INSTRUCTION}"
