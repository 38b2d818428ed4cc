"""Renderers of the Qwen and Llama families against their real chat templates (tests/fixtures/chat_templates).

For each family: render_prompt gives the template's text and ids on hand-written conversations; over
1,000 generated episodes the trajectory (prompt, sampled turns verbatim, bridged environment messages)
is the template's sampled turns plus its environment text, and equals the template's rendering of the
whole conversation up to the documented differences; parse_turn reads each turn back; malformed
tool calls give a parse_error that says what is wrong.
"""

from __future__ import annotations

import functools
import random

import pytest
from renderer_cases import (
    TOOLS,
    build_bpe_tokenizer,
    random_arguments,
    random_conversation,
    random_text,
    read_template,
    simulate_episode,
)
from transformers.utils.chat_template_utils import render_jinja_template

from archon.agents.renderer import ToolCall, default_renderer_name, get_renderer

N_EPISODES = 1000

# ---- Qwen3 ---------------------------------------------------------------------------------------------

QWEN_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
QWEN3_SPECIAL = [*QWEN_SPECIAL, "<think>", "</think>"]
QWEN3_HEADER, QWEN_STOPS = "<|im_start|>assistant", ("<|im_end|>",)
EMPTY_THINK = "<think>\n\n</think>\n\n"


@functools.cache
def family_tokenizer(template: str, special: tuple[str, ...], reasoning: bool, max_calls: int = 4, bos_token=None):
    """A BPE tokenizer trained on 300 conversations the family's template renders (turns of up to
    `max_calls` tool calls), with `bos_token` as its beginning-of-text token when given."""
    chat_template = read_template(template)
    rng = random.Random(12345)
    corpus = []
    for _ in range(300):
        conversation = random_conversation(rng, special, reasoning=reasoning, max_calls=max_calls)
        rendered, _ = render_jinja_template(
            [conversation.messages()], tools=conversation.tools, chat_template=chat_template
        )
        corpus.append(rendered[0])
    tokenizer = build_bpe_tokenizer(list(special), corpus, 3000, chat_template=chat_template)
    if bos_token is not None:
        tokenizer.bos_token = bos_token
    return tokenizer


def qwen3_tokenizer():
    return family_tokenizer("qwen3", tuple(QWEN3_SPECIAL), True)


def template_ids(tokenizer, messages, tools=None, generation_prompt=True, **options):
    text = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **options
    )
    return text, tokenizer.encode(text, add_special_tokens=False)


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def expected_tool_calls(assistant) -> list[ToolCall]:
    return [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in assistant.get("tool_calls", [])]


def assert_prompts_are_the_template(renderer, tokenizer, conversation, tools, first_end=1, **options):
    """render_prompt of every prefix of `conversation` (from `first_end` messages) that does not end
    with an assistant turn gives the template's text and ids."""
    for end in range(first_end, len(conversation) + 1):
        if conversation[end - 1]["role"] == "assistant":
            continue
        messages = conversation[:end]
        text, ids = template_ids(tokenizer, messages, tools, **options)
        rendered = renderer.render_prompt(messages, tools=tools)
        assert renderer.decode(rendered) == text
        assert rendered == ids


def new_identity_figures() -> dict[str, int]:
    """The counts record_identity keeps over a test's generated episodes."""
    return {
        "episodes": 0,
        "turns": 0,
        "template_text_differs": 0,
        "retokenized_ids_differ": 0,
        "same_text_other_ids": 0,
    }


QWEN3_CONVERSATION = [
    {"role": "system", "content": "You are a careful agent.\nAnswer briefly."},
    {"role": "user", "content": "Weather in Paris and Tōkyō?  "},
    {
        "role": "assistant",
        "content": "Let me look both up.",
        "reasoning_content": "Two cities,\ntwo calls.",
        "tool_calls": [call("get_weather", city="Paris", days=2), call("get_weather", city="東京", units="c")],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": "Error: timeout\n"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Retry Tokyo.",
        "tool_calls": [call("get_weather", city="Tokyo")],
    },
    {"role": "tool", "content": "18 °C"},
    {"role": "assistant", "content": "Paris 21 °C, Tokyo 18 °C.", "reasoning_content": "Done."},
    {"role": "user", "content": "And in Fahrenheit?\n"},
    {"role": "assistant", "content": "\n\n70 °F and 64 °F.", "reasoning_content": "\nconvert\n"},
    {"role": "user", "content": "Thanks! Search for more?"},
    {
        "role": "assistant",
        "content": "Sure:\n",
        "reasoning_content": "search",
        "tool_calls": [call("search", query='paris "weather" {x}', limit=3)],
    },
    {"role": "tool", "content": "[]"},
]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
def test_qwen3_render_prompt_is_the_template(tools, enable_thinking, system):
    tokenizer = qwen3_tokenizer()
    renderer = get_renderer("qwen3", tokenizer, enable_thinking=enable_thinking)
    conversation = QWEN3_CONVERSATION if system else QWEN3_CONVERSATION[1:]
    assert_prompts_are_the_template(renderer, tokenizer, conversation, tools, enable_thinking=enable_thinking)


def test_qwen3_prompt_by_hand():
    """The format written out for a short conversation (tools in the system turn, the grouped tool
    results, the earlier turn's reasoning dropped after the new user message)."""
    tokenizer = qwen3_tokenizer()
    renderer = get_renderer("qwen3", tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "R", "tool_calls": [call("f", x="é")]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "A", "reasoning_content": "R2"},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        "<|im_start|>system\nS\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nQ<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nA<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.decode(renderer.render_prompt(messages, tools=[tool])) == expected
    assert template_ids(tokenizer, messages, [tool])[0] == expected


