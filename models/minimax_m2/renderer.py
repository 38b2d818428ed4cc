"""The MiniMax-M2 chat format, as its chat template writes it.

    ]~!b[]~b]system
    SYSTEM

    # Tools ... <tools>
    <tool>{the function's JSON}</tool>
    </tools> ... [e~[
    ]~b]user
    QUESTION[e~[
    ]~b]ai
    <think>
    REASONING
    </think>

    CONTENT
    <minimax:tool_call>
    <invoke name="NAME">
    <parameter name="KEY">VALUE</parameter>
    </invoke>
    </minimax:tool_call>[e~[
    ]~b]tool
    <response>RESULT</response>
    <response>RESULT</response>[e~[
    ]~b]ai
    <think>

The system turn is always written (the system message, else "You are a helpful assistant."), the
tools after a blank line. The calls follow the content after a newline; a call's value is written
as its text when it is a string and as JSON otherwise, so parse_turn reads each value by its
parameter's schema in the tools last offered to render_prompt (chat_format.typed_argument).
Consecutive tool results share one `]~b]tool` turn. A turn ends with `[e~[`, after which the
template writes "\\n". The generation prompt opens the reasoning (`]~b]ai\\n<think>\\n`), so the
model samples `REASONING\\n</think>\\n\\nCONTENT...`. No options: the template has no thinking
switch.

Where the template is not prefix-preserving:
- it writes a turn's reasoning only while no user message follows the turn: once one does, every
  earlier turn is rendered as `]~b]ai\\nCONTENT...`, without `<think>\\nREASONING\\n</think>\\n\\n`;
- a turn sampled with empty reasoning (`\\n</think>\\n\\n...`) is rendered without the block at once.
"""

from __future__ import annotations

import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
    check_environment_messages,
    check_messages,
    message_tool_calls,
    require_stop,
    split_reasoning,
    template_json,
    tool_parameter_schemas,
    turn_text,
    typed_argument,
)

BEGIN = "]~!b["
ROLE = "]~b]"
END = "[e~["
CALLS_OPEN = "<minimax:tool_call>"
CALLS_CLOSE = "</minimax:tool_call>"
DEFAULT_SYSTEM = "You are a helpful assistant."
GENERATION_PROMPT = f"{ROLE}ai\n{THINK_OPEN}\n"
TOOLS_HEADER = (
    "\n\n# Tools\nYou may call one or more tools to assist with the user query.\n"
    "Here are the tools available in JSONSchema format:\n\n<tools>\n"
)
TOOLS_INSTRUCTIONS = (
    "</tools>\n\nWhen making tool calls, use XML format to invoke tools and pass parameters:\n"
    f'\n{CALLS_OPEN}\n<invoke name="tool-name-1">\n<parameter name="param-key-1">param-value-1</parameter>\n'
    f'<parameter name="param-key-2">param-value-2</parameter>\n...\n</invoke>\n{CALLS_CLOSE}'
)
_INVOKE = re.compile(r'<invoke name="([^"\n]*)">\n(.*?)</invoke>\n', re.S)
_PARAMETER = re.compile(r'<parameter name="([^"\n]*)">(.*?)</parameter>\n', re.S)


