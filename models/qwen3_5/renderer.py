"""The Qwen3.5 chat format (Qwen3.5 dense and MoE, text and vision-language), as its chat template writes it.

    <|im_start|>system
    # Tools

    You have access to the following functions:

    <tools>
    {tool schema as JSON}
    </tools>

    If you choose to call a function ... </IMPORTANT>

    SYSTEM<|im_end|>
    <|im_start|>user
    QUESTION<|im_end|>
    <|im_start|>assistant
    <think>
    REASONING
    </think>

    CONTENT

    <tool_call>
    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    RESULT
    </tool_response><|im_end|>
    <|im_start|>assistant
    <think>

ChatML turns, every message's content (and reasoning) trimmed of surrounding whitespace. A tool
call's arguments are written one `<parameter=KEY>` each: a string as its text, an object or a list
as JSON, anything else as Python spells it (`5`, `0.5`, `True`, `None`). So reading a call back needs
the parameter's type: parse_turn types each argument by the schema of the tools last offered to
render_prompt (a render_prompt call without tools keeps them); an argument with no schema is read
as JSON, else as a Python literal, else kept as text. A turn ends with <|im_end|>, after which the
template writes "\\n". Tool results are a user turn, consecutive tool messages grouped into one. The
generation prompt opens the reasoning (`<think>\\n`); `enable_thinking=False` (on by default) closes
it empty instead (`<think>\\n\\n</think>\\n\\n`).

Where the template is not prefix-preserving (rendering the longer conversation again does not extend
the ids the model was prompted with and sampled):

- An assistant turn at or before the last user query (a user message that is not a wrapped tool
  response) keeps its `<think>` block only if its reasoning is not empty: once a user message follows
  a turn with empty reasoning (under enable_thinking=False, every turn), the block the generation
  prompt opened (`<think>\\n`, or `<think>\\n\\n</think>\\n\\n`) and the turn's `\\n</think>\\n\\n`
  disappear.
- The template trims reasoning and content: a model that samples whitespace around them is rendered
  differently than sampled.
- The generation prompt ends with "<think>\\n"; tokenizing the whole text again merges that newline
  with the newline an empty reasoning starts with (`<think>\\n\\n</think>`), which the sampled ids did not.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, ToolCall, register_renderer
from archon.models.common.chat_format import (
    THINK_CLOSE,
    THINK_OPEN,
    check_messages,
    message_tool_calls,
    reasoning_and_content,
    split_reasoning,
    template_json,
    tool_parameter_schemas,
    turn_text,
    typed_argument,
)
from archon.models.common.chatml import (
    IM_END,
    IM_START,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    ChatMLRenderer,
    chatml_message,
    last_query_index,
    parse_tool_call_blocks,
    render_tool_responses,
)

FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"
PARAMETER_OPEN = "<parameter="
PARAMETER_CLOSE = "</parameter>"

TOOLS_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
    "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
    "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
    "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
    "nested within <tool_call></tool_call> XML tags\n"
    "- Required parameters MUST be specified\n"
    "- You may provide optional reasoning for your function call in natural language BEFORE the function "
    "call, but NOT after\n"
    "- If there is no function call available, answer the question like normal with your current knowledge "
    "and do not tell the user about function calls\n</IMPORTANT>"
)


@register_renderer
class Qwen3_5Renderer(ChatMLRenderer):
    name = "qwen3_5"
    environment_roles = ("user", "tool")

    def __init__(self, tokenizer, enable_thinking: bool = True) -> None:
        super().__init__(tokenizer)
        self.enable_thinking = enable_thinking
        self._parameter_schemas: dict[str, dict] = {}

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        check_messages(self.name, messages)
        if tools:
            self._parameter_schemas = tool_parameter_schemas(tools)
        return self.encode(self._render(messages, tools) + self.generation_prompt())

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        text = turn_text(self, sampled_ids)
        reasoning = None
        if self.enable_thinking or THINK_CLOSE in text:
            reasoning, text, error = split_reasoning(text.removeprefix(THINK_OPEN))
            if error:
                return AssistantTurn(content="", reasoning=reasoning.strip(), parse_error=error)
            reasoning = reasoning.strip()
        head, calls, error = parse_tool_call_blocks(text, self._parse_call)
        return AssistantTurn(content=head.strip(), reasoning=reasoning, tool_calls=calls, parse_error=error)

    # ---- the template, in Python ------------------------------------------------------------------
    def generation_prompt(self) -> str:
        return f"{IM_START}assistant\n{THINK_OPEN}\n" + ("" if self.enable_thinking else f"\n{THINK_CLOSE}\n\n")

    def environment_text(self, messages: list[Message]) -> str:
        messages = _trimmed(messages)
        return "".join(self._render_message(messages, index, last_query=-1) for index in range(len(messages)))

    def _render(self, messages: list[Message], tools: list[dict] | None) -> str:
        messages = _trimmed(messages)
        for index, message in enumerate(messages):
            if message["role"] == "system" and index > 0:
                raise ValueError(f"renderer {self.name!r}: message {index} is a system message; only the first may be")
        if messages and messages[0]["role"] == "tool":
            raise ValueError(f"renderer {self.name!r}: message 0 is a tool result with no assistant turn before it")
        has_system = bool(messages) and messages[0]["role"] == "system"
        text = ""
        if tools:
            schemas = "".join("\n" + template_json(tool) for tool in tools)
            system = "\n\n" + messages[0]["content"] if has_system and messages[0]["content"] else ""
            tools_block = f"# Tools\n\nYou have access to the following functions:\n\n<tools>{schemas}\n</tools>"
            text += chatml_message("system", tools_block + TOOLS_INSTRUCTIONS + system)
        elif has_system:
            text += chatml_message("system", messages[0]["content"])
        last_query = last_query_index(messages)
        if last_query is None:
            raise ValueError(
                f"renderer {self.name!r}: the conversation has no user query (a user message that is not a "
                f"wrapped tool response); the template needs one"
            )
        for index in range(1 if has_system else 0, len(messages)):
            text += self._render_message(messages, index, last_query)
        return text

    def _render_message(self, messages: list[Message], index: int, last_query: int) -> str:
        """Message `index` of `messages`, whose contents are already trimmed."""
        message = messages[index]
        if message["role"] == "user":
            return chatml_message("user", message["content"])
        if message["role"] == "tool":
            return render_tool_responses(messages, index)
        content = message["content"]
        reasoning, content = reasoning_and_content(message.get("reasoning_content"), content)
        reasoning = reasoning.strip()
        if index > last_query or reasoning:
            text = f"{IM_START}assistant\n{THINK_OPEN}\n{reasoning}\n{THINK_CLOSE}\n\n{content}"
        else:
            text = f"{IM_START}assistant\n{content}"
        for number, call in enumerate(message_tool_calls(message, index)):
            if number > 0:
                text += "\n"
            elif content.strip():
                text += "\n\n"
            text += _xml_tool_call(call)
        return text + f"{IM_END}\n"

    # ---- reading a call back ----------------------------------------------------------------------
    def _parse_call(self, body: str, number: int) -> tuple[ToolCall | None, str | None]:
        """A `<tool_call>` block's body: `<function=NAME>`, its `<parameter=KEY>` blocks, `</function>`."""
        rest = body.strip()
        if not rest.startswith(FUNCTION_OPEN) or ">" not in rest:
            return None, f"tool call {number} does not open with {FUNCTION_OPEN}NAME>: {rest[:80]!r}"
        name, rest = rest[len(FUNCTION_OPEN) :].split(">", 1)
        if not name:
            return None, f"tool call {number} has an empty function name"
        where = f"tool call {number} ({name})"
        if not rest.rstrip().endswith(FUNCTION_CLOSE):
            return None, f"{where} is never closed by {FUNCTION_CLOSE}"
        rest = rest.rstrip()[: -len(FUNCTION_CLOSE)]
        schemas = self._parameter_schemas.get(name, {})
        arguments = {}
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(PARAMETER_OPEN) or ">" not in rest:
                return None, f"{where}: text outside a parameter: {rest.strip()[:80]!r}"
            key, rest = rest[len(PARAMETER_OPEN) :].split(">", 1)
            end = rest.find(PARAMETER_CLOSE)
            if end == -1:
                return None, f"{where}: parameter {key!r} is never closed by {PARAMETER_CLOSE}"
            if key in arguments:
                return None, f"{where}: parameter {key!r} is given twice"
            # the template writes "<parameter=KEY>\nVALUE\n</parameter>"
            value_text = rest[:end].removeprefix("\n").removesuffix("\n")
            value, error = typed_argument(value_text, schemas.get(key))
            if error is not None:
                return None, f"{where}: parameter {key!r}: {error}"
            arguments[key] = value
            rest = rest[end + len(PARAMETER_CLOSE) :]
        return ToolCall(name=name, arguments=arguments), None


def _trimmed(messages: list[Message]) -> list[Message]:
    """The template trims every message's content before writing it."""
    return [dict(message, content=message["content"].strip()) for message in messages]


def _xml_tool_call(call: ToolCall) -> str:
    text = f"{TOOL_CALL_OPEN}\n{FUNCTION_OPEN}{call.name}>\n"
    for key, value in call.arguments.items():
        written = template_json(value) if isinstance(value, (dict, list, tuple)) else str(value)
        text += f"{PARAMETER_OPEN}{key}>\n{written}\n{PARAMETER_CLOSE}\n"
    return text + f"{FUNCTION_CLOSE}\n{TOOL_CALL_CLOSE}"
