"""DeepSeek-V3.1's chat format, as the family's chat template renders it.

V3.1 rather than V3-0324: it is the checkpoint of this family trained for agentic tool use, with
the thinking switch, and its calls carry the arguments' JSON bare (0324 wraps them in a Markdown
code block after a `function` type tag).

`<｜begin▁of▁sentence｜>` and the system messages (joined by a blank line), then `<｜User｜>{text}`;
an assistant turn after a user turn opens with `<｜Assistant｜></think>` (`<｜Assistant｜><think>`
when thinking), and a turn ends with `<｜end▁of▁sentence｜>`. Calls follow the turn's content:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

Tool results are `<｜tool▁output▁begin｜>{result}<｜tool▁output▁end｜>`, one after another; after
them the model continues without an assistant header.

V3.1's template renders no tool schemas; its model card declares the tools in a Markdown block
appended to the system prompt after a blank line (`{system prompt}\n\n## Tools\n...`, the blank
line kept with no system message: `<｜begin▁of▁sentence｜>\n\n## Tools...`). `render_prompt(tools=...)`
writes that block as vLLM's template for V3.1 renders it (vllm-project/vllm,
`examples/tool_chat_template_deepseekv31.jinja`): a `### NAME` section per tool with its
description and its parameters as `tojson` writes them, then the calling instructions (that template
writes `{{additional_tool_calls}}` and a blank line after `Where:`). The rest of the prompt is V3.1's.

Where the template is not prefix-preserving: with thinking on, the model samples
`{reasoning}</think>{content}` after `<｜Assistant｜><think>`, and the template renders that turn in
history as `<｜Assistant｜></think>{content}` (the reasoning dropped); the trajectory keeps what was
sampled. Without thinking (the template's default) the template is prefix-preserving.

Options: thinking (False, the template's default).
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    call_function,
    check_environment_messages,
    delimited_tool_calls,
    message_role,
    message_text,
    message_tool_calls,
    parse_arguments,
    require_stop,
    template_json,
    turn_text,
)

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
OUTPUT_BEGIN, OUTPUT_END = "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"


TOOLS_INSTRUCTIONS = (
    "\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\n"
    f"{CALLS_BEGIN}{CALL_BEGIN}tool_call_name{CALL_SEP}tool_call_arguments{CALL_END}{{{{additional_tool_calls}}}}{CALLS_END}\n"
    "\nWhere:\n\n"
    "- `tool_call_name` must be an exact match to one of the available tools\n"
    "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
    "- For multiple tool calls, chain them directly without separators or spaces\n"
)


def tools_text(tools: list[dict]) -> str:
    """The tools' Markdown block that follows the system prompt: a section per tool, then how to call them."""
    text = "## Tools\nYou have access to the following tools:\n"
    for i, tool in enumerate(tools):
        function = call_function(tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tool {i} is not an OpenAI function tool "
                f"({{'type': 'function', 'function': {{'name', ...}}}}): {tool!r}"
            )
        name = function["name"]
        if not isinstance(function.get("description"), str):
            raise ValueError(f"tool {name!r}: the deepseek_v3 format needs a description string")
        if "parameters" not in function:
            raise ValueError(f"tool {name!r}: the deepseek_v3 format needs the parameters' JSON schema")
        text += (
            f"\n### {name}\nDescription: {function['description']}\n\n"
            f"Parameters: {template_json(function['parameters'])}\n"
        )
    return text + TOOLS_INSTRUCTIONS


def raw_arguments(message: Message, index: int) -> list[str]:
    """Each call's arguments as the template writes them: a JSON string as given, an object as JSON."""
    texts = []
    for call, parsed in zip(message["tool_calls"], message_tool_calls(message, index)):
        arguments = call_function(call).get("arguments")
        texts.append(arguments if isinstance(arguments, str) else template_json(parsed.arguments))
    return texts


@register_renderer
class DeepseekV31Renderer(Renderer):
    name = "deepseek_v3"

    def __init__(self, tokenizer, thinking: bool = False) -> None:
        super().__init__(tokenizer)
        self.thinking = thinking
        self._eos = self.token_id(EOS)
        for token in (
            BOS,
            "<｜User｜>",
            "<｜Assistant｜>",
            "</think>",
            "<think>",
            CALLS_BEGIN,
            CALLS_END,
            CALL_BEGIN,
            CALL_SEP,
            CALL_END,
            OUTPUT_BEGIN,
            OUTPUT_END,
        ):
            self.token_id(token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._eos,)

    def generation_prompt(self) -> str:
        return "<｜Assistant｜>" + ("<think>" if self.thinking else "</think>")

    def messages_text(
        self, messages: list[Message], after_user: bool, after_tool: bool, only_system: bool
    ) -> tuple[str, bool, bool, bool]:
        """The template's loop over `messages` from the given state; the text and the state after."""
        text = ""
        for index, message in enumerate(messages):
            role = message_role(message, index)
            if role == "user":
                text += "<｜User｜>" + message_text(message, index)
                after_user, after_tool = True, False
            elif role == "assistant" and message.get("tool_calls") is not None:
                if after_user or only_system:
                    text += "<｜Assistant｜></think>"
                text += ("" if message.get("content") is None else message_text(message, index)) + CALLS_BEGIN
                for call, arguments in zip(message_tool_calls(message, index), raw_arguments(message, index)):
                    text += f"{CALL_BEGIN}{call.name}{CALL_SEP}{arguments}{CALL_END}"
                text += CALLS_END + EOS
                after_user, after_tool = False, False
            elif role == "assistant":
                if after_user:
                    text += "<｜Assistant｜></think>"
                content = message_text(message, index)
                if not after_tool and "</think>" in content:
                    content = content.split("</think>", 1)[1]
                text += content + EOS
                after_user, after_tool = False, False
            elif role == "tool":
                text += OUTPUT_BEGIN + message_text(message, index) + OUTPUT_END
                after_user, after_tool = False, True
            elif role != "system":
                raise ValueError(f"message {index}: role {role!r} is not one the deepseek_v3 format renders")
            if role != "system":
                only_system = False
        return text, after_user, after_tool, only_system

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        systems = [message_text(m, i) for i, m in enumerate(messages) if message_role(m, i) == "system"]
        text, after_user, after_tool, only_system = self.messages_text(messages, False, False, bool(systems))
        system_prompt = "\n\n".join(systems)
        if tools:
            system_prompt += "\n\n" + tools_text(tools)
        prompt = BOS + system_prompt + text
        if not after_tool:
            prompt += self.generation_prompt()
        return self.encode(prompt)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_environment_messages(messages)
        text, _, after_tool, _ = self.messages_text(messages, False, False, False)
        return self.encode(text if after_tool else text + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        errors: list[str] = []
        reasoning = None
        if self.thinking and "</think>" in text:
            reasoning, _, text = text.partition("</think>")
        elif self.thinking and not text.startswith(CALLS_BEGIN):
            errors.append("the reasoning is not closed by </think>")
        content, bodies = delimited_tool_calls(text, CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, errors)
        calls: list[ToolCall] = []
        for index, body in bodies:
            name, sep, arguments_text = body.partition(CALL_SEP)
            if not sep:
                errors.append(f"tool call {index} has no {CALL_SEP} between name and arguments: {body!r}")
                continue
            if not name.strip():
                errors.append(f"tool call {index} has no function name")
                continue
            arguments, error = parse_arguments(arguments_text, name)
            if error:
                errors.append(error)
            else:
                calls.append(ToolCall(name, arguments))
        return AssistantTurn(
            content=content, reasoning=reasoning, tool_calls=calls, parse_error="; ".join(errors) or None
        )