def qwen3_template_text(episode, enable_thinking: bool) -> str:
    """The template's rendering of the whole episode, from the trajectory's pieces and the documented
    differences: an assistant turn that is not the last message loses its <think> block when it is at
    or before the last user query or its reasoning is empty, and is then written with its content as
    given (the newlines the <think> branch strips kept)."""
    messages = episode.conversation.messages()
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    segments = [text for _, text, _ in episode.segments]
    message_index = len(episode.conversation.first) - 1
    segment_index = 0
    for assistant, environment in episode.conversation.turns:
        message_index += 1
        segment_index += 1  # the turn's segment
        is_last = message_index == len(messages) - 1
        reasoning = assistant.get("reasoning_content") or ""
        if not is_last and (message_index <= last_query or not reasoning):
            content = assistant["content"]
            leading_newlines = content[: len(content) - len(content.lstrip("\n"))]
            if enable_thinking:
                block = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n"
                assert segments[segment_index].startswith(block)
                segments[segment_index] = leading_newlines + segments[segment_index][len(block) :]
            else:  # the empty block is the end of the generation prompt before the turn
                assert segments[segment_index - 1].endswith(EMPTY_THINK)
                segments[segment_index - 1] = segments[segment_index - 1][: -len(EMPTY_THINK)]
                segments[segment_index] = leading_newlines + segments[segment_index]
        message_index += len(environment)
        segment_index += 1 if environment else 0
    return "".join(segments) + "\n"


def test_qwen3_token_identity_over_generated_episodes():
    tokenizer = qwen3_tokenizer()
    figures = new_identity_figures()
    for seed in range(N_EPISODES):
        rng = random.Random(seed)
        enable_thinking = rng.random() < 0.75
        conversation = random_conversation(rng, tuple(QWEN3_SPECIAL), reasoning=enable_thinking)
        renderer = get_renderer("qwen3", tokenizer, enable_thinking=enable_thinking)
        episode = simulate_episode(
            renderer, tokenizer, conversation, QWEN3_HEADER, QWEN_STOPS, enable_thinking=enable_thinking
        )
        for (assistant, _), turn in zip(conversation.turns, episode.parsed, strict=True):
            check_parsed_hermes_turn(assistant, turn, reasoning=enable_thinking)
        whole = tokenizer.apply_chat_template(
            conversation.messages(), tools=conversation.tools, tokenize=False, enable_thinking=enable_thinking
        )
        assert whole == qwen3_template_text(episode, enable_thinking), f"seed {seed}"
        record_identity(figures, tokenizer, episode, whole, "\n")
    print("qwen3 token identity:", figures)
    assert figures["episodes"] == N_EPISODES
    # the design's motivation: re-rendering the conversation rewrites earlier turns (reasoning dropped)
    assert (
        figures["template_text_differs"] > 0 and figures["retokenized_ids_differ"] >= figures["template_text_differs"]
    )


def record_identity(figures, tokenizer, episode, whole_text, after_last_stop):
    """Count the episode: does the template's text of the whole conversation differ from the
    trajectory's, and do its ids (tokenized again) differ from the trajectory's?"""
    figures["episodes"] += 1
    figures["turns"] += len(episode.conversation.turns)
    text_differs = whole_text != episode.text + after_last_stop
    ids = tokenizer.encode(whole_text, add_special_tokens=False)
    ids_differ = ids != episode.trajectory + tokenizer.encode(after_last_stop, add_special_tokens=False)
    figures["template_text_differs"] += text_differs
    figures["retokenized_ids_differ"] += ids_differ
    figures["same_text_other_ids"] += ids_differ and not text_differs


def check_parsed_hermes_turn(assistant, turn, *, reasoning: bool):
    """parse_turn gives back the message as the template wrote it (content without its leading
    newlines in the Qwen3 format, reasoning without surrounding newlines)."""
    assert turn.parse_error is None
    assert turn.tool_calls == expected_tool_calls(assistant)
    assert turn.content == assistant["content"].lstrip("\n")
    if reasoning:
        assert turn.reasoning == assistant["reasoning_content"].strip("\n")
    else:
        assert turn.reasoning is None


# ---- parsing, hand-written -------------------------------------------------------------------------------


def qwen3_parse(text, stop=True):
    renderer = get_renderer("qwen3", qwen3_tokenizer())
    return renderer.parse_turn(renderer.encode(text + ("<|im_end|>" if stop else "")))


def test_qwen3_parse_turn_well_formed():
    turn = qwen3_parse(
        "<think>\nplan\n</think>\n\nOK\n"
        '<tool_call>\n{"name": "search", "arguments": {"query": "a\\nb"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "python", "arguments": {}}\n</tool_call>'
    )
    assert (turn.reasoning, turn.content, turn.parse_error) == ("plan", "OK", None)
    assert turn.tool_calls == [ToolCall("search", {"query": "a\nb"}), ToolCall("python", {})]
    assert turn.message()["tool_calls"][0]["function"] == {"name": "search", "arguments": {"query": "a\nb"}}
    turn = qwen3_parse("just text  \n")
    assert (turn.reasoning, turn.content, turn.tool_calls, turn.parse_error) == (None, "just text  \n", [], None)
    turn = qwen3_parse("<think>\n\n</think>\n\nhi", stop=False)  # a turn cut before its stop token
    assert (turn.reasoning, turn.content) == ("", "hi")


GOOD_CALL = '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call>'


