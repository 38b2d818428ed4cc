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
(`<|assistant|></think>`), as the template does.

Where the template is not prefix-preserving:
- it writes the reasoning of a turn only while no user message follows it (the template's
  `clear_thinking`, on by default): once one does, the turn is rendered `<|assistant|></think>...`;
- it strips the whitespace around reasoning and content, and writes a turn with empty reasoning as
  `<|assistant|></think>`, not `<|assistant|><think></think>`;
- a turn that stopped with another token than the next message's role token is followed by the
  whole next message, role token included.

DeepSeek-V3.2 (model_type deepseek_v32) ships its prompt encoding as Python (`encoding_dsv32.py`), not
as a chat template; renderer `deepseek_v32` below writes it:

    <｜begin▁of▁sentence｜>SYSTEM

    ## Tools ... <functions>
    {"name": "search", ...}
    </functions>
    <｜User｜>QUESTION<｜Assistant｜></think>CONTENT

    <｜DSML｜function_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">VALUE</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜function_calls><｜end▁of▁sentence｜>

    <function_results>
    <result>RESULT</result>
    </function_results>

    </think>

A string value is written as its text (string="true"), any other as JSON (string="false"), so a call
reads back without the tools' schemas. After the results the model continues without an assistant
header. With thinking, the last user turn and every group of results after it open the reasoning
(`<think>` where `</think>` is written otherwise) and the turns after the last user message are
`REASONING</think>CONTENT...`. The tools go after the conversation's opening system message (the
encoding takes them as that message's `tools`), or open the prompt when there is none.

Where the encoding is not prefix-preserving (thinking only; without it the trajectory is the
encoding of the whole conversation): once a user message follows, the turns before it lose their
reasoning and the `<think>` before them becomes `</think>`.
"""

from __future__ import annotations

import json
import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
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
            reasoning, text, error = split_reasoning(text)
            if error:
                return AssistantTurn(content="", reasoning=reasoning, parse_error=error)
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


# ---- DeepSeek-V3.2 ---------------------------------------------------------------------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
DSML = "｜DSML｜"
CALLS_OPEN, CALLS_CLOSE = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
INVOKE_OPEN, INVOKE_CLOSE = f'<{DSML}invoke name="', f"</{DSML}invoke>"
PARAMETER_CLOSE = f"</{DSML}parameter>"
_PARAMETER = re.compile(rf'<{DSML}parameter name="(.*?)" string="(true|false)">(.*?){PARAMETER_CLOSE}', re.S)

DSML_TOOLS_HEADER = f"""## Tools
You have access to a set of tools you can use to answer the user's question.
You can invoke functions by writing a "{CALLS_OPEN}" block like the following as part of your reply to the user:
{CALLS_OPEN}
{INVOKE_OPEN}$FUNCTION_NAME">
<{DSML}parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAMETER_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN}$FUNCTION_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}
String and scalar parameters should be specified as is without any escaping or quotes, while lists and objects \
should use JSON format. The "string" attribute should be set to "true" for string type parameters and "false" \
for other types (numbers, booleans, arrays, objects).
If the thinking_mode is enabled, then after function results you should strongly consider outputting a thinking \
block. Here is an example:
{CALLS_OPEN}
...
{CALLS_CLOSE}
<function_results>
...
</function_results>
{THINK_OPEN}...thinking about results{THINK_CLOSE}
Here are the functions available in JSONSchema format:
<functions>
"""


def dsml_tools_text(tools: list[dict]) -> str:
    """The tools block DeepSeek-V3.2 appends to the system prompt: how to call, then one function
    schema (JSON) a line."""
    schemas = []
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tool {i} is not an OpenAI function tool "
                f"({{'type': 'function', 'function': {{'name', ...}}}}): {tool!r}"
            )
        schemas.append(template_json(function))
    return DSML_TOOLS_HEADER + "\n".join(schemas) + "\n</functions>\n"


def dsml_calls_text(calls: list[ToolCall]) -> str:
    """A turn's calls after its content: a string value as its text (string="true"), any other as JSON."""
    invokes = []
    for call in calls:
        parameters = [
            f'<{DSML}parameter name="{key}" string="{"true" if isinstance(value, str) else "false"}">'
            f"{value if isinstance(value, str) else template_json(value)}{PARAMETER_CLOSE}"
            for key, value in call.arguments.items()
        ]
        invokes.append(f'{INVOKE_OPEN}{call.name}">\n' + "\n".join(parameters) + f"\n{INVOKE_CLOSE}")
    return f"\n\n{CALLS_OPEN}\n" + "\n".join(invokes) + f"\n{CALLS_CLOSE}"


def dsml_parse_calls(section: str, errors: list[str]) -> list[ToolCall]:
    """The calls of a `<｜DSML｜function_calls>` section (the text after that tag, its closing tag
    excluded); what is malformed is added to `errors`."""
    calls: list[ToolCall] = []
    rest, number = section, 0
    while INVOKE_OPEN in rest:
        before, _, rest = rest.partition(INVOKE_OPEN)
        if before.strip():
            errors.append(f"text before tool call {number}: {before.strip()!r}")
        name, opened, rest = rest.partition('">')
        body, closed, rest = rest.partition(INVOKE_CLOSE)
        if not opened or not closed:
            errors.append(f"tool call {number} ({name[:40]!r}) is not closed by {INVOKE_CLOSE}")
            return calls
        arguments, ok, end = {}, True, 0
        for match in _PARAMETER.finditer(body):
            if body[end : match.start()].strip():
                errors.append(f"tool call {number} ({name}): text between parameters: {body[end : match.start()]!r}")
            end = match.end()
            key, is_string, value = match.groups()
            if is_string == "true":
                arguments[key] = value
                continue
            try:
                arguments[key] = json.loads(value)
            except json.JSONDecodeError as e:
                errors.append(
                    f'tool call {number} ({name}): parameter {key!r} has string="false" but is not JSON ({e})'
                )
                ok = False
        if body[end:].strip():
            errors.append(f"tool call {number} ({name}): text that is not a parameter: {body[end:].strip()[:80]!r}")
            ok = False
        if not name:
            errors.append(f"tool call {number} has no function name")
        elif ok:
            calls.append(ToolCall(name, arguments))
        number += 1
    if rest.strip():
        errors.append(f"text after the last tool call: {rest.strip()[:80]!r}")
    return calls


