"""GPT-OSS's chat format: harmony, as the family's chat template renders it.

Every message is `<|start|>{header}<|message|>{body}{end}`. The prompt opens with a system message
(model identity, knowledge cutoff, current date, `Reasoning: {effort}`, the valid channels) and,
when there are instructions or tools, a developer message (`# Instructions`, then `# Tools` with
the functions as a TypeScript-like `namespace functions { type NAME = (_: {...}) => any; }`).
The prompt ends with `<|start|>assistant`; the model samples the rest of the header.

An assistant turn is one or more messages on channels: `analysis` (the reasoning), then either
`final` (the answer, ended by `<|return|>`) or one call on `commentary` addressed to
`functions.NAME` (JSON arguments, ended by `<|call|>`). `<|return|>` and `<|call|>` stop the turn,
so a turn holds at most one tool call. The template writes a call's header as
`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>`; harmony also puts the
recipient after the channel (`<|channel|>commentary to=functions.NAME <|constrain|>json`): both
are read. A tool's result is `<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>`
with the result as a JSON string, then `<|end|>`.

Where the template is not prefix-preserving (what it renders for earlier turns is not what was
sampled), the trajectory keeps the sampled ids:
- a final answer is sampled with `<|return|>`; the template renders it in history with `<|end|>`;
- the template drops the analysis of a final answer's turn once the answer is in history, and the
  analysis of every tool-call turn before a later final answer;
so the template's rendering of a whole conversation is the trajectory with those analysis messages
removed and every `<|return|>` but the last one as `<|end|>`.

Options (the template's kwargs): reasoning_effort ("medium"), model_identity, current_date (the
template writes today's date; pass one for reproducible prompts). The template's built-in browser
and python tools are not rendered.
"""

from __future__ import annotations

import datetime
import re

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    check_environment_messages,
    message_reasoning,
    message_role,
    message_text,
    message_tool_calls,
    parse_arguments,
    require_stop,
    split_stop,
    template_json,
)

DEFAULT_MODEL_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
REASONING_EFFORTS = ("low", "medium", "high")
CHANNEL_LINE = "# Valid channels: analysis, commentary, final. Channel must be included for every message."

# The header the model samples after `<|start|>assistant`: a recipient before or after the channel,
# and the call's content type (`json` or `<|constrain|>json`).
_HEADER = re.compile(
    r"(?: to=(?P<before>[^\s<]+))?<\|channel\|>(?P<channel>[^\s<]+)"
    r"(?: to=(?P<after>[^\s<]+))?(?: ?(?:<\|constrain\|>)?(?P<content_type>[^\s<]+))?"
)