@register_renderer
class MinimaxM2Renderer(Renderer):
    name = "minimax_m2"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        for token in (BEGIN, ROLE, THINK_OPEN, THINK_CLOSE, CALLS_OPEN, CALLS_CLOSE):
            self.token_id(token)
        self._end = self.token_id(END)
        self._parameter_schemas: dict[str, dict] = {}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._end,)

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        system, conversation = None, messages
        if messages and messages[0]["role"] == "system":
            system, conversation = messages[0], messages[1:]
        for index, message in enumerate(conversation):
            if message["role"] == "system":
                raise ValueError(
                    f"renderer {self.name!r}: message {index + len(messages) - len(conversation)} is a system "
                    f"message; the template renders only the first message as one"
                )
        text = f"{BEGIN}{ROLE}system\n" + (system["content"] if system and system["content"] else DEFAULT_SYSTEM)
        if tools:
            self._parameter_schemas = tool_parameter_schemas(tools)
            text += TOOLS_HEADER + "".join(f"<tool>{template_json(_function(tool))}</tool>\n" for tool in tools)
            text += TOOLS_INSTRUCTIONS
        text += f"{END}\n" + self._messages_text(conversation, with_calls=False) + GENERATION_PROMPT
        return self.encode(text)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_environment_messages(messages)
        check_messages(self.name, messages, roles=("user", "tool"))
        if messages and messages[0]["role"] == "tool" and not self.parse_turn(sampled_ids).tool_calls:
            raise ValueError(
                f"renderer {self.name!r}: message 0 is a tool result, but the sampled turn made no tool call "
                f"(the template refuses a tool message after a turn without one)"
            )
        return self.encode("\n" + self._messages_text(messages, with_calls=True) + GENERATION_PROMPT)

    # ---- the template, in Python ------------------------------------------------------------------
    def _messages_text(self, messages: list[Message], with_calls: bool) -> str:
        """`messages` (no system message) as the template writes them. with_calls: the turn before
        them made tool calls (the template raises on a tool result that follows a turn without any)."""
        users = [index for index, message in enumerate(messages) if message["role"] == "user"]
        last_user = users[-1] if users else -1
        text = ""
        for index, message in enumerate(messages):
            role = message["role"]
            if role == "user":
                text += f"{ROLE}user\n{message['content']}{END}\n"
            elif role == "assistant":
                text += self._assistant_text(message, index, keep_reasoning=index > last_user)
                with_calls = bool(message.get("tool_calls"))
            else:
                if not with_calls:
                    raise ValueError(
                        f"renderer {self.name!r}: message {index} is a tool result with no assistant turn with "
                        f"tool calls before it"
                    )
                if index == 0 or messages[index - 1]["role"] != "tool":
                    text += f"{ROLE}tool"
                text += f"\n<response>{message['content']}</response>"
                if index == len(messages) - 1 or messages[index + 1]["role"] != "tool":
                    text += f"{END}\n"
        return text

    def _assistant_text(self, message: Message, index: int, keep_reasoning: bool) -> str:
        content, reasoning = message["content"], message.get("reasoning_content")
        if not isinstance(reasoning, str):
            reasoning = ""
            if THINK_CLOSE in content:
                head, content = content.split(THINK_CLOSE)[0], content.split(THINK_CLOSE)[-1].strip("\n")
                reasoning = head.strip("\n").split(THINK_OPEN)[-1].strip("\n")
        text = f"{ROLE}ai\n"
        if reasoning and keep_reasoning:
            text += f"{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n"
        text += content
        calls = message_tool_calls(message, index)
        if calls:
            text += f"\n{CALLS_OPEN}\n" + "".join(_invoke(call) for call in calls) + CALLS_CLOSE
        return text + f"{END}\n"

    # ---- reading a turn back ------------------------------------------------------------------------
    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        reasoning, text, error = split_reasoning(turn_text(self, sampled_ids))
        if error:
            return AssistantTurn(content="", reasoning=reasoning, parse_error=error)
        reasoning, text = reasoning.removesuffix("\n"), text.removeprefix("\n\n")
        content, opened, section = text.partition(CALLS_OPEN)
        if not opened:
            return AssistantTurn(content=content, reasoning=reasoning)
        content = content.removesuffix("\n")  # the template writes a newline before the calls
        calls, errors = self._parse_calls(section)
        return AssistantTurn(content=content, reasoning=reasoning, tool_calls=calls, parse_error=errors or None)

    def _parse_calls(self, section: str) -> tuple[list[ToolCall], str]:
        """The calls of a `<minimax:tool_call>` section (its text after the opening tag): the calls
        that parse, and what is malformed ("" when nothing is)."""
        body, closed, after = section.partition(CALLS_CLOSE)
        errors = [] if closed else [f"the tool calls are not closed by {CALLS_CLOSE}"]
        if after.strip():
            errors.append(f"text after {CALLS_CLOSE}: {after.strip()[:80]!r}")
        if not body.startswith("\n"):
            errors.append(f"no newline after {CALLS_OPEN}")
        calls, at = [], 1
        while at < len(body):
            match = _INVOKE.match(body, at)
            if match is None:
                errors.append(f"tool call {len(calls) + 1} is not an <invoke> block: {body[at : at + 80]!r}")
                break
            call, error = self._parse_invoke(match.group(1), match.group(2), len(calls) + 1)
            if error is not None:
                errors.append(error)
            else:
                calls.append(call)
            at = match.end()
        return calls, "; ".join(errors)

    def _parse_invoke(self, name: str, body: str, number: int) -> tuple[ToolCall | None, str | None]:
        if not name:
            return None, f"tool call {number} has an empty function name"
        schemas = self._parameter_schemas.get(name, {})
        arguments, at = {}, 0
        while at < len(body):
            match = _PARAMETER.match(body, at)
            if match is None:
                return None, f"tool call {number} ({name}): text outside a parameter: {body[at : at + 80]!r}"
            key, value_text = match.groups()
            if key in arguments:
                return None, f"tool call {number} ({name}): parameter {key!r} is given twice"
            value, error = typed_argument(value_text, schemas.get(key))
            if error is not None:
                return None, f"tool call {number} ({name}): parameter {key!r}: {error}"
            arguments[key] = value
            at = match.end()
        return ToolCall(name=name, arguments=arguments), None


def _function(tool: dict) -> dict:
    """A tool's function as the template writes it (`tool.function`): OpenAI function tools only."""
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"renderer 'minimax_m2': a tool must be an OpenAI function tool "
            f"({{'type': 'function', 'function': {{'name', ...}}}}), got {tool!r}"
        )
    return function


def _invoke(call: ToolCall) -> str:
    parameters = "".join(
        f'<parameter name="{key}">{value if isinstance(value, str) else template_json(value)}</parameter>\n'
        for key, value in call.arguments.items()
    )
    return f'<invoke name="{call.name}">\n{parameters}</invoke>\n'
