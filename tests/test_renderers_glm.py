"""The glm5 renderer (GLM-5, model_type glm_moe_dsa) against its real chat template
(tests/fixtures/chat_templates/glm5.jinja), on a byte-level BPE tokenizer with its special tokens.

render_prompt gives the template's text and ids on a hand-written conversation; over 1,000 generated
episodes the trajectory (prompt, sampled turns verbatim, bridged environment messages) is the
template's sampled turns plus its environment text, and equals the template's rendering of the whole
conversation up to the documented difference; parse_turn reads each turn back; malformed calls give
a parse_error that says what is wrong.
"""

from __future__ import annotations

import functools
import random

import pytest
from renderer_cases import TOOLS, build_bpe_tokenizer, random_conversation, read_template, typed_arguments
from transformers.utils.chat_template_utils import render_jinja_template

from archon.agents.renderer import ToolCall, default_renderer_name, get_renderer

N_EPISODES = 1000
GLM_SPECIAL = (
    "[gMASK]",
    "<sop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<|endoftext|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
)


def glm5_conversation(rng):
    """An episode whose turns all have reasoning; the environment answers a turn with its calls'
    results or with a user message (the model stops on the next message's role token, one kind)."""
    conversation = random_conversation(rng, GLM_SPECIAL, reasoning=True, arguments=typed_arguments)
    for assistant, environment in conversation.turns:
        if not assistant["reasoning_content"].strip():
            assistant["reasoning_content"] += "thinking"
        if any(m["role"] == "tool" for m in environment):
            environment[:] = [m for m in environment if m["role"] == "tool"]
    return conversation


@functools.cache
def glm5_tokenizer():
    chat_template = read_template("glm5")
    rng = random.Random(12345)
    corpus = []
    for _ in range(300):
        conversation = glm5_conversation(rng)
        rendered, _ = render_jinja_template(
            [conversation.messages()], tools=conversation.tools, chat_template=chat_template
        )
        corpus.append(rendered[0])
    return build_bpe_tokenizer(list(GLM_SPECIAL), corpus, 3000, chat_template=chat_template)


def call(name, **arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def template_text(tokenizer, messages, tools, generation_prompt, **options):
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False, **options
    )


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "You are a careful agent.\nAnswer briefly."},
    {"role": "user", "content": "Weather in Paris and Tōkyō?  "},
    {
        "role": "assistant",
        "content": " Let me look both up.",
        "reasoning_content": "Two cities,\ntwo calls. ",
        "tool_calls": [call("get_weather", city="Paris", days=2), call("get_weather", city="東京", units="c")],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": "Error: timeout\n"},
    {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call("search", query="x")]},
    {"role": "tool", "content": "18 °C"},
    {"role": "assistant", "content": "Paris 21 °C, Tokyo 18 °C.", "reasoning_content": "Done."},
    {"role": "user", "content": "And in Fahrenheit?\n"},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Search for more?"},
]


@pytest.mark.parametrize("enable_thinking", [True, False])
@pytest.mark.parametrize("tools", [TOOLS, None], ids=["tools", "no_tools"])
def test_glm5_render_prompt_is_the_template(tools, enable_thinking):
    tokenizer = glm5_tokenizer()
    renderer = get_renderer("glm5", tokenizer, enable_thinking=enable_thinking)
    for end in range(1, len(CONVERSATION) + 1):
        if CONVERSATION[end - 1]["role"] in ("assistant", "system"):
            continue
        messages = CONVERSATION[:end]
        text = template_text(tokenizer, messages, tools, True, enable_thinking=enable_thinking)
        ids = renderer.render_prompt(messages, tools=tools)
        assert renderer.decode(ids) == text
        assert ids == encode(tokenizer, text)


def glm5_history_form(segments, conversation) -> str:
    """The template's text of the whole episode from the trajectory's pieces: the reasoning of every
    turn before the last user message is written `</think>` (the generation prompt's `<think>` and
    the turn's `REASONING</think>` become `</think>`), and no stop token follows the last turn."""
    messages = conversation.messages()
    last_user = max(i for i, m in enumerate(messages) if m["role"] == "user")
    message_index, segment_index = len(conversation.first) - 1, 0
    for assistant, environment in conversation.turns:
        message_index += 1
        segment_index += 1
        if message_index < last_user:
            reasoning = assistant["reasoning_content"].strip()
            assert segments[segment_index - 1].endswith("<think>")
            assert segments[segment_index].startswith(reasoning + "</think>")
            segments[segment_index - 1] = segments[segment_index - 1][: -len("<think>")]
            segments[segment_index] = segments[segment_index][len(reasoning) :]
        message_index += len(environment)
        segment_index += 1 if environment else 0
    text = "".join(segments)
    assert text.endswith("<|user|>")
    return text[: -len("<|user|>")]


def stop_text(environment) -> str:
    """The model ends its turn with the next message's role token."""
    return "<|observation|>" if environment and environment[0]["role"] == "tool" else "<|user|>"


