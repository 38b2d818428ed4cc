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

from archon.agents.renderer import AssistantTurn, Message, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
    check_messages,
    message_tool_calls,
    reasoning_and_content,
    split_reasoning,
    turn_text,
)
from archon.models.common.chatml import (
    IM_END,
    IM_START,
    ChatMLRenderer,
    chatml_message,
    hermes_tool_call,
    hermes_tools_block,
    last_query_index,
    parse_hermes_turn,
    render_tool_responses,
)

EMPTY_THINK = f"{THINK_OPEN}\n\n{THINK_CLOSE}\n\n"


@register_renderer
class Qwen3Renderer(ChatMLRenderer):
    name = "qwen3"

    def __init__(self, tokenizer, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        return self.encode(self._render(messages, tools) + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning, error = None, None
        if text.startswith(THINK_OPEN) or THINK_CLOSE in text:
            reasoning, text, error = split_reasoning(text.removeprefix(THINK_OPEN))
            if error:
                return AssistantTurn(content="", reasoning=reasoning.strip("\n"), parse_error=error)
            reasoning, text = reasoning.strip("\n"), text.lstrip("\n")
        content, calls, error = parse_hermes_turn(text)
        return AssistantTurn(content=content, reasoning=reasoning, tool_calls=calls, parse_error=error)

    # ---- the template, in Python ------------------------------------------------------------------
    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n" + ("" if self.enable_thinking else EMPTY_THINK)

    def environment_text(self, messages: list[Message]) -> str:
        return "".join(self._render_message(messages, index, last_query=-1) for index in range(len(messages)))

    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        has_system = bool(messages) and messages[0]["role"] == "system"
        text = ""
        if tools:
            system = messages[0]["content"] + "\n\n" if has_system else ""
            text += chatml_message("system", system + hermes_tools_block(tools))
        elif has_system:
            text += chatml_message("system", messages[0]["content"])
        last_query = last_query_index(messages)
        if last_query is None:
            last_query = len(messages) - 1
        for index in range(1 if has_system else 0, len(messages)):
            text += self._render_message(messages, index, last_query)
        return text

    def _render_message(self, messages: list[Message], index: int, last_query: int) -> str:
        message = messages[index]
        if message["role"] in ("user", "system"):
            return chatml_message(message["role"], message["content"])
        if message["role"] == "tool":
            return render_tool_responses(messages, index)
        content = message["content"]
        reasoning, content = reasoning_and_content(message.get("reasoning_content"), content)
        is_last = index == len(messages) - 1
        if index > last_query and (is_last or reasoning):
            reasoning, shown_content = reasoning.strip("\n"), content.lstrip("\n")
            text = f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{shown_content}"
        else:
            text = f"{IM_START}assistant\n{content}"
        for number, call in enumerate(message_tool_calls(message, index)):
            if number > 0 or content:
                text += "\n"
            text += hermes_tool_call(call)
        return text + f"{IM_END}\n"
