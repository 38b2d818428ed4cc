"""The olmo3_think renderer against the Olmo 3 Think chat template as Ai2's post-training code holds it
(tests/fixtures/chat_templates/olmo3_think.jinja: allenai/open-instruct's `olmo_thinker`, which its
docs/olmo3.md names as the Olmo-3-32B-Think release template; provenance in that folder's README), on a
byte-level BPE tokenizer with the family's special tokens, `<|endoftext|>` as the template's eos_token.

render_prompt gives the template's text and ids on a hand-written conversation; over generated episodes the
trajectory is the prompt, each sampled turn verbatim (`REASONING</think>ANSWER` and a stop token) and the
template's text for what the environment adds; parse_turn reads each turn back.
"""

from __future__ import annotations

import functools
import random

import pytest
from renderer_cases import build_bpe_tokenizer, random_conversation, read_template
from transformers.utils.chat_template_utils import render_jinja_template

from archon.agents.renderer import get_renderer

N_EPISODES = 300
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>")
HEADER = "<|im_start|>assistant\n"


def template(messages, generation_prompt):
    rendered, _ = render_jinja_template(
        [messages],
        chat_template=read_template("olmo3_think"),
        add_generation_prompt=generation_prompt,
        eos_token="<|endoftext|>",
    )
    return rendered[0]


def conversation_for(rng):
    """An episode of reasoning turns answered by user messages (the format has no tools)."""
    return random_conversation(rng, SPECIAL, reasoning=True, offered=[])


@functools.cache
def tokenizer():
    rng = random.Random(12345)
    corpus = [template(conversation_for(rng).messages(), True) for _ in range(150)]
    return build_bpe_tokenizer(SPECIAL, corpus, 2000)


def encode(text):
    return tokenizer().encode(text, add_special_tokens=False)


CONVERSATION = [
    {"role": "system", "content": "You are careful.\n"},
    {"role": "user", "content": "Is 123 a prime?  "},
    {"role": "assistant", "content": "No: 3 × 41.", "reasoning_content": "1+2+3 = 6."},
    {"role": "user", "content": "And 127?"},
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Why?"},
]


@pytest.mark.parametrize("system", [True, False], ids=["system", "no_system"])
def test_render_prompt_is_the_template(system):
    renderer = get_renderer("olmo3_think", tokenizer())
    conversation = CONVERSATION if system else [m for m in CONVERSATION if m["role"] != "system"]
    for end in range(1, len(conversation) + 1):
        if conversation[end - 1]["role"] == "assistant":
            continue
        messages = conversation[:end]
        text = template(messages, True)
        ids = renderer.render_prompt(messages)
        assert renderer.decode(ids) == text
        assert ids == encode(text)


def test_token_identity_over_generated_episodes():
    renderer = get_renderer("olmo3_think", tokenizer())
    figures = {"episodes": 0, "turns": 0, "template_text_differs": 0, "retokenized_ids_differ": 0}
    for seed in range(N_EPISODES):
        rng = random.Random(seed)
        conversation = conversation_for(rng)
        history = list(conversation.first)
        prompt = template(history, True)
        trajectory = renderer.render_prompt(history)
        assert trajectory == encode(prompt)
        segments = [prompt]
        for assistant, environment in conversation.turns:
            stop = rng.choice(["<|im_end|>", "<|endoftext|>"])
            sampled = assistant["reasoning_content"] + "</think>" + assistant["content"] + stop
            sampled_ids = encode(sampled)
            turn = renderer.parse_turn(sampled_ids)
            assert (turn.reasoning, turn.content, turn.parse_error) == (
                assistant["reasoning_content"],
                assistant["content"],
                None,
            )
            segments.append(sampled)
            trajectory += sampled_ids
            if not environment:
                continue
            before = template(history, False)
            history += [assistant, *environment]
            full = template(history, True)
            written = f"{HEADER}{assistant['content']}<|im_end|>"  # the turn as the template writes it in history
            assert full.startswith(before + written), f"seed {seed}"
            bridged = renderer.bridge(sampled_ids, environment)
            assert bridged == encode(full[len(before + written) :]), f"seed {seed}"
            segments.append(full[len(before + written) :])
            trajectory += bridged
        assert renderer.decode(trajectory) == "".join(segments)
        whole = template(conversation.messages(), False)
        figures["episodes"] += 1
        figures["turns"] += len(conversation.turns)
        figures["template_text_differs"] += whole != "".join(segments)
        figures["retokenized_ids_differ"] += encode(whole) != trajectory
    print("olmo3_think token identity:", figures)
    assert figures["template_text_differs"] == N_EPISODES  # every sampled turn has `</think>`, history has none


def test_parse_turn_and_bad_input():
    renderer = get_renderer("olmo3_think", tokenizer())
    turn = renderer.parse_turn(renderer.encode("still thinking<|im_end|>"))
    assert (turn.reasoning, turn.parse_error) == ("still thinking", "the reasoning is never closed by </think>")
    sampled = renderer.encode("r</think>A<|im_end|>")
    with pytest.raises(ValueError, match=r"bridge\(\) needs a turn that ended with a stop token"):
        renderer.bridge(sampled[:-1], [{"role": "user", "content": "x"}])
    with pytest.raises(ValueError, match=r"message 0 has role 'tool'; this format takes \['user'\]"):
        renderer.bridge(sampled, [{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match=r"the Olmo 3 Think template renders no tools"):
        renderer.render_prompt(CONVERSATION[:2], tools=[{"type": "function", "function": {"name": "f"}}])
    with pytest.raises(ValueError, match=r"must end with a user or system message"):
        renderer.render_prompt(CONVERSATION[:3])
    with pytest.raises(ValueError, match=r"the tokenizer has no single token for '<\|im_end\|>'"):
        get_renderer("olmo3_think", build_bpe_tokenizer(["<|endoftext|>"], ["some text"], 300))


def test_untrusted_content_is_plain_text():
    renderer = get_renderer("olmo3_think", tokenizer())
    bridged = renderer.bridge(renderer.encode("r</think>A<|im_end|>"), [{"role": "user", "content": "x<|im_start|>"}])
    assert "x<|im_start|>" in renderer.decode(bridged)
    assert bridged.count(renderer.token_id("<|im_start|>")) == 2  # the user turn's and the assistant's
