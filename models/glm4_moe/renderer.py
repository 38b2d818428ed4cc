"""GLM-4.5's chat format, as the family's chat template renders it.

The prompt opens with `[gMASK]<sop>`; with tools, a `<|system|>` message lists them as JSON lines in
`<tools></tools>` and asks for calls in the XML-like syntax. Messages are `<|system|>\\n{text}`,
`<|user|>\\n{text}`, `<|assistant|>` and `<|observation|>` (tool results); the prompt ends with
`<|assistant|>`. A turn is `\\n<think>{reasoning}</think>`, `\\n{content}`, then its calls:

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    </tool_call>

a string VALUE written as it is, any other value as JSON. The model ends a turn with the next
message's role token (`<|observation|>` before tool results, `<|user|>`) or `<|endoftext|>`; the
bridge writes the rest of that message. Consecutive tool results share one `<|observation|>`, each
in `\\n<tool_response>\\n{result}\\n</tool_response>`.

Reading a value back: a parameter the last rendered tools declare a string stays text; any other
is read as JSON (text when it is not JSON and the parameter's type is not declared).

Where the template is not prefix-preserving:
- it drops the reasoning of every assistant turn before the last user message (`<think></think>`),
  so a user turn in the environment's messages changes how earlier turns are rendered; the
  trajectory keeps the sampled reasoning;
- it strips the whitespace around reasoning and content, which a sampled turn may have;
- a turn that stopped with another token than the next message's role token (say `<|user|>`
  before tool results) is followed by the whole next message, role token included.

Options: enable_thinking (True; False appends `/nothink` to user turns and opens the assistant
turn with an empty `<think></think>`, as the template does).
"""

from __future__ import annotations

import json
import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    check_environment_messages,
    message_reasoning,
    message_role,
    message_text,
    message_tool_calls,
    reasoning_and_content,
    require_stop,
    split_reasoning,
    template_json,
    turn_text,
)

