"""The Gemma 3 chat format (the Gemma 3 instruction-tuned models), as its chat template writes it.

    <bos><start_of_turn>user
    SYSTEM

    QUESTION<end_of_turn>
    <start_of_turn>model
    ANSWER<end_of_turn>
    <start_of_turn>user
    FOLLOW-UP<end_of_turn>
    <start_of_turn>model

The system message has no turn of its own: it and a blank line open the first user turn. The turns
must alternate user / assistant from the first (the template raises otherwise), so the format has
no tool calls and no tool results; a bridge takes one user message. Every turn's content is written
trimmed of surrounding whitespace (the system message is not). A turn ends with <end_of_turn>, after
which the template writes "\\n". No reasoning, no options.

Where the template is not prefix-preserving: it trims the content of every turn, so a turn sampled
with whitespace around its text is rendered without it once the conversation is rendered again.
"""

from __future__ import annotations

from archon.agents.renderer import AssistantTurn, Message, Renderer, register_renderer
from archon.models.common.chat_format import check_messages, require_stop, turn_text

BOS = "<bos>"
START_OF_TURN = "<start_of_turn>"
END_OF_TURN = "<end_of_turn>"
GENERATION_PROMPT = f"{START_OF_TURN}model\n"


@register_renderer
class Gemma3Renderer(Renderer):
    name = "gemma3"

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        self.token_id(BOS)
        self.token_id(START_OF_TURN)
        self._end_of_turn = self.token_id(END_OF_TURN)

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self._end_of_turn,)

    def render_prompt(self, messages: list[Message], tools: list[dict] | None = None) -> list[int]:
        if tools:
            raise ValueError(f"renderer {self.name!r}: the Gemma 3 chat template renders no tools")
        check_messages(self.name, messages, roles=("system", "user", "assistant"))
        if not messages:
            raise ValueError(f"renderer {self.name!r}: the template needs at least one message")
        first_user_prefix, turns = "", messages
        if messages[0]["role"] == "system":
            first_user_prefix, turns = messages[0]["content"] + "\n\n", messages[1:]
        self._check_alternation(turns, offset=len(messages) - len(turns))
        text = BOS
        for index, message in enumerate(turns):
            text += _turn(message, first_user_prefix if index == 0 else "")
        return self.encode(text + GENERATION_PROMPT)

    def bridge(self, sampled_ids: list[int], messages: list[Message]) -> list[int]:
        require_stop(self, sampled_ids)
        check_messages(self.name, messages, roles=("user",))
        if len(messages) > 1:
            raise ValueError(
                f"renderer {self.name!r}: after a model turn comes one user turn (the template takes the "
                f"turns alternating), not {len(messages)} messages"
            )
        return self.encode("\n" + "".join(_turn(message, "") for message in messages) + GENERATION_PROMPT)

    def parse_turn(self, sampled_ids: list[int]) -> AssistantTurn:
        return AssistantTurn(content=turn_text(self, sampled_ids))

    def _check_alternation(self, turns: list[Message], offset: int) -> None:
        for index, message in enumerate(turns):
            expected = "user" if index % 2 == 0 else "assistant"
            if message["role"] != expected:
                raise ValueError(
                    f"renderer {self.name!r}: message {index + offset} has role {message['role']!r} where the "
                    f"template needs {expected!r}: after an optional system message, the turns alternate "
                    f"user / assistant, starting with a user turn"
                )


def _turn(message: Message, prefix: str) -> str:
    role = "model" if message["role"] == "assistant" else message["role"]
    return f"{START_OF_TURN}{role}\n{prefix}{message['content'].strip()}{END_OF_TURN}\n"
