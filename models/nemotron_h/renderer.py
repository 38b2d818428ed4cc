"""The chat format of NVIDIA-Nemotron-Nano-9B-v2 (model_type nemotron_h), as its chat template writes it.

    <SPECIAL_10>System
    SYSTEM

    You can use the following tools to assist the user if required:
    <AVAILABLE_TOOLS>[{function JSON}, ...]</AVAILABLE_TOOLS>
    ...the calling instructions...

    <SPECIAL_11>User
    QUESTION
    <SPECIAL_11>Assistant
    <think>

    REASONING</think>CONTENT

    <TOOLCALL>[{"name": "NAME", "arguments": {...}}, ...]</TOOLCALL>
    <SPECIAL_12>

    <SPECIAL_11>User
    <TOOL_RESPONSE>[RESULT, RESULT]</TOOL_RESPONSE>

    <SPECIAL_11>Assistant
    <think>

The system turn is always written (empty without a system message); a user turn has no end token,
only a newline; consecutive tool results share one user turn, joined by ", ". The generation prompt
opens the reasoning (`<think>\\n\\n`), or closes it empty (`<think></think>`) when the last user or
system message holding `/think` or `/no_think` holds `/no_think` (the template's only switch; it
removes both strings from user and system text). The model samples `REASONING</think>` (thinking),
the content, the calls, then `\\n<SPECIAL_12>`; the template writes `\\n\\n` after it.

Where the template is not prefix-preserving:
- an assistant turn in history is written without reasoning and without the `<think>` opening of the
  generation prompt it was sampled after: `<SPECIAL_11>Assistant\\n{content}...`; the content is
  stripped (and, holding `</think>`, cut to what follows it);
- a conversation ending with an assistant turn is written as a prefill (that turn's content after a
  generation prompt, its calls in a turn of their own); render_prompt refuses such a conversation.

A system message other than the first is dropped by the template; the renderer refuses it.
"""

from __future__ import annotations

import json

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    call_function,
    check_environment_messages,
    message_role,
    message_text,
    require_stop,
    split_reasoning,
    template_json,
    turn_text,
)

SYSTEM, USER, ASSISTANT, END = "<SPECIAL_10>System\n", "<SPECIAL_11>User\n", "<SPECIAL_11>Assistant\n", "<SPECIAL_12>"
CALLS_OPEN, CALLS_CLOSE = "<TOOLCALL>[", "]</TOOLCALL>"
# The template writes the doubled braces as they are.
TOOLS_INSTRUCTIONS = (
    "]</AVAILABLE_TOOLS>\n\nIf you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{{"name": "tool_name1", "arguments": "tool_args1"}}, '
    '{{"name": "tool_name2", "arguments": "tool_args2"}}]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{{"tool_response1"}}, {{"tool_response2"}}]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool calls if any errors are "
    "found, or just respond to the user."
)


def without_switches(text: str) -> str:
    """A user or system text as the template writes it: `/think` and `/no_think` removed, stripped."""
    return text.replace("/think", "").replace("/no_think", "").strip()


def thinking_after(messages: list[Message], thinking: bool) -> bool:
    """The template's switch after `messages`: the last user or system message holding `/think` or
    `/no_think` decides (`/think` first when it holds both); `thinking` when none does."""
    for index, message in enumerate(messages):
        if message_role(message, index) in ("user", "system"):
            text = message_text(message, index)
            if "/think" in text:
                thinking = True
            elif "/no_think" in text:
                thinking = False
    return thinking


def calls_text(message: Message, index: int) -> str:
    """An assistant message's calls as the template writes them: arguments given as a string as they
    are, an object as JSON."""
    written = []
    for number, call in enumerate(message.get("tool_calls") or []):
        function = call_function(call)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise ValueError(f"message {index}: tool call {number} has no function name: {call!r}")
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise ValueError(
                f"message {index}: tool call {number} ({function['name']}): arguments must be an object or its "
                f"JSON text, not {arguments!r}"
            )
        arguments_text = arguments if isinstance(arguments, str) else template_json(arguments)
        written.append(f'{{"name": "{function["name"]}", "arguments": {arguments_text}}}')
    return CALLS_OPEN + ", ".join(written) + CALLS_CLOSE


def assistant_text(message: Message, index: int) -> str:
    """An assistant turn in history, from its header to the template's `\\n\\n` after the end token."""
    content = message_text(message, index)
    if THINK_CLOSE in content:
        content = content.split(THINK_CLOSE)[1]
    content = content.strip()
    text = ASSISTANT + content
    if message.get("tool_calls"):
        text += ("\n\n" if content else "") + calls_text(message, index)
    return text + "\n" + END + "\n\n"