TOOLS_PREAMBLE = (
    "<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
)
TOOLS_INSTRUCTIONS = (
    "</tools>\n\nFor each function call, output the function name and arguments within the following XML format:\n"
    "<tool_call>{function-name}\n<arg_key>{arg-key-1}</arg_key>\n<arg_value>{arg-value-1}</arg_value>\n"
    "<arg_key>{arg-key-2}</arg_key>\n<arg_value>{arg-value-2}</arg_value>\n...\n</tool_call>"
)
_ARGUMENT = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@register_renderer
class Glm45Renderer(Renderer):
    name = "glm4_5"
    tools_instructions = TOOLS_INSTRUCTIONS

    def __init__(self, tokenizer, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking
        self._role_tokens = {
            role: self.token_id(f"<|{role}|>") for role in ("user", "observation", "assistant", "system")
        }
        self._endoftext = self.token_id("<|endoftext|>")
        self._parameter_types: dict[str, dict[str, str]] = {}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._role_tokens["user"], self._role_tokens["observation"], self._endoftext)

    # ---- rendering ----------------------------------------------------------------------------------
    def generation_prompt(self) -> str:
        return "<|assistant|>" + ("" if self.enable_thinking else "\n<think></think>")

    def user_text(self, message: Message, index: int) -> str:
        content = message_text(message, index)
        if not self.enable_thinking and not content.endswith("/nothink"):
            content += "/nothink"
        return f"<|user|>\n{content}"

    @staticmethod
    def tool_text(message: Message, index: int, opens_group: bool) -> str:
        return (
            "<|observation|>" if opens_group else ""
        ) + f"\n<tool_response>\n{message_text(message, index)}\n</tool_response>"

    @staticmethod
    def assistant_text(message: Message, index: int, keeps_reasoning: bool) -> str:
        content = message_text(message, index)
        reasoning, content = reasoning_and_content(message_reasoning(message), content)
        text = "<|assistant|>" + (
            f"\n<think>{reasoning.strip()}</think>" if keeps_reasoning and reasoning else "\n<think></think>"
        )
        if content.strip():
            text += "\n" + content.strip()
        for call in message_tool_calls(message, index):
            text += f"\n<tool_call>{call.name}\n"
            for key, value in call.arguments.items():
                text += (
                    f"<arg_key>{key}</arg_key>\n"
                    f"<arg_value>{value if isinstance(value, str) else template_json(value)}</arg_value>\n"
                )
            text += "</tool_call>"
        return text

    def messages_text(self, messages: list[Message], previous_role: str | None, last_user_index: int) -> str:
        text = ""
        for index, message in enumerate(messages):
            role = message_role(message, index)
            if role == "user":
                text += self.user_text(message, index)
            elif role == "assistant":
                text += self.assistant_text(message, index, keeps_reasoning=index > last_user_index)
            elif role == "tool":
                text += self.tool_text(message, index, opens_group=previous_role != "tool")
            elif role == "system":
                text += self.system_text(message, index)
            else:
                raise ValueError(f"message {index}: role {role!r} is not one the {self.name} format renders")
            previous_role = role
        return text

    def system_text(self, message: Message, index: int) -> str:
        return f"<|system|>\n{message_text(message, index)}"

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        text = "[gMASK]<sop>"
        self._parameter_types = {}
        if tools:
            text += TOOLS_PREAMBLE + "".join(template_json(tool) + "\n" for tool in tools) + self.tools_instructions
            for tool in tools:
                function = tool.get("function", {}) if isinstance(tool, dict) else {}
                properties = (function.get("parameters") or {}).get("properties") or {}
                self._parameter_types[function.get("name")] = {
                    key: spec.get("type") for key, spec in properties.items() if isinstance(spec, dict)
                }
        last_user = max(
            (i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), default=-1
        )
        return self.encode(text + self.messages_text(messages, None, last_user) + self.generation_prompt())

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        stop = require_stop(self, sampled_ids)
        check_environment_messages(messages)
        text = self.messages_text(messages, "assistant", last_user_index=-1)
        if messages:
            opening = "<|observation|>" if messages[0]["role"] == "tool" else "<|user|>"
            if stop == self._role_tokens[opening.strip("<|>")]:
                text = text[len(opening) :]  # the model sampled the next message's role token
        return self.encode(text + self.generation_prompt())

    # ---- reading a sampled turn ---------------------------------------------------------------------
    def argument_value(self, function: str, key: str, value: str) -> tuple[object, str | None]:
        declared = self._parameter_types.get(function, {}).get(key)
        if declared == "string":
            return value, None
        try:
            return json.loads(value), None
        except json.JSONDecodeError:
            if declared is None:
                return value, None
            return (
                None,
                f"tool call {function!r}: argument {key!r} is declared {declared} but its value is not JSON: {value!r}",
            )

    def parse_call(self, body: str, errors: list[str]) -> ToolCall | None:
        name, _, arguments_text = body.partition("\n")
        if "<arg_key>" in name:
            name, arguments_text = (
                name[: name.index("<arg_key>")],
                name[name.index("<arg_key>") :] + "\n" + arguments_text,
            )
        name = name.strip()
        if not name:
            errors.append(f"a tool call has no function name: {body!r}")
            return None
        arguments: dict = {}
        position = 0
        for match in _ARGUMENT.finditer(arguments_text):
            if match.start() != position:
                break
            value, error = self.argument_value(name, match.group(1), match.group(2))
            if error:
                errors.append(error)
                return None
            arguments[match.group(1)] = value
            position = match.end()
        if arguments_text[position:].strip():
            errors.append(
                f"tool call {name!r}: unreadable arguments {arguments_text[position:]!r} "
                "(expected <arg_key>..</arg_key><arg_value>..</arg_value> pairs)"
            )
            return None
        return ToolCall(name, arguments)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        errors: list[str] = []
        reasoning = None
        stripped = text.lstrip("\n")
        if stripped.startswith("<think>"):
            inner, rest, error = split_reasoning(stripped[len("<think>") :])
            if error:
                errors.append("<think> is not closed by </think>")
                return AssistantTurn(content="", reasoning=inner, parse_error=errors[0])
            reasoning, text = inner or None, rest
        content, _, calls_text = text.partition("<tool_call>")
        calls: list[ToolCall] = []
        if _:
            for number, part in enumerate(("<tool_call>" + calls_text).split("<tool_call>")[1:]):
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
