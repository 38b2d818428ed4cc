"""The OLMo 2 chat format (the OLMo-2 Instruct models), as its chat template writes it.

    <|endoftext|><|system|>
    SYSTEM
    <|user|>
    QUESTION
    <|assistant|>
    ANSWER<|endoftext|>
    <|user|>
    FOLLOW-UP
    <|assistant|>

The role markers are plain text (the tokenizer has no special tokens for them); `<|endoftext|>` is
both the beginning-of-text and the end-of-turn token. A turn ends with `<|endoftext|>`, after which
the template writes "\\n" when another message follows. The template renders no tools, no tool calls
and no tool results (it drops tool messages silently); this renderer refuses them, naming the
message, rather than prompt the model without them. No reasoning, no options.

The template is prefix-preserving: it writes every message as given, so the trajectory is the
template's rendering of the whole conversation.

OLMo 3's formats follow: `olmo3_think` (Olmo-3-32B-Think, chosen by name) and `olmo3_instruct` (Olmo 3.1
Instruct, model_type olmo3's default); their classes say how each writes a conversation.
"""

from __future__ import annotations

import json

from archon.agents.renderer import AssistantTurn, Message, Renderer, ToolCall, register_renderer
from archon.models.common.chat_format import (
    check_messages,
    require_stop,
    split_reasoning,
    template_json,
    turn_text,
)

ENDOFTEXT = "<|endoftext|>"
GENERATION_PROMPT = "<|assistant|>\n"
ROLES = ("system", "user", "assistant")


@register_renderer
class Olmo2Renderer(Renderer):
    name = "olmo2"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._endoftext = self.token_id(ENDOFTEXT)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._endoftext,)

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if tools:
            raise ValueError(f"renderer {self.name!r}: the OLMo 2 chat template renders no tools")
        self._check(messages, ROLES)
        if not messages:
            raise ValueError(f"renderer {self.name!r}: the template writes no generation prompt for no messages")
        return self.encode(ENDOFTEXT + self._messages_text(messages) + GENERATION_PROMPT)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        self._check(messages, ("system", "user"))
        return self.encode(("\n" if messages else "") + self._messages_text(messages) + GENERATION_PROMPT)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        return AssistantTurn(content=turn_text(self, sampled_ids))

    def _check(self, messages: list[Message], roles: tuple[str, ...]) -> None:
        check_messages(self.name, messages, roles=roles)
        for index, message in enumerate(messages):
            if message.get("tool_calls"):
                raise ValueError(
                    f"renderer {self.name!r}: message {index} has tool calls; the OLMo 2 chat template renders none"
                )

    def _messages_text(self, messages: list[Message]) -> str:
        """The messages as the template writes them: an assistant turn ends with <|endoftext|>, and "\\n"
        follows it unless it is the last message."""
        text = ""
        for index, message in enumerate(messages):
            text += f"<|{message['role']}|>\n{message['content']}"
            if message["role"] != "assistant":
                text += "\n"
            else:
                text += ENDOFTEXT + ("\n" if index < len(messages) - 1 else "")
        return text


# ---- OLMo 3 Think ---------------------------------------------------------------------------------------
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
DEFAULT_SYSTEM = "You are a helpful AI assistant."
NO_FUNCTIONS = " You do not currently have access to any functions. <functions></functions>"
THINK_GENERATION_PROMPT = f"{IM_START}assistant\n<think>"