@register_renderer
class DeepseekV32Renderer(Renderer):
    """DeepSeek-V3.2's prompt encoding (its `encoding_dsv32.py`), on token ids."""

    name = "deepseek_v32"

    def __init__(self, tokenizer, thinking: bool = False) -> None:
        super().__init__(tokenizer)
        self.thinking = thinking
        self._eos = self.token_id(EOS)
        for token in (BOS, USER, ASSISTANT, THINK_OPEN, THINK_CLOSE):
            self.token_id(token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    def _opening(self, opens_reasoning: bool) -> str:
        """What follows a user turn or a group of tool results: the reasoning opened (thinking, and no
        user message after it yet) or closed."""
        return THINK_OPEN if self.thinking and opens_reasoning else THINK_CLOSE

    def _results_text(self, results: list[str], opens_reasoning: bool) -> str:
        text = "\n\n<function_results>" + "".join(f"\n<result>{result}</result>" for result in results)
        return text + "\n</function_results>\n\n" + self._opening(opens_reasoning)

    def _assistant_text(self, message: Message, index: int, keeps_reasoning: bool) -> str:
        calls = message_tool_calls(message, index)
        text = ""
        if self.thinking and keeps_reasoning:
            text = (message_reasoning(message) or "") + THINK_CLOSE
        text += message_text(message, index)
        return text + (dsml_calls_text(calls) if calls else "") + EOS

    def _messages_text(self, messages: list[Message], calls_before: int) -> tuple[str, str]:
        """The encoding of `messages`, which follow a turn of `calls_before` calls, and what the last
        one is ("user", "results", "assistant", "system", "" for none). Each group of tool results must
        answer every call of the assistant turn before it."""
        last_user = max((i for i, m in enumerate(messages) if message_role(m, i) == "user"), default=-1)
        text, last, pending, results = "", "", calls_before, []
        for index, message in enumerate(messages):
            role = message_role(message, index)
            if role == "tool":
                if len(results) == pending:
                    raise ValueError(
                        f"message {index}: a tool result with no call left to answer (the assistant turn before "
                        f"it made {pending} calls)"
                    )
                results.append(message_text(message, index))
                if len(results) == pending:
                    text += self._results_text(results, opens_reasoning=index >= last_user)
                    last = "results"
                continue
            if results and len(results) < pending:
                raise ValueError(
                    f"message {index}: the assistant turn before it made {pending} calls, answered by only "
                    f"{len(results)} tool results"
                )
            pending, results = 0, []
            if role == "user":
                text += USER + message_text(message, index) + ASSISTANT + self._opening(index == last_user)
            elif role == "assistant":
                pending = len(message.get("tool_calls") or [])
                text += self._assistant_text(message, index, keeps_reasoning=index > last_user)
            elif role == "system":
                text += message_text(message, index)
            else:
                raise ValueError(f"message {index}: role {role!r} is not one the deepseek_v32 format renders")
            last = role
        if results and len(results) < pending:
            raise ValueError(f"the last turn made {pending} calls, answered by only {len(results)} tool results")
        return text, last

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        text, last = self._messages_text(messages, 0)
        if last not in ("user", "results"):
            raise ValueError(
                "renderer 'deepseek_v32': the conversation must end with a user message or the results of the "
                f"last turn's calls (the encoding opens the next turn only after those), not {last or 'nothing'!r}"
            )
        if tools:
            first_is_system = bool(messages) and message_role(messages[0], 0) == "system"
            tools_text = "\n\n" + dsml_tools_text(tools)
            if first_is_system:
                system = message_text(messages[0], 0)
                text = system + tools_text + text[len(system) :]
            else:
                text = tools_text + text
        return self.encode(BOS + text)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_environment_messages(messages)
        text, last = self._messages_text(messages, turn_text(self, sampled_ids).count(INVOKE_OPEN))
        if last not in ("user", "results"):
            raise ValueError("renderer 'deepseek_v32': bridge() needs tool results or a user message to add")
        return self.encode(text)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning = None
        if self.thinking:
            reasoning, text, error = split_reasoning(text)
            if error:
                return AssistantTurn(content="", reasoning=reasoning, parse_error=error)
        content, opened, section = text.partition(CALLS_OPEN)
        errors: list[str] = []
        calls: list[ToolCall] = []
        if opened:
            content = content.removesuffix("\n\n")
            section, closed, after = section.partition(CALLS_CLOSE)
            calls = dsml_parse_calls(section, errors)
            if not closed:
                errors.append(f"the tool calls are not closed by {CALLS_CLOSE}")
            elif after:
                errors.append(f"text after {CALLS_CLOSE}: {after[:80]!r}")
        return AssistantTurn(
            content=content, reasoning=reasoning, tool_calls=calls, parse_error="; ".join(errors) or None
        )