def run_glm5_episode(tokenizer, renderer, conversation):
    """The episode as an episode loop runs it, each piece checked against the template; returns the
    trajectory's segments (texts) and ids, and the sampled turns read back."""
    tools = conversation.tools
    history = list(conversation.first)
    prompt = template_text(tokenizer, history, tools, True)
    prompt_ids = renderer.render_prompt(history, tools=tools)
    assert prompt_ids == encode(tokenizer, prompt)
    segments, trajectory, parsed = [prompt], list(prompt_ids), []
    for assistant, environment in conversation.turns:
        with_turn = template_text(tokenizer, history + [assistant], tools, False)
        assert with_turn.startswith(prompt)
        sampled = with_turn[len(prompt) :] + stop_text(environment)
        sampled_ids = encode(tokenizer, sampled)
        assert sampled_ids[-1] in renderer.stop_token_ids
        segments.append(sampled)
        trajectory += sampled_ids
        parsed.append(renderer.parse_turn(sampled_ids))
        history.append(assistant)
        if not environment:
            continue
        history += environment
        prompt = template_text(tokenizer, history, tools, True)
        if environment[0]["role"] == "tool":  # no user message: the earlier turns render as before
            assert prompt.startswith(with_turn)
            environment_text = prompt[len(with_turn) :]
        else:
            environment_text = prompt[prompt.rindex("<|user|>") :]
        environment_text = environment_text.removeprefix(stop_text(environment))
        bridged = renderer.bridge(sampled_ids, environment)
        assert bridged == encode(tokenizer, environment_text)
        segments.append(environment_text)
        trajectory += bridged
    return segments, trajectory, parsed


def test_glm5_token_identity_over_generated_episodes():
    tokenizer = glm5_tokenizer()
    figures = {"episodes": 0, "turns": 0, "template_text_differs": 0, "retokenized_ids_differ": 0}
    for seed in range(N_EPISODES):
        conversation = glm5_conversation(random.Random(seed))
        renderer = get_renderer("glm5", tokenizer)
        segments, trajectory, parsed = run_glm5_episode(tokenizer, renderer, conversation)
        for (assistant, _), turn in zip(conversation.turns, parsed, strict=True):
            assert turn.parse_error is None, f"seed {seed}: {turn.parse_error}"
            expected_calls = [
                ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in assistant.get("tool_calls", [])
            ]
            assert turn.tool_calls == expected_calls, f"seed {seed}"
            assert (turn.content, turn.reasoning) == (
                assistant["content"].strip(),
                assistant["reasoning_content"].strip(),
            )
        assert tokenizer.decode(trajectory, skip_special_tokens=False) == "".join(segments)
        whole = template_text(tokenizer, conversation.messages(), conversation.tools, False)
        assert whole == glm5_history_form(list(segments), conversation), f"seed {seed}"
        figures["episodes"] += 1
        figures["turns"] += len(conversation.turns)
        figures["template_text_differs"] += whole != "".join(segments)[: -len("<|user|>")]
        figures["retokenized_ids_differ"] += encode(tokenizer, whole) != trajectory[:-1]
    print("glm5 token identity:", figures)
    assert figures["template_text_differs"] > 0


def test_glm5_thinking_switch_and_empty_reasoning():
    tokenizer = glm5_tokenizer()
    messages = CONVERSATION[1:2]
    renderer = get_renderer("glm5", tokenizer, enable_thinking=False)
    assert renderer.decode(renderer.render_prompt(messages)).endswith("<|assistant|></think>")
    turn = renderer.parse_turn(renderer.encode("Hi.<|user|>"))
    assert (turn.content, turn.reasoning, turn.parse_error) == ("Hi.", None, None)
    # a turn sampled with empty reasoning is written without the <think> the prompt opened
    thinking = get_renderer("glm5", tokenizer)
    prompt = thinking.decode(thinking.render_prompt(messages))
    assert prompt.endswith("<|assistant|><think>")
    turn = thinking.parse_turn(thinking.encode("</think>Hi.<|user|>"))
    assert (turn.content, turn.reasoning) == ("Hi.", "")
    whole = template_text(tokenizer, messages + [turn.message()], None, False)
    assert whole == prompt.removesuffix("<think>") + "</think>Hi."


def glm5_parse(text, tools=TOOLS):
    renderer = get_renderer("glm5", glm5_tokenizer())
    renderer.render_prompt(CONVERSATION[1:2], tools=tools)
    return renderer.parse_turn(renderer.encode(text + "<|observation|>"))


@pytest.mark.parametrize(
    "text, calls, content, reasoning, error",
    [
        (
            "plan</think> OK <tool_call>search<arg_key>query</arg_key><arg_value>3.14</arg_value>"
            "<arg_key>limit</arg_key><arg_value>-7</arg_value></tool_call>"
            "<tool_call>now</tool_call>",
            [ToolCall("search", {"query": "3.14", "limit": -7}), ToolCall("now", {})],
            "OK",
            "plan",
            None,
        ),
        ("still thinking", [], "", "still thinking", "the reasoning is never closed by </think>"),
        ("r</think><tool_call>search<arg_key>query</arg_key>", [], "", "r", "tool call 0 is not closed"),
        (
            "r</think><tool_call>search<arg_key>limit</arg_key><arg_value>many</arg_value></tool_call>",
            [],
            "",
            "r",
            "argument 'limit' is declared integer but its value is not JSON",
        ),
        ("r</think><tool_call></tool_call>", [], "", "r", "a tool call has no function name"),
    ],
)
def test_glm5_parse_turn(text, calls, content, reasoning, error):
    turn = glm5_parse(text)
    assert (turn.tool_calls, turn.content, turn.reasoning) == (calls, content, reasoning)
    assert (turn.parse_error is None) if error is None else (error in turn.parse_error)


def test_glm5_bad_input():
    renderer = get_renderer("glm5", glm5_tokenizer())
    turn = renderer.encode("r</think>A<|user|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(turn[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"environment adds tool results and user turns, not 'assistant'"):
        renderer.bridge(turn, [{"role": "assistant", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 1: role 'ipython' is not one the glm5 format renders"):
        renderer.render_prompt([{"role": "user", "content": "q"}, {"role": "ipython", "content": "1"}])
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|user\|>'"):
        get_renderer("glm5", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


def test_glm5_is_named_for_glm_moe_dsa():
    assert default_renderer_name("glm_moe_dsa") == "glm5"
    with pytest.raises(ValueError, match=r"names no renderer for model_type 'deepseek_v32'"):
        default_renderer_name("deepseek_v32")