HERMES_MALFORMED = pytest.mark.parametrize(
    "text, error, kept",
    [
        (
            '<tool_call>\n{"name": "search", "arguments": {"query": }\n</tool_call>\n' + GOOD_CALL,
            "tool call 1 is not valid JSON (Expecting value at line 2 column 43): "
            """'{"name": "search", "arguments": {"query": }'""",
            1,
        ),
        (
            GOOD_CALL + '\n<tool_call>\n{"name": "python", "arguments": {}}',
            "tool call 2 is never closed by </tool_call>",
            1,
        ),
        ('<tool_call>\n{"name": "a", "arguments": {}}\n' + GOOD_CALL, "tool call 1 is never closed by </tool_call>", 1),
        (
            '<tool_call>\n{"arguments": {"query": "x"}}\n</tool_call>',
            'tool call 1 has no "name" (a non-empty string)',
            0,
        ),
        (
            '<tool_call>\n{"name": "search", "arguments": "{\\"query\\": 1}"}\n</tool_call>',
            'tool call 1 (search): "arguments" is a JSON string, not an object',
            0,
        ),
        ('<tool_call>\n{"name": "search"}\n</tool_call>', 'tool call 1 (search) has no "arguments"', 0),
        (
            '<tool_call>\n["search", {}]\n</tool_call>',
            'tool call 1 is a JSON array, not an object with "name" and "arguments"',
            0,
        ),
        (
            '<tool_call>\n{"name": "s", "arguments": {}, "id": 3}\n</tool_call>',
            'tool call 1 has keys other than "name" and "arguments": [\'id\']',
            0,
        ),
        (GOOD_CALL + "\nand then I will wait.", "text outside a tool call after call 1: 'and then I will wait.'", 1),
        ("Here </tool_call> oops", "a </tool_call> with no <tool_call> before it", 0),
    ],
    ids=[
        "bad_json",
        "unclosed_last",
        "unclosed_then_next",
        "missing_name",
        "arguments_string",
        "no_arguments",
        "not_an_object",
        "unknown_key",
        "text_after",
        "stray_close",
    ],
)


@HERMES_MALFORMED
def test_qwen3_parse_turn_malformed(text, error, kept):
    turn = qwen3_parse("Before.\n" + text)
    assert turn.parse_error == error
    assert turn.tool_calls == [ToolCall("search", {"query": "x"})] * kept
    assert turn.content == ("Before." if "<tool_call>" in text else "Before.\n" + text)


def test_qwen3_unclosed_reasoning():
    turn = qwen3_parse("<think>\nstill thinking", stop=False)
    assert (turn.content, turn.reasoning, turn.parse_error) == (
        "",
        "still thinking",
        "the reasoning is never closed by </think>",
    )