def typescript_type(spec: dict, where: str) -> str:
    """A JSON-schema type as the template's render_typescript_type writes it."""
    if not isinstance(spec, dict):
        raise ValueError(f"tool schema: {where} is not a JSON schema object: {spec!r}")
    kind = spec.get("type")
    if kind == "array":
        if "items" in spec:
            item_kind = spec["items"].get("type")
            if item_kind in ("string", "number", "integer", "boolean"):
                text = {"string": "string[]", "boolean": "boolean[]"}.get(item_kind, "number[]")
            else:
                inner = typescript_type(spec["items"], where + ".items")
                text = "any[]" if inner == "object | object" or len(inner) > 50 else inner + "[]"
        else:
            text = "any[]"
        return text + (" | null" if spec.get("nullable") else "")
    if isinstance(kind, list) and kind:
        return " | ".join(kind)
    if spec.get("oneOf"):
        raise ValueError(f"tool schema: {where} uses oneOf, which this renderer does not write")
    if kind == "string":
        if spec.get("enum"):
            return '"' + '" | "'.join(spec["enum"]) + '"'
        return "string" + (" | null" if spec.get("nullable") else "")
    if kind in ("number", "integer"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "object":
        properties = spec.get("properties")
        if not properties:
            return "object"
        required = spec.get("required") or []
        fields = []
        for name, field_spec in properties.items():
            # the template writes the whitespace between `: ` and a nested type verbatim
            fields.append(
                f"{name}{'' if name in required else '?'}: \n{' ' * 16}{typescript_type(field_spec, f'{where}.{name}')}"
            )
        return "{\n" + ", ".join(fields) + "}"
    return "any"


def functions_namespace(tools: list[dict]) -> str:
    """The tools as the template's `namespace functions { ... }`."""
    text = "## functions\n\nnamespace functions {\n\n"
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(
                f"tool {i} is not an OpenAI function tool "
                f"({{'type': 'function', 'function': {{'name', ...}}}}): {tool!r}"
            )
        name = function["name"]
        if not isinstance(function.get("description"), str):
            raise ValueError(f"tool {name!r}: the gpt_oss format needs a description string")
        text += f"// {function['description']}\ntype {name} = "
        parameters = function.get("parameters") or {}
        if not parameters.get("properties"):
            text += "() => any;\n\n"
            continue
        required = parameters.get("required") or []
        text += "(_: {\n"
        for param, spec in parameters["properties"].items():
            where = f"{name}.{param}"
            if isinstance(spec, dict) and spec.get("description"):
                text += f"// {spec['description']}\n"
            text += f"{param}{'' if param in required else '?'}: {typescript_type(spec, where)}"
            if "default" in spec:
                if spec.get("enum"):
                    if not isinstance(spec["default"], str):
                        raise ValueError(
                            f"tool schema: {where}: an enum's default must be a string, not {spec['default']!r}"
                        )
                    text += f", // default: {spec['default']}"
                else:
                    text += f", // default: {template_json(spec['default'])}"
            text += ",\n"
        text += "}) => any;\n\n"
    return text + "} // namespace functions"


@register_renderer
class GptOssRenderer(Renderer):
    name = "gpt_oss"

    def __init__(
        self,
        tokenizer,
        reasoning_effort: str = "medium",
        model_identity: str = DEFAULT_MODEL_IDENTITY,
        current_date: str | None = None,
    ) -> None:
        super().__init__(tokenizer)
        if reasoning_effort not in REASONING_EFFORTS:
            raise ValueError(
                f"renderer 'gpt_oss': reasoning_effort must be one of {REASONING_EFFORTS}, not {reasoning_effort!r}"
            )
        self.reasoning_effort = reasoning_effort
        self.model_identity = model_identity
        self.current_date = current_date or datetime.date.today().strftime("%Y-%m-%d")
        self._return = self.token_id("<|return|>")
        self._call = self.token_id("<|call|>")
        for token in ("<|start|>", "<|end|>", "<|message|>", "<|channel|>"):
            self.token_id(token)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._return, self._call)

    # ---- rendering ----------------------------------------------------------------------------------
    def system_text(self, tools: list[dict] | None) -> str:
        text = (
            f"<|start|>system<|message|>{self.model_identity}\nKnowledge cutoff: 2024-06\n"
            f"Current date: {self.current_date}\n\nReasoning: {self.reasoning_effort}\n\n{CHANNEL_LINE}"
        )
        if tools:
            text += "\nCalls to these tools must go to the commentary channel: 'functions'."
        return text + "<|end|>"

    @staticmethod
    def tool_result_text(call_name: str | None, message: Message, index: int) -> str:
        if call_name is None:
            raise ValueError(f"message {index} is a tool result, but no assistant message before it made a tool call")
        return (
            f"<|start|>functions.{call_name} to=assistant<|channel|>commentary<|message|>"
            f"{template_json(message_text(message, index))}<|end|>"
        )

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        text = self.system_text(tools)
        loop = list(messages)
        developer = ""
        if loop and message_role(loop[0], 0) in ("system", "developer"):
            developer = message_text(loop[0], 0)
            loop = loop[1:]
        offset = len(messages) - len(loop)
        if developer or tools:
            text += "<|start|>developer<|message|>"
            if developer:
                text += f"# Instructions\n\n{developer}\n\n"
            if tools:
                text += "# Tools\n\n" + functions_namespace(tools)
            text += "<|end|>"
        last_call: str | None = None
        for i, message in enumerate(loop):
            index = i + offset
            role = message_role(message, index)
            if role == "assistant":
                content = message_text(message, index)
                reasoning = message_reasoning(message)
                calls = message_tool_calls(message, index)
                if "tool_calls" in message:
                    final_later = any(
                        later.get("role") == "assistant" and "tool_calls" not in later for later in loop[i + 1 :]
                    )
                    if content and reasoning:
                        raise ValueError(
                            f"message {index}: an assistant tool call has both content and reasoning; "
                            "the gpt_oss template takes one"
                        )
                    analysis = content or reasoning
                    if analysis and not final_later:
                        text += f"<|start|>assistant<|channel|>analysis<|message|>{analysis}<|end|>"
                    if not calls:
                        raise ValueError(f"message {index}: 'tool_calls' is empty")
                    call = calls[0]
                    text += (
                        f"<|start|>assistant to=functions.{call.name}<|channel|>commentary json<|message|>"
                        f"{template_json(call.arguments)}<|call|>"
                    )
                    last_call = call.name
                else:
                    text += f"<|start|>assistant<|channel|>final<|message|>{content}<|end|>"
                    last_call = None
            elif role == "tool":
                text += self.tool_result_text(last_call, message, index)
            elif role == "user":
                text += f"<|start|>user<|message|>{message_text(message, index)}<|end|>"
            else:
                raise ValueError(
                    f"message {index}: role {role!r} is not one the gpt_oss format renders here "
                    "(system/developer come first)"
                )
        return self.encode(text + "<|start|>assistant")

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        calls = self.parse_turn(sampled_ids).tool_calls
        last_call = calls[-1].name if calls else None
        check_environment_messages(messages)
        text = ""
        for index, message in enumerate(messages):
            if message["role"] == "tool":
                text += self.tool_result_text(last_call, message, index)
            else:
                text += f"<|start|>user<|message|>{message_text(message, index)}<|end|>"
                last_call = None
        return self.encode(text + "<|start|>assistant")

    # ---- reading a sampled turn ---------------------------------------------------------------------
    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        body_ids, stop = split_stop(self, sampled_ids)
        text = self.decode(body_ids) + ("<|call|>" if stop == self._call else "<|return|>" if stop is not None else "")
        reasoning: list[str] = []
        content: list[str] = []
        calls: list[ToolCall] = []
        errors: list[str] = []
        # the turn's first message continues the prompt's `<|start|>assistant`
        for number, message in enumerate(text.split("<|start|>assistant")):
            if number > 0 and not message and stop is None:
                break  # the turn ended with an opened, empty next message
            header, sep, rest = message.partition("<|message|>")
            if not sep:
                errors.append(f"message {number} has no <|message|> after its header {header!r}")
                continue
            end = re.search(r"<\|end\|>|<\|call\|>|<\|return\|>", rest)
            if end is None:
                errors.append(f"message {number} ({header!r}) is not closed by <|end|>, <|call|> or <|return|>")
                body, terminator = rest, None
            else:
                body, terminator = rest[: end.start()], end.group()
                if rest[end.end() :]:
                    errors.append(f"message {number}: text after its {terminator}: {rest[end.end() :]!r}")
            match = _HEADER.fullmatch(header)
            if match is None:
                errors.append(f"message {number}: unreadable header {header!r} (no <|channel|>?)")
                continue
            channel = match.group("channel")
            recipient = match.group("before") or match.group("after")
            if recipient is not None:
                if not recipient.startswith("functions."):
                    errors.append(f"message {number}: recipient {recipient!r} is not a function (functions.NAME)")
                    continue
                name = recipient[len("functions.") :]
                if terminator not in ("<|call|>", None):
                    errors.append(f"message {number}: the call to {name!r} ends with {terminator} instead of <|call|>")
                if terminator is None:
                    continue
                arguments, error = parse_arguments(body, name)
                if error:
                    errors.append(error)
                else:
                    calls.append(ToolCall(name, arguments))
            elif channel == "analysis":
                reasoning.append(body)
            elif channel in ("final", "commentary"):
                content.append(body)
            else:
                errors.append(f"message {number}: unknown channel {channel!r} (analysis, commentary or final)")
        return AssistantTurn(
            content="".join(content),
            reasoning="".join(reasoning) if reasoning else None,
            tool_calls=calls,
            parse_error="; ".join(errors) if errors else None,
        )
