"""GLM-5's chat format (model_type glm_moe_dsa), as its chat template writes it.

The GLM-4.5 format (glm4_moe/renderer.py: `[gMASK]<sop>`, the tools as JSON lines in a `<|system|>`
message, the model ending its turn with the next message's role token) with no newline after any
role token and none inside a call:

    [gMASK]<sop><|system|>SYSTEM<|user|>QUESTION<|assistant|><think>REASONING</think>CONTENT
    <tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value></tool_call><|observation|>
    <tool_response>RESULT</tool_response><tool_response>RESULT</tool_response><|assistant|><think>

(one line; broken here for reading). The generation prompt opens the reasoning, so the model samples
`REASONING</think>CONTENT<tool_call>...`; a string value is written as it is, any other as JSON.
Option enable_thinking (True): False closes the reasoning in the generation prompt
(`<|assistant|></think>`), as the template does. DeepSeek-V3.2 (model_type deepseek_v32) ships no
chat template of this kind and has no renderer.

Where the template is not prefix-preserving:
- it writes the reasoning of a turn only while no user message follows it (the template's
  `clear_thinking`, on by default): once one does, the turn is rendered `<|assistant|></think>...`;
- it strips the whitespace around reasoning and content, and writes a turn with empty reasoning as
  `<|assistant|></think>`, not `<|assistant|><think></think>`;
- a turn that stopped with another token than the next message's role token is followed by the
  whole next message, role token included.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, ToolCall, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
    message_reasoning,
    message_text,
    message_tool_calls,
    reasoning_and_content,
    template_json,
    turn_text,
)
from archon.models.glm4_moe.renderer import Glm45Renderer

TOOLS_INSTRUCTIONS = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>{arg-value-1}</arg_value>"
    "<arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>...</tool_call>"
)


@register_renderer
class Glm5Renderer(Glm45Renderer):
    name = "glm5"
    tools_instructions = TOOLS_INSTRUCTIONS

    def generation_prompt(self) -> str:
        return "<|assistant|>" + (THINK_OPEN if self.enable_thinking else THINK_CLOSE)

    def user_text(self, message: Message, index: int) -> str:
        return f"<|user|>{message_text(message, index)}"

    @staticmethod
    def tool_text(message: Message, index: int, opens_group: bool) -> str:
        return (
            "<|observation|>" if opens_group else ""
        ) + f"<tool_response>{message_text(message, index)}</tool_response>"

    @staticmethod
    def assistant_text(message: Message, index: int, keeps_reasoning: bool) -> str:
        reasoning, content = reasoning_and_content(message_reasoning(message), message_text(message, index))
        text = "<|assistant|>" + (
            f"{THINK_OPEN}{reasoning.strip()}{THINK_CLOSE}" if keeps_reasoning and reasoning else THINK_CLOSE
        )
        text += content.strip()
        for call in message_tool_calls(message, index):
            text += f"<tool_call>{call.name}"
            for key, value in call.arguments.items():
                written = value if isinstance(value, str) else template_json(value)
                text += f"<arg_key>{key}</arg_key><arg_value>{written}</arg_value>"
            text += "</tool_call>"
        return text

    def system_text(self, message: Message, index: int) -> str:
        return f"<|system|>{message_text(message, index)}"

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning = None
        if self.enable_thinking:
            if THINK_CLOSE not in text:
                return AssistantTurn(
                    content="", reasoning=text, parse_error=f"the reasoning is never closed by {THINK_CLOSE}"
                )
            reasoning, text = text.split(THINK_CLOSE, 1)
        content, opened, calls_text = text.partition("<tool_call>")
        calls: list[ToolCall] = []
        errors: list[str] = []
        if opened:
            for number, part in enumerate(calls_text.split("<tool_call>")):
                body, closed, after = part.partition("</tool_call>")
                if not closed:
                    errors.append(f"tool call {number} is not closed by </tool_call>: {part!r}")
                    continue
                call = self.parse_call(body, errors)
                if call is not None:
                    calls.append(call)
                if after.strip():
                    errors.append(f"text after tool call {number}: {after.strip()!r}")
        return AssistantTurn(
            content=content.strip(), reasoning=reasoning, tool_calls=calls, parse_error="; ".join(errors) or None
        )