class _ChatMLRenderer(Renderer):
    """OLMo 3's ChatML turns: a turn stops with `<|im_end|>`, or with `<|endoftext|>` (the end of a
    conversation's last turn)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._stops = (self.token_id(IM_END), self.token_id(ENDOFTEXT))
        self.token_id(IM_START)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops


@register_renderer
class Olmo3ThinkRenderer(_ChatMLRenderer):
    """Olmo-3-32B-Think's chat format, as Ai2's post-training code states it was released: ChatML turns,
    a default system turn when the conversation has no system message, `NO_FUNCTIONS` after a system
    message's text, and the generation prompt `<|im_start|>assistant\\n<think>`. The model samples
    `REASONING</think>ANSWER` and stops with `<|im_end|>` (the template then writes "\\n") or with
    `<|endoftext|>` (the template's end of a conversation's last turn).

    Not prefix-preserving: an assistant turn in history is `<|im_start|>assistant\\n{content}<|im_end|>\\n`,
    its content as given (the template reads no reasoning field), so the sampled `<think>`, reasoning and
    `</think>` are gone unless the content carries them, and a turn that stopped with `<|endoftext|>` is
    written ending with `<|im_end|>`. These templates render tools and calls only as preformatted text
    (`functions`, `function_calls`) and tool results as `environment` messages; the renderer refuses
    tools, calls and tool results.
    """

    name = "olmo3_think"

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if tools:
            raise ValueError(f"renderer {self.name!r}: the Olmo 3 Think template renders no tools")
        self._check(messages, ROLES)
        if not messages or messages[-1]["role"] == "assistant":
            raise ValueError(
                f"renderer {self.name!r}: the conversation must end with a user or system message (the template "
                "writes a final assistant message as the end of the conversation)"
            )
        text = "" if any(m["role"] == "system" for m in messages) else f"{IM_START}system\n{DEFAULT_SYSTEM}{IM_END}\n"
        return self.encode(text + self._messages_text(messages) + THINK_GENERATION_PROMPT)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        self._check(messages, ("user",))
        return self.encode("\n" + self._messages_text(messages) + THINK_GENERATION_PROMPT)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        reasoning, content, error = split_reasoning(turn_text(self, sampled_ids))
        return AssistantTurn(content=content, reasoning=reasoning, parse_error=error)

    def _check(self, messages: list[Message], roles: tuple[str, ...]) -> None:
        check_messages(self.name, messages, roles=roles)
        for index, message in enumerate(messages):
            if message.get("tool_calls"):
                raise ValueError(
                    f"renderer {self.name!r}: message {index} has tool calls; the Olmo 3 Think template renders "
                    "calls only as preformatted text"
                )

    @staticmethod
    def _messages_text(messages: list[Message]) -> str:
        text = ""
        for message in messages:
            suffix = NO_FUNCTIONS if message["role"] == "system" else ""
            text += f"{IM_START}{message['role']}\n{message['content']}{suffix}{IM_END}\n"
        return text


# ---- OLMo 3 Instruct ------------------------------------------------------------------------------------
OLMO31_IDENTITY = (
    "You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, and your model "
    "weights are available at https://huggingface.co/allenai. "
)
NO_FUNCTIONS_OFFERED = "You do not currently have access to any functions. <functions></functions>"
FUNCTIONS_OFFERED = (
    "You are provided with function signatures within <functions></functions> XML tags. You may call one or "
    "more functions to assist with the user query. Output any function calls within <function_calls>"
    "</function_calls> XML tags. Do not make assumptions about what values to plug into functions."
)
FUNCTION_CALLS_OPEN, FUNCTION_CALLS_CLOSE = "<function_calls>", "</function_calls>"
OLMO3_DEFAULT_SYSTEM = "You are a helpful function-calling AI assistant."
"""Olmo 3 (not 3.1) Instruct's default system sentence, which its template writes instead of Olmo's identity."""
INSTRUCT_GENERATION_PROMPT = f"{IM_START}assistant\n"
INSTRUCT_ROLES = ("system", "user", "assistant", "tool", "environment")


@register_renderer
class Olmo3InstructRenderer(_ChatMLRenderer):
    """Olmo 3.1 Instruct's chat format (allenai/Olmo-3.1-32B-Instruct), as its chat template writes it:

        <|im_start|>system
        You are Olmo, ... You are provided with function signatures ...<functions>[TOOLS]</functions><|im_end|>
        <|im_start|>user
        QUESTION<|im_end|>
        <|im_start|>assistant
        CONTENT<function_calls>search(query="x", limit=3)
        now()</function_calls><|im_end|>
        <|im_start|>environment
        RESULT<|im_end|>
        <|im_start|>assistant

    ChatML turns. With no system message anywhere in the conversation, a default system turn: Olmo's
    identity, then `NO_FUNCTIONS_OFFERED`, or with tools `FUNCTIONS_OFFERED` and the tools' JSON list in
    `<functions></functions>`. A system message is written as given, followed by `<functions>[TOOLS]</functions>`
    whenever tools are passed (even an empty list), else by ` <functions>...</functions>` when it carries
    preformatted `functions` text. An assistant message: its content, then its calls in one
    `<function_calls>` block, one `name(key=VALUE, ...)` a line, each VALUE as JSON (`tojson`), or its
    preformatted `function_calls` text there instead. A tool result is an `environment` turn (messages with
    role `environment` too). The model stops with `<|im_end|>` (the template then writes "\\n") or with
    `<|endoftext|>`, the template's eos_token, which it writes after a conversation's last message.

    Prefix-preserving for a turn whose text is its content and calls as the template writes them, except
    that a turn stopped by `<|endoftext|>` ends with `<|im_end|>` in history, and that the template ends
    the conversation's last turn with `<|endoftext|>` however it stopped. The default system turn stays:
    bridge takes no system message. No reasoning, no options.
    """

    name = "olmo3_instruct"
    plain_text_roles = ("tool", "environment")

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        # model_type olmo3 names this renderer; refuse the olmo3 checkpoints whose own template differs
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, str) and "<think>" in template:
            raise ValueError(
                f"renderer {self.name!r}: this tokenizer's chat template writes <think> (an OLMo 3 Think "
                "checkpoint): set the environment's renderer to 'olmo3_think'"
            )
        if isinstance(template, str) and OLMO3_DEFAULT_SYSTEM in template:
            raise ValueError(
                f"renderer {self.name!r}: this tokenizer's chat template is Olmo 3 Instruct's (its default system "
                f"turn {OLMO3_DEFAULT_SYSTEM!r}), not Olmo 3.1 Instruct's, which this renderer writes; no renderer "
                "here writes it"
            )

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        self._check(messages, INSTRUCT_ROLES)
        if not messages or messages[-1]["role"] == "assistant":
            raise ValueError(
                f"renderer {self.name!r}: the conversation must end with a user, system or tool message (the "
                "template writes a final assistant message as the end of the conversation)"
            )
        text = "" if any(m["role"] == "system" for m in messages) else self._default_system(tools)
        return self.encode(text + self._messages_text(messages, tools) + INSTRUCT_GENERATION_PROMPT)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        self._check(messages, ("user", "tool"))
        return self.encode("\n" + self._messages_text(messages, None) + INSTRUCT_GENERATION_PROMPT)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        content, calls, error = parse_function_calls(turn_text(self, sampled_ids))
        return AssistantTurn(content=content, tool_calls=calls, parse_error=error)

    def _check(self, messages: list[Message], roles: tuple[str, ...]) -> None:
        check_messages(self.name, messages, roles=roles)
        for index, message in enumerate(messages):
            where = f"renderer {self.name!r}: message {index}"
            for key in ("functions", "function_calls"):
                if message.get(key) is not None and not isinstance(message[key], str):
                    raise ValueError(f"{where}: {key!r} must be preformatted text, got {type(message[key]).__name__}")
            for number, call in enumerate(message.get("tool_calls") or [], 1):
                if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
                    raise ValueError(
                        f"{where}: tool call {number} is not {{'function': {{'name', 'arguments'}}}} (the template "
                        "writes any other call as its Python repr)"
                    )

    @staticmethod
    def _default_system(tools: list[dict] | None) -> str:
        if not tools:
            return f"{IM_START}system\n{OLMO31_IDENTITY}{NO_FUNCTIONS_OFFERED}{IM_END}\n"
        offered = f"{FUNCTIONS_OFFERED}<functions>{template_json(tools)}</functions>"
        return f"{IM_START}system\n{OLMO31_IDENTITY}{offered}{IM_END}\n"

    @staticmethod
    def _messages_text(messages: list[Message], tools: list[dict] | None) -> str:
        """The messages as the template writes them when none is the conversation's last assistant message."""
        text = ""
        for message in messages:
            role, content = message["role"], message["content"]
            if role == "system" and tools is not None:
                content += f"<functions>{template_json(tools)}</functions>"
            elif role == "system" and message.get("functions") is not None:
                content += f" <functions>{message['functions']}</functions>"
            elif role == "assistant" and message.get("function_calls") is not None:
                content += f"{FUNCTION_CALLS_OPEN}{message['function_calls']}{FUNCTION_CALLS_CLOSE}"
            elif role == "assistant" and message.get("tool_calls") is not None:
                calls = "\n".join(function_call_text(call["function"]) for call in message["tool_calls"])
                content += f"{FUNCTION_CALLS_OPEN}{calls}{FUNCTION_CALLS_CLOSE}"
            text += f"{IM_START}{'environment' if role == 'tool' else role}\n{content}{IM_END}\n"
        return text


