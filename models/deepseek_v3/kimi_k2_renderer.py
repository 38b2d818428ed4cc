"""Kimi K2's chat format, as the Kimi-K2-Thinking chat template renders it.

Kimi K2 checkpoints are served through the deepseek_v3 family (their config's model_type
`kimi_k2` is not registered, so the renderer is chosen by name: `environment.renderer: kimi_k2`).

Every message is `{role token}{name}<|im_middle|>{body}<|im_end|>`: `<|im_user|>user`,
`<|im_assistant|>assistant`, `<|im_system|>system`, and `<|im_system|>{name}` for a tool result
(a message's "name", when it has one, replaces its role's name). The prompt opens with the tools
as a JSON list in a `<|im_system|>tool_declare<|im_middle|>` message and, when the conversation
does not open with a system message, the default one; it ends with
`<|im_assistant|>assistant<|im_middle|>`. The model samples `<think>{reasoning}</think>`, the
content, then its calls, and stops at `<|im_end|>`:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>

A call's id is `functions.NAME:IDX`; a tool result is `## Return of {tool_call_id}\\n{result}`.

Where the template is not prefix-preserving: it keeps the reasoning only of the assistant turns
after the conversation's last turn without tool calls; that turn and every one before it are
rendered with an empty `<think></think>`. So a final answer is rendered without the reasoning it
was sampled with, and once one is in the conversation the reasoning of every earlier turn is
dropped too; the trajectory keeps what was sampled.
"""

from __future__ import annotations

import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    delimited_tool_calls,
    message_role,
    message_text,
    message_tool_calls,
    parse_arguments,
    require_stop,
    split_reasoning,
    split_stop,
    template_json,
)
from archon.models.deepseek_v3.renderer import raw_arguments

DEFAULT_SYSTEM = "You are Kimi, an AI assistant created by Moonshot AI."
IM_END, IM_MIDDLE = "<|im_end|>", "<|im_middle|>"
ROLE_TOKENS = {
    "system": "<|im_system|>",
    "user": "<|im_user|>",
    "assistant": "<|im_assistant|>",
    "tool": "<|im_system|>",
}
SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
GENERATION_PROMPT = "<|im_assistant|>assistant" + IM_MIDDLE

_CALL_ID = re.compile(r"functions\.(?P<name>.+):(?P<index>\d+)")


@register_renderer
class KimiK2Renderer(Renderer):
    name = "kimi_k2"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._im_end = self.token_id(IM_END)
        for token in (
            *set(ROLE_TOKENS.values()),
            IM_MIDDLE,
            "<think>",
            "</think>",
            SECTION_BEGIN,
            SECTION_END,
            CALL_BEGIN,
            ARGUMENT_BEGIN,
            CALL_END,
        ):
            self.token_id(token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._im_end,)

    # ---- rendering ----------------------------------------------------------------------------------
    @staticmethod
    def message_header(message: Message, role: str) -> str:
        return ROLE_TOKENS[role] + (message.get("name") or role) + IM_MIDDLE

    @staticmethod
    def tool_result_text(message: Message, index: int) -> str:
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ValueError(
                f"message {index} (tool): no 'tool_call_id'; the kimi_k2 format names the call a result answers "
                f"(functions.NAME:IDX, the id the model gave the call)"
            )
        return f"## Return of {call_id}\n{message_text(message, index)}"

    def assistant_text(self, message: Message, index: int, keep_reasoning: bool) -> str:
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise ValueError(f"message {index} (assistant): reasoning_content must be a string, not {reasoning!r}")
        text = "<think>" + ((reasoning or "") if keep_reasoning else "") + "</think>" + message_text(message, index)
        if message.get("tool_calls"):
            calls = message_tool_calls(message, index)
            text += SECTION_BEGIN
            for number, (call, arguments) in enumerate(zip(calls, raw_arguments(message, index))):
                if not call.id:
                    raise ValueError(
                        f"message {index}: tool call {number} ({call.name}) has no 'id'; the kimi_k2 format writes "
                        "each call with its id (functions.NAME:IDX, as the model samples it)"
                    )
                text += f"{CALL_BEGIN}{call.id}{ARGUMENT_BEGIN}{arguments}{CALL_END}"
            text += SECTION_END
        return text

    def messages_text(self, messages: list[Message], reasoning_from: int) -> str:
        """The messages as the template renders them, the reasoning kept from index `reasoning_from` on."""
        text = ""
        for index, message in enumerate(messages):
            role = message_role(message, index)
            if role not in ROLE_TOKENS:
                raise ValueError(
                    f"message {index}: role {role!r} is not one the kimi_k2 format renders ({sorted(ROLE_TOKENS)})"
                )
            text += self.message_header(message, role)
            if role == "assistant":
                text += self.assistant_text(message, index, keep_reasoning=index >= reasoning_from)
            elif role == "tool":
                text += self.tool_result_text(message, index)
            else:
                text += message_text(message, index)
            text += IM_END
        return text

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        text = ""
        if tools:
            text += "<|im_system|>tool_declare" + IM_MIDDLE + template_json(tools) + IM_END
        if not messages or message_role(messages[0], 0) != "system":
            text += "<|im_system|>system" + IM_MIDDLE + DEFAULT_SYSTEM + IM_END
        # the template keeps the reasoning of the turns after the last assistant turn without tool calls
        final_answers = [
            i for i, m in enumerate(messages) if message_role(m, i) == "assistant" and not m.get("tool_calls")
        ]
        reasoning_from = final_answers[-1] + 1 if final_answers else 0
        return self.encode(text + self.messages_text(messages, reasoning_from) + GENERATION_PROMPT)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        for index, message in enumerate(messages):
            if message_role(message, index) not in ("tool", "user"):
                raise ValueError(
                    f"message {index}: an environment adds tool results and user turns, "
                    f"not {message['role']!r} messages"
                )
        return self.encode(self.messages_text(messages, reasoning_from=0) + GENERATION_PROMPT)

    # ---- reading a sampled turn ---------------------------------------------------------------------
    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        body_ids, _ = split_stop(self, sampled_ids)
        text = self.decode(body_ids)
        errors: list[str] = []
        reasoning = None
        if text.startswith("<think>"):
            reasoning, rest, error = split_reasoning(text[len("<think>") :])
            if error is None:
                text = rest
            else:
                errors.append("<think> is not closed by </think>")
                text = ""
        content, bodies = delimited_tool_calls(text, SECTION_BEGIN, SECTION_END, CALL_BEGIN, CALL_END, errors)
        calls: list[ToolCall] = []
        for index, body in bodies:
            call_id, separated, arguments_text = body.partition(ARGUMENT_BEGIN)
            if not separated:
                errors.append(f"tool call {index} has no {ARGUMENT_BEGIN} between its id and arguments: {body!r}")
                continue
            match = _CALL_ID.fullmatch(call_id)
            if match is None:
                errors.append(
                    f"tool call {index}: id {call_id!r} is not functions.NAME:IDX (a function name and a call index)"
                )
                continue
            arguments, error = parse_arguments(arguments_text, match.group("name"))
            if error:
                errors.append(error)
            else:
                calls.append(ToolCall(match.group("name"), arguments, call_id))
        return AssistantTurn(
            content=content, reasoning=reasoning, tool_calls=calls, parse_error="; ".join(errors) or None
        )