def test_qwen3_bad_input():
    tokenizer = qwen3_tokenizer()
    renderer = get_renderer("qwen3", tokenizer)
    turn = renderer.encode("hi<|im_end|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(turn[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(
        ValueError, match=r"message 0 has role 'assistant'; this format takes \['system', 'user', 'tool'\]"
    ):
        renderer.bridge(turn, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 1 \(user\) needs string content, got NoneType"):
        renderer.render_prompt([{"role": "system", "content": "s"}, {"role": "user", "content": None}])
    with pytest.raises(ValueError, match=r"tool call 1 \(f\) needs arguments as a dict, got str"):
        renderer.render_prompt(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            ]
        )
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|im_start\|>'"):
        get_renderer("qwen3", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


# ---- Qwen3.5 -------------------------------------------------------------------------------------------

QWEN3_5_HEADER = "<|im_start|>assistant"
# A tool with a parameter of every JSON type, beside the common ones: the format writes arguments as
# text, and parse_turn types them back by these schemas.
CONFIGURE_TOOL = {
    "type": "function",
    "function": {
        "name": "configure",
        "description": "Set options.",
        "parameters": {
            "type": "object",
            "properties": {
                "label": {"type": "string"},
                "count": {"type": "integer"},
                "ratio": {"type": "number"},
                "enabled": {"type": "boolean"},
                "tags": {"type": "array"},
                "options": {"type": "object"},
                "note": {"type": ["string", "null"]},
                "mode": {"enum": ["fast", "slow"]},
            },
        },
    },
}
QWEN3_5_TOOLS = [*TOOLS, CONFIGURE_TOOL]


def qwen3_5_tokenizer():
    return family_tokenizer("qwen3_5", tuple(QWEN3_SPECIAL), True)


def schema_arguments(rng, forbidden, tool):
    """Arguments of the types the tool's schema gives (strings that read as numbers or JSON too)."""
    arguments = {}
    properties = tool["function"]["parameters"]["properties"]
    for key in rng.sample(sorted(properties), rng.randint(0, len(properties))):
        schema = properties[key]
        kind = rng.choice(schema["type"]) if isinstance(schema.get("type"), list) else schema.get("type", "enum")
        if kind == "string":
            # text that reads as another type stays a string where the schema allows only strings
            look_alikes = ["3.14", "[1, 2]", "True", "null"] if schema["type"] == "string" else []
            value = rng.choice([random_text(rng, forbidden, max_words=6, empty_ok=True), *look_alikes])
        elif kind == "integer":
            value = rng.randint(-1000, 10**6)
        elif kind == "number":
            value = round(rng.uniform(-100, 100), rng.randint(0, 4))
        elif kind == "boolean":
            value = rng.random() < 0.5
        elif kind == "null":
            value = None
        elif kind == "array":
            value = [random_text(rng, forbidden, max_words=2), rng.randint(0, 9)]
        elif kind == "object":
            value = random_arguments(rng, forbidden)
        else:
            value = rng.choice(schema["enum"])
        arguments[key] = value
    return arguments


QWEN3_5_CONVERSATION = [
    {"role": "system", "content": "  You are a careful agent.\nAnswer briefly.\n"},
    {"role": "user", "content": "Weather in Paris and Tōkyō?  "},
    {
        "role": "assistant",
        "content": "Let me look both up.\n",
        "reasoning_content": "\nTwo cities,\ntwo calls.",
        "tool_calls": [call("get_weather", city="Paris", days=2), call("get_weather", city="東京", units="c")],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": "  Error: timeout\n"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "",
        "tool_calls": [
            call(
                "configure",
                label="3.14",
                count=3,
                ratio=0.5,
                enabled=False,
                tags=["a", 1],
                options={"k": [None]},
                note=None,
                mode="fast",
            )
        ],
    },
    {"role": "tool", "content": "ok"},
    {"role": "assistant", "content": "Paris 21 °C, Tokyo 18 °C.", "reasoning_content": "Done."},
    {"role": "user", "content": "And in Fahrenheit?\n"},
    {"role": "assistant", "content": "\n\n70 °F and 64 °F.", "reasoning_content": ""},
    {"role": "user", "content": "Thanks! Search for more?"},
    {
        "role": "assistant",
        "content": "Sure:\n",
        "reasoning_content": "search",
        "tool_calls": [call("search", query='paris "weather" {x}\n', limit=3)],
    },
    {"role": "tool", "content": "[]"},
]


@pytest.mark.parametrize("tools", [QWEN3_5_TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
def test_qwen3_5_render_prompt_is_the_template(tools, enable_thinking, system):
    tokenizer = qwen3_5_tokenizer()
    renderer = get_renderer("qwen3_5", tokenizer, enable_thinking=enable_thinking)
    conversation = QWEN3_5_CONVERSATION if system else QWEN3_5_CONVERSATION[1:]
    assert_prompts_are_the_template(
        renderer, tokenizer, conversation, tools, first_end=2 if system else 1, enable_thinking=enable_thinking
    )


def test_qwen3_5_prompt_by_hand():
    """The format written out for a short conversation (trimmed contents, the XML call with a string,
    a number and an object argument, the grouped tool results, the empty reasoning block of a turn
    before the new user message dropped, a non-empty one kept)."""
    tokenizer = qwen3_5_tokenizer()
    renderer = get_renderer("qwen3_5", tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages = [
        {"role": "system", "content": " S\n"},
        {"role": "user", "content": "Q "},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "",
            "tool_calls": [call("f", x="é", n=1.5, o={"a": True})],
        },
        {"role": "tool", "content": "1\n"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "A", "reasoning_content": "\nR2 "},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {}}}\n</tools>\n\n'
        "If you choose to call a function ONLY reply in the following format with NO suffix:\n\n"
        "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
        "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n"
        "</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n"
        "- Function calls MUST follow the specified format: an inner <function=...></function> block must be "
        "nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n"
        "- You may provide optional reasoning for your function call in natural language BEFORE the function "
        "call, but NOT after\n- If there is no function call available, answer the question like normal with "
        "your current knowledge and do not tell the user about function calls\n</IMPORTANT>\n\nS<|im_end|>\n"
        "<|im_start|>user\nQ<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n<function=f>\n<parameter=x>\né\n</parameter>\n<parameter=n>\n1.5\n"
        '</parameter>\n<parameter=o>\n{"a": true}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert renderer.decode(renderer.render_prompt(messages, tools=[tool])) == expected
    assert template_ids(tokenizer, messages, [tool])[0] == expected


def qwen3_5_template_text(episode, enable_thinking: bool) -> str:
    """The template's rendering of the whole episode, from the trajectory's pieces and the documented
    difference: an assistant turn at or before the last user query whose reasoning is empty loses its
    <think> block (the generation prompt's opening of it and the turn's closing)."""
    messages = episode.conversation.messages()
    last_query = max(i for i, m in enumerate(messages) if m["role"] == "user")
    segments = [text for _, text, _ in episode.segments]
    message_index = len(episode.conversation.first) - 1
    segment_index = 0
    for assistant, environment in episode.conversation.turns:
        message_index += 1
        segment_index += 1  # the turn's segment
        if message_index <= last_query and not (assistant.get("reasoning_content") or "").strip():
            opening = "<think>\n" if enable_thinking else "<think>\n\n</think>\n\n"
            assert segments[segment_index - 1].endswith(opening)
            segments[segment_index - 1] = segments[segment_index - 1][: -len(opening)]
            if enable_thinking:
                assert segments[segment_index].startswith("\n</think>\n\n")
                segments[segment_index] = segments[segment_index][len("\n</think>\n\n") :]
        message_index += len(environment)
        segment_index += 1 if environment else 0
    return "".join(segments) + "\n"


def test_qwen3_5_token_identity_over_generated_episodes():
    tokenizer = qwen3_5_tokenizer()
    figures = new_identity_figures()
    renderers = {thinking: get_renderer("qwen3_5", tokenizer, enable_thinking=thinking) for thinking in (True, False)}
    for seed in range(N_EPISODES):
        rng = random.Random(seed)
        enable_thinking = rng.random() < 0.75
        conversation = random_conversation(
            rng, tuple(QWEN3_SPECIAL), reasoning=enable_thinking, offered=QWEN3_5_TOOLS, arguments=schema_arguments
        )
        renderer = renderers[enable_thinking]
        episode = simulate_episode(
            renderer, tokenizer, conversation, QWEN3_5_HEADER, QWEN_STOPS, enable_thinking=enable_thinking
        )
        for (assistant, _), turn in zip(conversation.turns, episode.parsed, strict=True):
            assert turn.parse_error is None
            assert turn.tool_calls == expected_tool_calls(assistant)
            assert turn.content == assistant["content"].strip()
            assert turn.reasoning == (assistant["reasoning_content"].strip() if enable_thinking else None)
        whole = tokenizer.apply_chat_template(
            conversation.messages(), tools=conversation.tools, tokenize=False, enable_thinking=enable_thinking
        )
        assert whole == qwen3_5_template_text(episode, enable_thinking), f"seed {seed}"
        record_identity(figures, tokenizer, episode, whole, "\n")
    print("qwen3_5 token identity:", figures)
    assert figures["episodes"] == N_EPISODES
    assert (
        figures["template_text_differs"] > 0 and figures["retokenized_ids_differ"] >= figures["template_text_differs"]
    )


def qwen3_5_parse(text, stop=True, tools=QWEN3_5_TOOLS, enable_thinking=True):
    renderer = get_renderer("qwen3_5", qwen3_5_tokenizer(), enable_thinking=enable_thinking)
    renderer.render_prompt([{"role": "user", "content": "q"}], tools=tools)
    return renderer.parse_turn(renderer.encode(text + ("<|im_end|>" if stop else "")))


def xml_call(name, *parameters):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_qwen3_5_parse_turn_types_arguments_by_the_offered_schemas():
    text = (
        "plan \n</think>\n\n OK \n\n"
        + xml_call(
            "configure",
            ("label", "3.14"),
            ("count", "-3"),
            ("ratio", "2"),
            ("enabled", "True"),
            ("tags", '["a", 1]'),
            ("options", '{"k": null}'),
            ("note", "None"),
            ("mode", "slow"),
            ("extra", "[1]"),
        )
        + "\n"
        + xml_call("search", ("query", "multi\nline\n"), ("limit", "5"))
        + "\n"
        + xml_call(
            "unknown",
            ("a", "1.5"),
            ("b", "False"),
            ("c", "None"),
            ("d", "not json"),
            ("e", ""),
        )
    )
    turn = qwen3_5_parse(text)
    assert (turn.reasoning, turn.content, turn.parse_error) == ("plan", "OK", None)
    assert turn.tool_calls == [
        ToolCall(
            "configure",
            {
                "label": "3.14",
                "count": -3,
                "ratio": 2,
                "enabled": True,
                "tags": ["a", 1],
                "options": {"k": None},
                "note": None,
                "mode": "slow",
                "extra": [1],
            },
        ),
        ToolCall("search", {"query": "multi\nline\n", "limit": 5}),
        ToolCall("unknown", {"a": 1.5, "b": False, "c": None, "d": "not json", "e": ""}),
    ]
    # a render_prompt call without tools keeps the schemas of the last one that offered them
    renderer = get_renderer("qwen3_5", qwen3_5_tokenizer())
    renderer.render_prompt([{"role": "user", "content": "q"}], tools=QWEN3_5_TOOLS)
    renderer.render_prompt([{"role": "user", "content": "q"}])
    turn = renderer.parse_turn(renderer.encode("\n</think>\n\n" + xml_call("search", ("query", "7")) + "<|im_end|>"))
    assert turn.tool_calls == [ToolCall("search", {"query": "7"})]
    # without schemas every argument is read as JSON, else a Python literal, else text
    assert qwen3_5_parse(xml_call("search", ("query", "7")), tools=None, enable_thinking=False).tool_calls == [
        ToolCall("search", {"query": 7})
    ]
    turn = qwen3_5_parse("just text  \n", enable_thinking=False)
    assert (turn.reasoning, turn.content, turn.tool_calls, turn.parse_error) == (None, "just text", [], None)


QWEN3_5_GOOD_CALL = xml_call("search", ("query", "x"))


@pytest.mark.parametrize(
    "text, error, kept",
    [
        (
            xml_call("search", ("query", "x"), ("limit", "ten")) + "\n" + QWEN3_5_GOOD_CALL,
            "tool call 1 (search): parameter 'limit': 'ten' is not integer as its schema says",
            1,
        ),
        (QWEN3_5_GOOD_CALL + "\n<tool_call>\n<function=python>\n", "tool call 2 is never closed by </tool_call>", 1),
        (
            '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>',
            """tool call 1 does not open with <function=NAME>: '{"name": "search", "arguments": {}}'""",
            0,
        ),
        (
            "<tool_call>\n<function=search>\n<parameter=query>\nx\n</parameter>\n</tool_call>",
            "tool call 1 (search) is never closed by </function>",
            0,
        ),
        (
            "<tool_call>\n<function=search>\n<parameter=query>\nx\n</function>\n</tool_call>",
            "tool call 1 (search): parameter 'query' is never closed by </parameter>",
            0,
        ),
        (
            "<tool_call>\n<function=search>\nquery: x\n</function>\n</tool_call>",
            "tool call 1 (search): text outside a parameter: 'query: x'",
            0,
        ),
        (
            xml_call("search", ("query", "x"), ("query", "y")),
            "tool call 1 (search): parameter 'query' is given twice",
            0,
        ),
        ("<tool_call>\n<function=>\n</function>\n</tool_call>", "tool call 1 has an empty function name", 0),
        (
            QWEN3_5_GOOD_CALL + "\nand then I will wait.",
            "text outside a tool call after call 1: 'and then I will wait.'",
            1,
        ),
        ("Here </tool_call> oops", "a </tool_call> with no <tool_call> before it", 0),
    ],
    ids=[
        "not_the_schema_type",
        "unclosed_last",
        "json_call",
        "unclosed_function",
        "unclosed_parameter",
        "text_in_function",
        "parameter_twice",
        "empty_name",
        "text_after",
        "stray_close",
    ],
)
def test_qwen3_5_parse_turn_malformed(text, error, kept):
    turn = qwen3_5_parse("R\n</think>\n\nBefore.\n\n" + text)
    assert turn.parse_error == error
    assert turn.tool_calls == [ToolCall("search", {"query": "x"})] * kept
    assert turn.content == ("Before." if "<tool_call>" in text else ("Before.\n\n" + text).strip())
    assert turn.reasoning == "R"


def test_qwen3_5_unclosed_reasoning():
    turn = qwen3_5_parse("still thinking\n", stop=False)
    assert (turn.content, turn.reasoning, turn.parse_error) == (
        "",
        "still thinking",
        "the reasoning is never closed by </think>",
    )


def test_qwen3_5_bad_input():
    tokenizer = qwen3_5_tokenizer()
    renderer = get_renderer("qwen3_5", tokenizer)
    turn = renderer.encode("hi<|im_end|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(turn[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 0 has role 'system'; this format takes \['user', 'tool'\]"):
        renderer.bridge(turn, [{"role": "system", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 2 is a system message; only the first may be"):
        renderer.render_prompt(
            [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}, {"role": "system", "content": "s2"}]
        )
    with pytest.raises(ValueError, match=r"the conversation has no user query"):
        renderer.render_prompt(
            [{"role": "system", "content": "s"}, {"role": "user", "content": "<tool_response>\n1\n</tool_response>"}]
        )
    with pytest.raises(ValueError, match=r"message 0 is a tool result with no assistant turn before it"):
        renderer.render_prompt([{"role": "tool", "content": "1"}, {"role": "user", "content": "q"}])
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|im_start\|>'"):
        get_renderer("qwen3_5", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


# ---- Llama 3 -------------------------------------------------------------------------------------------

LLAMA3_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|python_tag|>",
]
LLAMA3_HEADER, LLAMA3_STOPS = "<|start_header_id|>assistant<|end_header_id|>\n\n", ("<|eot_id|>", "<|eom_id|>")


def llama3_tokenizer():
    return family_tokenizer("llama3", tuple(LLAMA3_SPECIAL), False, max_calls=1, bos_token="<|begin_of_text|>")


LLAMA3_CONVERSATION = [
    {"role": "system", "content": "  You are a careful agent.\nAnswer briefly.\n"},
    {"role": "user", "content": "Weather in Paris and Tōkyō?  "},
    {"role": "assistant", "content": "ignored", "tool_calls": [call("get_weather", city="Paris", days=2)]},
    {"role": "tool", "content": '{"temp": 21}\n'},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="東京", units="c")]},
    {"role": "ipython", "content": "Error: timeout"},
    {"role": "assistant", "content": " Paris 21 °C, Tokyo unknown.\n"},
    {"role": "user", "content": "Search for more?"},
    {"role": "assistant", "content": "", "tool_calls": [call("search", query='paris "weather" {x}', limit=3)]},
    {"role": "tool", "content": "[]"},
]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("tools_in_user_message", [True, False], ids=["in_user", "in_system"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
@pytest.mark.parametrize("date_string", [None, "03 Mar 2025"], ids=["default_date", "date"])
def test_llama3_render_prompt_is_the_template(tools, tools_in_user_message, system, date_string):
    tokenizer = llama3_tokenizer()
    options = {"tools_in_user_message": tools_in_user_message} | ({"date_string": date_string} if date_string else {})
    renderer = get_renderer("llama3", tokenizer, **options)
    conversation = LLAMA3_CONVERSATION if system else LLAMA3_CONVERSATION[1:]
    # the template needs a user message to put the tools in
    first_end = 2 if system and tools and tools_in_user_message else 1
    assert_prompts_are_the_template(renderer, tokenizer, conversation, tools, first_end, **options)


def test_llama3_prompt_by_hand():
    """The format written out for a short conversation (the default system turn with the dates, the
    tools in the first user message, the call without the turn's content, the result as a JSON string)."""
    tokenizer = llama3_tokenizer()
    renderer = get_renderer("llama3", tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages = [
        {"role": "user", "content": " Q\n"},
        {"role": "assistant", "content": "dropped", "tool_calls": [call("f", x="é")]},
        {"role": "tool", "content": "1\n"},
        {"role": "assistant", "content": "A "},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
        "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, please respond with a JSON for a "
        "function call with its proper arguments that best answers the given prompt.\n\n"
        'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.'
        'Do not use variables.\n\n{\n    "type": "function",\n    "function": {\n        "name": "f",\n'
        '        "parameters": {}\n    }\n}\n\nQ<|eot_id|>'
        '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "f", "parameters": {"x": "é"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"1\\n"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\nA<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nQ2<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert renderer.decode(renderer.render_prompt(messages, tools=[tool])) == expected
    assert template_ids(tokenizer, messages, [tool])[0] == expected


def test_llama3_token_identity_over_generated_episodes():
    tokenizer = llama3_tokenizer()
    figures = new_identity_figures()
    for seed in range(N_EPISODES):
        rng = random.Random(seed)
        options = {
            "tools_in_user_message": rng.random() < 0.75,
            "date_string": rng.choice(["26 Jul 2024", "03 Mar 2025"]),
        }
        conversation = random_conversation(
            rng, tuple(LLAMA3_SPECIAL), reasoning=False, max_calls=1, tool_roles=("tool", "ipython")
        )
        renderer = get_renderer("llama3", tokenizer, **options)
        episode = simulate_episode(renderer, tokenizer, conversation, LLAMA3_HEADER, LLAMA3_STOPS, **options)
        for (assistant, _), turn in zip(conversation.turns, episode.parsed, strict=True):
            assert turn.parse_error is None and turn.reasoning is None
            expected_calls = expected_tool_calls(assistant)
            assert turn.tool_calls == expected_calls
            assert turn.content == ("" if expected_calls else assistant["content"].strip())
        whole = tokenizer.apply_chat_template(
            conversation.messages(), tools=conversation.tools, tokenize=False, **options
        )
        record_identity(figures, tokenizer, episode, whole, "")
    print("llama3 token identity:", figures)
    assert figures["episodes"] == N_EPISODES
    # the template is prefix-preserving on the turns it writes itself: its differences come from
    # turns sampled otherwise (test_llama3_not_prefix_preserving_points)
    assert figures["template_text_differs"] == figures["retokenized_ids_differ"] == 0


def test_llama3_not_prefix_preserving_points():
    """A turn sampled otherwise than the template writes it is rendered differently once the
    conversation is rendered again: the call re-serialized, the content trimmed, <|eom_id|> made <|eot_id|>."""
    tokenizer = llama3_tokenizer()
    renderer = get_renderer("llama3", tokenizer)
    messages = [{"role": "user", "content": "q"}]
    prompt_text = renderer.decode(renderer.render_prompt(messages, tools=TOOLS))
    for sampled, rendered in [
        (
            '{"parameters":{"query":"\\u00e9"},"name":"search"}<|eom_id|>',
            '{"name": "search", "parameters": {"query": "é"}}<|eot_id|>',
        ),
        ("  Hi there.\n<|eot_id|>", "Hi there.<|eot_id|>"),
    ]:
        turn = renderer.parse_turn(renderer.encode(sampled))
        assert turn.parse_error is None
        text, _ = template_ids(tokenizer, messages + [turn.message()], TOOLS, generation_prompt=False)
        assert text == prompt_text + rendered != prompt_text + sampled


def llama3_parse(text, stop="<|eot_id|>"):
    renderer = get_renderer("llama3", llama3_tokenizer())
    return renderer.parse_turn(renderer.encode(text + stop))


def test_llama3_parse_turn_well_formed():
    for text, stop in [
        ('{"name": "search", "parameters": {"query": "a\\nb"}}', "<|eot_id|>"),
        ('<|python_tag|>{"name": "search", "parameters": {"query": "a\\nb"}}', "<|eom_id|>"),
        ('\n { "name" : "search", "parameters": {"query": "a\\nb"}} ', ""),
    ]:
        turn = llama3_parse(text, stop)
        assert (turn.content, turn.reasoning, turn.parse_error) == ("", None, None)
        assert turn.tool_calls == [ToolCall("search", {"query": "a\nb"})]
        assert turn.message()["tool_calls"][0]["function"] == {"name": "search", "arguments": {"query": "a\nb"}}
    turn = llama3_parse(' {"answer": 42} is the JSON.\n')
    assert (turn.content, turn.tool_calls, turn.parse_error) == ('{"answer": 42} is the JSON.', [], None)


@pytest.mark.parametrize(
    "text, error",
    [
        (
            '{"name": "search", "parameters": {"query": }}',
            "tool call 1 is not valid JSON (Expecting value at line 1 column 44): "
            """'{"name": "search", "parameters": {"query": }}'""",
        ),
        (
            '{"name": "search", "parameters": {}}; {"name": "python", "parameters": {}}',
            "tool call 1 is not valid JSON (Extra data at line 1 column 37): "
            """'{"name": "search", "parameters": {}}; {"name": "python", "parameters": {}}'""",
        ),
        (
            '{"name": "search", "arguments": {}}',
            'tool call 1 has keys other than "name" and "parameters": [\'arguments\']',
        ),
        ('{"name": "search"}', 'tool call 1 (search) has no "parameters"'),
        ('{"parameters": {}}', 'tool call 1 has no "name" (a non-empty string)'),
        ('{"name": "search", "parameters": "x"}', 'tool call 1 (search): "parameters" is a JSON string, not an object'),
        ("<|python_tag|>[1]", 'tool call 1 is a JSON array, not an object with "name" and "parameters"'),
    ],
    ids=["bad_json", "two_calls", "arguments_key", "no_parameters", "no_name", "parameters_string", "not_an_object"],
)
def test_llama3_parse_turn_malformed(text, error):
    turn = llama3_parse(text)
    assert (turn.content, turn.tool_calls, turn.parse_error) == ("", [], error)


def test_llama3_bad_input():
    tokenizer = llama3_tokenizer()
    renderer = get_renderer("llama3", tokenizer)
    turn = renderer.encode("hi<|eot_id|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(turn[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(
        ValueError, match=r"message 0 has role 'assistant'; this format takes \['system', 'user', 'tool', 'ipython'\]"
    ):
        renderer.bridge(turn, [{"role": "assistant", "content": "x"}])
    with pytest.raises(
        ValueError, match=r"message 1 \(assistant\) has 2 tool calls; the Llama 3 template takes exactly one a turn"
    ):
        renderer.render_prompt(
            [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": "", "tool_calls": [call("f"), call("g")]},
            ]
        )
    with pytest.raises(
        ValueError, match=r"with tools, the first message after the system message must be a user message"
    ):
        renderer.render_prompt([{"role": "system", "content": "s"}], tools=TOOLS)
    with pytest.raises(ValueError, match=r"date_string must be a non-empty string such as '26 Jul 2024', got ''"):
        get_renderer("llama3", tokenizer, date_string="")
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|begin_of_text\|>'"):
        get_renderer("llama3", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


# ---- Qwen2.5 -------------------------------------------------------------------------------------------

QWEN2_HEADER = "<|im_start|>assistant"


def qwen2_tokenizer():
    return family_tokenizer("qwen2", tuple(QWEN_SPECIAL), False)


QWEN2_CONVERSATION = [
    {"role": "system", "content": "You are a careful agent.\nAnswer briefly.\n"},
    {"role": "user", "content": "Weather in Paris and Tōkyō?  "},
    {
        "role": "assistant",
        "content": "Let me look both up.",
        "tool_calls": [call("get_weather", city="Paris", days=2), call("get_weather", city="東京", units="c")],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": "Error: timeout\n"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Tokyo")]},
    {"role": "tool", "content": "18 °C"},
    {"role": "assistant", "content": "\nParis 21 °C, Tokyo 18 °C. "},
    {"role": "system", "content": "Use Fahrenheit from now on."},
    {"role": "user", "content": "And in Fahrenheit?\n"},
    {"role": "assistant", "content": "Sure:\n", "tool_calls": [call("search", query='paris "weather" {x}', limit=3)]},
    {"role": "tool", "content": "[]"},
]


@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
def test_qwen2_render_prompt_is_the_template(tools, system):
    tokenizer = qwen2_tokenizer()
    renderer = get_renderer("qwen2", tokenizer)
    conversation = QWEN2_CONVERSATION if system else QWEN2_CONVERSATION[1:]
    assert_prompts_are_the_template(renderer, tokenizer, conversation, tools)


def test_qwen2_prompt_by_hand():
    """The format written out for a short conversation (the default system message before the tools,
    the calls after the content, the grouped tool results)."""
    tokenizer = qwen2_tokenizer()
    renderer = get_renderer("qwen2", tokenizer)
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    messages = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "C", "tool_calls": [call("f", x="é"), call("f")]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "A "},
        {"role": "user", "content": "Q2"},
    ]
    expected = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n"
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
        '{"type": "function", "function": {"name": "f", "parameters": {}}}\n</tools>\n\n'
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nQ<|im_end|>\n"
        '<|im_start|>assistant\nC\n<tool_call>\n{"name": "f", "arguments": {"x": "é"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nA <|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert renderer.decode(renderer.render_prompt(messages, tools=[tool])) == expected
    assert template_ids(tokenizer, messages, [tool])[0] == expected


def test_qwen2_token_identity_over_generated_episodes():
    tokenizer = qwen2_tokenizer()
    renderer = get_renderer("qwen2", tokenizer)
    figures = new_identity_figures()
    for seed in range(N_EPISODES):
        rng = random.Random(seed)
        conversation = random_conversation(rng, tuple(QWEN_SPECIAL), reasoning=False)
        episode = simulate_episode(renderer, tokenizer, conversation, QWEN2_HEADER, QWEN_STOPS)
        for (assistant, _), turn in zip(conversation.turns, episode.parsed, strict=True):
            assert turn.parse_error is None and turn.reasoning is None
            assert turn.tool_calls == expected_tool_calls(assistant)
            assert turn.content == assistant["content"]
        whole = tokenizer.apply_chat_template(conversation.messages(), tools=conversation.tools, tokenize=False)
        record_identity(figures, tokenizer, episode, whole, "\n")
    print("qwen2 token identity:", figures)
    assert figures["episodes"] == N_EPISODES
    # the template writes its own turns again as they were; only the tokenization at the start of a
    # turn that begins with whitespace differs
    assert figures["template_text_differs"] == 0
    assert figures["retokenized_ids_differ"] == figures["same_text_other_ids"] > 0


def test_qwen2_call_sampled_otherwise_is_rendered_differently():
    tokenizer = qwen2_tokenizer()
    renderer = get_renderer("qwen2", tokenizer)
    messages = [{"role": "user", "content": "q"}]
    prompt_text = renderer.decode(renderer.render_prompt(messages, tools=TOOLS))
    sampled = '<tool_call>\n{"arguments":{"query":"\\u00e9"},"name":"search"}\n</tool_call><|im_end|>'
    turn = renderer.parse_turn(renderer.encode(sampled))
    assert (turn.content, turn.tool_calls, turn.parse_error) == ("", [ToolCall("search", {"query": "é"})], None)
    text, _ = template_ids(tokenizer, messages + [turn.message()], TOOLS, generation_prompt=False)
    rendered = '<tool_call>\n{"name": "search", "arguments": {"query": "é"}}\n</tool_call><|im_end|>\n'
    assert text == prompt_text + rendered != prompt_text + sampled + "\n"


@HERMES_MALFORMED
def test_qwen2_parse_turn_malformed(text, error, kept):
    renderer = get_renderer("qwen2", qwen2_tokenizer())
    turn = renderer.parse_turn(renderer.encode("Before.\n" + text + "<|im_end|>"))
    assert turn.parse_error == error
    assert turn.tool_calls == [ToolCall("search", {"query": "x"})] * kept
    assert turn.content == ("Before." if "<tool_call>" in text else "Before.\n" + text)


def test_qwen2_bad_input():
    tokenizer = qwen2_tokenizer()
    renderer = get_renderer("qwen2", tokenizer)
    turn = renderer.encode("hi<|im_end|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(turn[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(
        ValueError, match=r"message 0 has role 'assistant'; this format takes \['system', 'user', 'tool'\]"
    ):
        renderer.bridge(turn, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 0 \(user\) needs string content, got list"):
        renderer.render_prompt([{"role": "user", "content": ["q"]}])
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|im_start\|>'"):
        get_renderer("qwen2", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


def test_family_names_its_renderers():
    expected = {
        "qwen3": "qwen3",
        "qwen3_moe": "qwen3",
        "qwen3_5": "qwen3_5",
        "qwen3_5_text": "qwen3_5",
        "qwen3_5_moe": "qwen3_5",
        "qwen3_5_moe_text": "qwen3_5",
        "llama": "llama3",
        "qwen2": "qwen2",
    }
    for model_type, name in expected.items():
        assert default_renderer_name(model_type) == name