def function_call_text(function: dict) -> str:
    """A call as the template writes it: `name(key=VALUE, ...)`, each VALUE as JSON."""
    arguments = ", ".join(f"{key}={template_json(value)}" for key, value in function["arguments"].items())
    return f"{function['name']}({arguments})"


def parse_function_calls(text: str) -> tuple[str, list[ToolCall], str | None]:
    """A turn's text (stop token removed) -> (content, calls, error): the content is the text before
    `<function_calls>`; the block holds one `name(key=VALUE, ...)` a line, each VALUE read as JSON. A
    malformed call is named in the error and skipped; the calls that parse are kept."""
    content, opened, block = text.partition(FUNCTION_CALLS_OPEN)
    if not opened:
        stray = (
            f"a {FUNCTION_CALLS_CLOSE} with no {FUNCTION_CALLS_OPEN} before it"
            if FUNCTION_CALLS_CLOSE in text
            else None
        )
        return text, [], stray
    errors = []
    block, closed, after = block.partition(FUNCTION_CALLS_CLOSE)
    if not closed:
        errors.append(f"the function calls are not closed by {FUNCTION_CALLS_CLOSE}")
    elif after:
        errors.append(f"text after {FUNCTION_CALLS_CLOSE}: {after[:80]!r}")
    calls = []
    for number, line in enumerate((line for line in block.split("\n") if line.strip()), 1):
        call, error = parse_call_line(line, number)
        if error is not None:
            errors.append(error)
        else:
            calls.append(call)
    return content, calls, "; ".join(errors) or None


