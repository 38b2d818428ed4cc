"""The Qwen3 chat format (Qwen3 dense and MoE), as its chat template writes it.

    <|im_start|>system
    SYSTEM

    # Tools ... <tools>
    {tool schema as JSON}
    </tools> ... <|im_end|>
    <|im_start|>user
    QUESTION<|im_end|>
    <|im_start|>assistant
    <think>
    REASONING
    </think>

    CONTENT
    <tool_call>
    {"name": "NAME", "arguments": {...}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    RESULT
    </tool_response>
    <tool_response>
    RESULT
    </tool_response><|im_end|>
    <|im_start|>assistant

A turn ends with <|im_end|>, after which the template writes "\\n". Tool results are a user turn,
consecutive tool messages grouped into one. The system turn exists only when there is a system
message or tools. `enable_thinking=False` (the template's switch; on by default) makes the generation
prompt end with an empty `<think>\\n\\n</think>\\n\\n`, so the model answers without reasoning.

Where the template is not prefix-preserving (rendering the longer conversation again does not extend
the ids the model was prompted with and sampled):

- Reasoning of earlier queries is dropped: an assistant turn at or before the last user message
  (one that is not a tool response) is written as `<|im_start|>assistant\\nCONTENT...` without its
  `<think>` block, and its content without the newline stripping below. So once a user message
  follows, every earlier turn changes.
- An assistant turn after the last user message keeps its `<think>` block only if its reasoning is
  not empty or it is the last message: a turn with empty reasoning (under enable_thinking=False the
  empty block is the one the generation prompt wrote) loses `<think>\\n\\n</think>\\n\\n` as soon
  as another message follows.
- The template writes `reasoning.strip("\\n")` and `content.lstrip("\\n")`: a model that samples
  other newlines around them is rendered differently than sampled.
- The generation prompt ends with "assistant\\n" (or "</think>\\n\\n"); tokenizing the whole text
  again may merge that newline with the first sampled characters (a content that starts with a
  newline), which the sampled ids did not.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, Renderer, register_renderer
from archon.models.common.chatml import (
    IM_END,
    IM_START,
    chatml_message,
    hermes_tool_call,
    hermes_tools_block,
    parse_hermes_turn,
    render_tool_responses,
)
from archon.models.common.chat_format import check_messages, message_tool_calls, require_stop, turn_text

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


@register_renderer
class Qwen3Renderer(Renderer):
    name = "qwen3"

    def __init__(self, tokenizer, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking
        self.token_id(IM_START)
        self._im_end_id = self.token_id(IM_END)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._im_end_id,)

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        return self.encode(self._render(messages, tools) + self._generation_prompt())

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_messages(self.name, messages, roles=("system", "user", "tool"))
        body = "".join(self._render_message(messages, index, last_query_index=-1) for index in range(len(messages)))
        return self.encode("\n" + body + self._generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning, error = None, None
        if text.startswith(THINK_OPEN) or THINK_CLOSE in text:
            if THINK_CLOSE not in text:
                return AssistantTurn(
                    content="", reasoning=text[len(THINK_OPEN) :].strip("\n"),
                    parse_error=f"the reasoning is never closed by {THINK_CLOSE}",
                )  # fmt: skip
            reasoning, text = text.split(THINK_CLOSE, 1)
            reasoning = reasoning.removeprefix(THINK_OPEN).strip("\n")
            text = text.lstrip("\n")
        content, calls, error = parse_hermes_turn(text)
        return AssistantTurn(content=content, reasoning=reasoning, tool_calls=calls, parse_error=error)

    # ---- the template, in Python ------------------------------------------------------------------
    def _generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK)

    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        has_system = bool(messages) and messages[0]["role"] == "system"
        text = ""
        if tools:
            system = messages[0]["content"] + "\n\n" if has_system else ""
            text += chatml_message("system", system + hermes_tools_block(tools))
        elif has_system:
            text += chatml_message("system", messages[0]["content"])
        last_query_index = len(messages) - 1
        for index in range(len(messages) - 1, -1, -1):
            message = messages[index]
            if message["role"] == "user" and not (
                message["content"].startswith("<tool_response>") and message["content"].endswith("</tool_response>")
            ):
                last_query_index = index
                break
        for index in range(1 if has_system else 0, len(messages)):
            text += self._render_message(messages, index, last_query_index)
        return text

    def _render_message(self, messages: list[Message], index: int, last_query_index: int) -> str:
        message = messages[index]
        if message["role"] in ("user", "system"):
            return chatml_message(message["role"], message["content"])
        if message["role"] == "tool":
            return render_tool_responses(messages, index)
        content = message["content"]
        reasoning = message.get("reasoning_content")
        if reasoning is None:
            reasoning = ""
            if THINK_CLOSE in content:
                reasoning = content.split(THINK_CLOSE)[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n")
                content = content.split(THINK_CLOSE)[-1].lstrip("\n")
        is_last = index == len(messages) - 1
        if index > last_query_index and (is_last or reasoning):
            reasoning, shown_content = reasoning.strip("\n"), content.lstrip("\n")
            text = f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{shown_content}"
        else:
            text = f"{IM_START}assistant\n{content}"
        for number, call in enumerate(message_tool_calls(message, index)):
            if number > 0 or content:
                text += "\n"
            text += hermes_tool_call(call)
        return text + f"{IM_END}\n"