def messages_text(messages: list[Message], after_tool: bool = False) -> str:
    """User, tool and assistant messages as the template's loop writes them; after_tool: the message
    before them was a tool result (its group is open)."""
    text = ""
    for index, message in enumerate(messages):
        role = message_role(message, index)
        is_tool = role == "tool"
        if is_tool:
            text += (", " if after_tool else USER + "<TOOL_RESPONSE>[") + message_text(message, index)
        elif after_tool:
            text += "]</TOOL_RESPONSE>\n\n"
        if role == "user":
            text += USER + without_switches(message_text(message, index)) + "\n"
        elif role == "assistant":
            text += assistant_text(message, index)
        elif not is_tool:
            raise ValueError(
                f"message {index}: the Nemotron-H template writes a {role!r} message only as the first message "
                "(a system message) and drops any other"
                if role == "system"
                else f"message {index}: role {role!r} is not one the Nemotron-H format renders"
            )
        after_tool = is_tool
    return text + ("]</TOOL_RESPONSE>\n\n" if after_tool else "")


def tools_text(tools: list[dict]) -> str:
    functions = []
    for i, tool in enumerate(tools):
        function = call_function(tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"tool {i} is not a function tool with a name: {tool!r}")
        functions.append(template_json(function))
    return (
        "You can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>["
        + ", ".join(functions)
        + TOOLS_INSTRUCTIONS
    )


@register_renderer
class NemotronNanoV2Renderer(Renderer):
    name = "nemotron_nano_v2"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._end = self.token_id(END)
        for token in ("<SPECIAL_10>", "<SPECIAL_11>", "<think>", THINK_CLOSE):
            self.token_id(token)
        # Whether the last generation prompt opened the reasoning: the template's switch, read from the
        # conversation by render_prompt and bridge; parse_turn reads a turn by it.
        self.thinking = True

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._end,)

    def generation_prompt(self) -> str:
        return ASSISTANT + ("<think>\n\n" if self.thinking else "<think></think>")

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if not messages:
            raise ValueError("renderer 'nemotron_nano_v2': the template needs at least one message")
        if message_role(messages[-1], len(messages) - 1) == "assistant":
            raise ValueError(
                "renderer 'nemotron_nano_v2': the conversation ends with an assistant message, which the template "
                "writes as a prefill of the next turn; end it with a user message or tool results"
            )
        self.thinking = thinking_after(messages, True)
        opens_with_system = message_role(messages[0], 0) == "system"
        system = without_switches(message_text(messages[0], 0)) if opens_with_system else ""
        text = SYSTEM + system
        if tools:
            text += ("\n\n" if system else "") + tools_text(tools)
        text += "\n\n" + messages_text(messages[1:] if opens_with_system else messages)
        return self.encode(text + self.generation_prompt())

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_environment_messages(messages)
        self.thinking = thinking_after(messages, self.thinking)
        return self.encode("\n\n" + messages_text(messages) + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning = None
        if self.thinking:
            reasoning, text, error = split_reasoning(text)
            if error:
                return AssistantTurn(content="", reasoning=reasoning, parse_error=error)
        content, opened, calls_part = text.partition(CALLS_OPEN)
        calls: list[ToolCall] = []
        errors: list[str] = []
        if opened:
            listed, closed, after = calls_part.partition(CALLS_CLOSE)
            if not closed:
                errors.append(f"the tool calls are not closed by {CALLS_CLOSE}")
            elif after.strip():
                errors.append(f"text after {CALLS_CLOSE}: {after.strip()[:80]!r}")
            else:
                calls = parse_calls("[" + listed + "]", errors)
        return AssistantTurn(
            content=content.strip(), reasoning=reasoning, tool_calls=calls, parse_error="; ".join(errors) or None
        )


def parse_calls(text: str, errors: list[str]) -> list[ToolCall]:
    """`[{"name": ..., "arguments": {...}}, ...]` -> the calls; what is wrong is added to `errors`."""
    try:
        listed = json.loads(text)
    except json.JSONDecodeError as e:
        errors.append(f"the tool calls are not a JSON list ({e.msg} at column {e.colno}): {text[:80]!r}")
        return []
    calls = []
    for number, item in enumerate(listed):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            errors.append(f"tool call {number} is not an object with a name: {item!r}")
        elif not isinstance(item.get("arguments", {}), dict):
            errors.append(f"tool call {number} ({item['name']}): arguments are not an object: {item['arguments']!r}")
        else:
            calls.append(ToolCall(item["name"], item.get("arguments", {})))
    return calls
