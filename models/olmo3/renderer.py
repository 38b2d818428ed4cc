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
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, Renderer, register_renderer
from archon.models.common.chat_format import check_messages, require_stop, split_reasoning, turn_text

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


@register_renderer
class Olmo3ThinkRenderer(Renderer):
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

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self._stops = (self.token_id(IM_END), self.token_id(ENDOFTEXT))
        self.token_id(IM_START)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self._stops

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