_JSON = json.JSONDecoder()


def parse_call_line(line: str, number: int) -> tuple[ToolCall | None, str | None]:
    """One `name(key=VALUE, key=VALUE)` line -> (call, error naming call `number` and what is wrong)."""
    name, opened, rest = line.partition("(")
    if not opened or not name or name != name.strip():
        return None, f"call {number} is not name(key=value, ...): {line[:80]!r}"
    arguments, at = {}, 0
    while not rest.startswith(")", at):
        key_end = rest.find("=", at)
        if key_end <= at:
            return None, f"call {number} ({name}): no key=value at {rest[at : at + 40]!r}"
        key = rest[at:key_end]
        try:
            arguments[key], at = _JSON.raw_decode(rest, key_end + 1)
        except json.JSONDecodeError as e:
            return (
                None,
                f"call {number} ({name}): the value of {key!r} is not JSON ({e.msg}): {rest[key_end + 1 :][:40]!r}",
            )
        if rest.startswith(", ", at):
            at += 2
        elif not rest.startswith(")", at):
            return None, f"call {number} ({name}): expected ', ' or ')' after {key!r}, found {rest[at : at + 40]!r}"
    if rest[at + 1 :].strip():
        return None, f"call {number} ({name}): text after its ')': {rest[at + 1 :][:40]!r}"
    return ToolCall(name, arguments), None
