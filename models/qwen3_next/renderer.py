"""The Qwen3-Next-Thinking chat format, as its chat template writes it.

The template is Qwen3's (ChatML turns, the tools in the system turn, hermes-style calls, tool results
grouped into a user turn, the reasoning of turns at or before the last user query dropped) with one
difference: it has no thinking switch, and its generation prompt opens the reasoning,

    <|im_start|>assistant
    <think>

so the model samples `REASONING\\n</think>\\n\\nCONTENT<tool_call>...` and a turn is rendered in
history as Qwen3 renders it. Qwen3-Next-Instruct's template is Qwen3's without reasoning: an
assistant turn is written as its content and calls, and the generation prompt is
`<|im_start|>assistant\\n` (`qwen3_next_instruct`). The two checkpoints share the model_type
`qwen3_next`, for which the family names the Instruct renderer; a Thinking checkpoint is prompted
with `qwen3_next_thinking`, chosen by name.

Where the template is not prefix-preserving: as Qwen3's (qwen3/renderer.py), and a turn sampled with
empty reasoning (`\\n</think>\\n\\n...`) loses the block as soon as another message follows it.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, register_renderer
from archon.models.common.chat_format import THINK_CLOSE, THINK_OPEN, message_tool_calls, turn_text
from archon.models.common.chatml import IM_END, IM_START, hermes_tool_call, parse_hermes_turn
from archon.models.qwen3.renderer import Qwen3Renderer


@register_renderer
class Qwen3NextThinkingRenderer(Qwen3Renderer):
    name = "qwen3_next_thinking"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, enable_thinking=True)

    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n{THINK_OPEN}\n"

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        if THINK_CLOSE not in text:
            return AssistantTurn(
                content="", reasoning=text.strip("\n"), parse_error=f"the reasoning is never closed by {THINK_CLOSE}"
            )
        return super().parse_turn(sampled_ids)


@register_renderer
class Qwen3NextInstructRenderer(Qwen3Renderer):
    """Qwen3-Next-Instruct's template: Qwen3's without reasoning (an assistant turn is its content as
    given, then its calls) and without the thinking switch."""

    name = "qwen3_next_instruct"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, enable_thinking=True)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        content, calls, error = parse_hermes_turn(turn_text(self, sampled_ids))
        return AssistantTurn(content=content, tool_calls=calls, parse_error=error)

    def _render_message(self, messages: list[Message], index: int, last_query: int) -> str:
        message = messages[index]
        if message["role"] != "assistant":
            return super()._render_message(messages, index, last_query)
        text = f"{IM_START}assistant\n{message['content']}"
        for number, call in enumerate(message_tool_calls(message, index)):
            if number > 0 or message["content"]:
                text += "\n"
            text += hermes_tool_call(call)
        return text + f"{IM_END}\n"
