"""The gpt_oss, glm4_5, deepseek_v3 and kimi_k2 renderers against each family's real chat template
(tests/fixtures/chat_templates/), on byte-level BPE tokenizers with the family's special tokens.

Each family is checked on hand-written conversations (prompt text and ids equal to the template's),
on 1,000 generated episodes (the trajectory of sampled ids and bridged ids against the template's
rendering of the whole conversation, exactly where the template is prefix-preserving and up to the
documented difference where it is not), on reading back every sampled turn, and on malformed calls.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from archon.agents.renderer import ToolCall, get_renderer
from tests.renderer_cases import build_bpe_tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
NUM_EPISODES = 1000

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the notes for a query.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "What to look for."},
                    "limit": {"type": "integer", "description": "How many results.", "default": 5},
                },
                "required": ["query"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write text to a file.",
            "parameters": {
                "type": "object",
                "properties": {
                    "path": {"type": "string"},
                    "text": {"type": "string", "description": "The file's new text."},
                    "append": {"type": "boolean"},
                    "mode": {"type": "string", "enum": ["plain", "markdown"], "default": "plain"},
                },
                "required": ["path", "text"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "compute",
            "description": "Evaluate an expression over values.",
            "parameters": {
                "type": "object",
                "properties": {
                    "expression": {"type": "string"},
                    "values": {"type": "array", "items": {"type": "number"}},
                    "options": {
                        "type": "object",
                        "properties": {"precision": {"type": "integer"}, "unit": {"type": "string"}},
                        "required": ["precision"],
                    },
                },
                "required": ["expression"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "now",
            "description": "The current time.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]

WORDS = [
    "the",
    "value",
    "is",
    "file",
    "result",
    "42",
    "3.14",
    "x",
    "données",
    "naïve",
    "日本語",
    "中文",
    "тест",
    "مرحبا",
    "🙂",
    "🚀",
    "a_b",
    "{",
    "}",
    "[",
    "]",
    ":",
    ",",
    '"quoted"',
    "'",
    "\\",
    "path/to",
    "-1",
    "true",
    "null",
    "<",
    ">",
    "&",
    "=",
    "#",
    "*",
    "é",
    "ß",
    "Ω",
    "∑",
    "tab\there",
    "über",
    "ok.",
    "Error",
    "hello",
]
SPACES = [" ", " ", " ", "  ", "\n", "\n\n", "\t", " \n", "   "]


def random_text(rng: random.Random, low: int = 1, high: int = 12) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(low, high))]
    text = words[0]
    for word in words[1:]:
        text += rng.choice(SPACES) + word
    if rng.random() < 0.2:
        text = rng.choice(SPACES) + text
    if rng.random() < 0.2:
        text += rng.choice(SPACES)
    return text


def random_arguments(rng: random.Random, name: str) -> dict:
    if name == "search":
        arguments = {"query": random_text(rng)}
        if rng.random() < 0.5:
            arguments["limit"] = rng.randint(-3, 100)
    elif name == "write_file":
        arguments = {"path": random_text(rng, 1, 3), "text": random_text(rng, 1, 20)}
        if rng.random() < 0.5:
            arguments["append"] = rng.random() < 0.5
    elif name == "compute":
        arguments = {"expression": random_text(rng, 1, 5)}
        if rng.random() < 0.6:
            arguments["values"] = [
                rng.choice([rng.randint(-9, 99), round(rng.uniform(-5, 5), 3)]) for _ in range(rng.randint(0, 4))
            ]
        if rng.random() < 0.4:
            arguments["options"] = {"precision": rng.randint(0, 9), "unit": random_text(rng, 1, 2)}
    else:
        arguments = {}
    return arguments


@dataclass
class Family:
    renderer: str
    template: str
    special_tokens: list[str]
    max_calls_per_turn: int
    thinking: bool
    template_kwargs: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    string_arguments: bool = False  # the template takes a call's arguments as a JSON string
    tools_template: str | None = (
        None  # a template that writes the tools into the system prompt the family's template renders
    )
    call_ids: bool = False  # calls carry ids (functions.NAME:IDX), tool results the id they answer


def assistant_message(reasoning, content, calls) -> dict:
    message = {"role": "assistant", "content": content}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
        message["thinking"] = reasoning  # the gpt_oss template's name for it
    if calls:
        message["tool_calls"] = [
            {
                "type": "function",
                **({"id": c.id} if c.id is not None else {}),
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return message


def generate_episode(rng: random.Random, family: Family):
    """(first messages, [(assistant message, environment messages)]); the last turn is a final answer."""
    first = []
    if rng.random() < 0.7:
        first.append({"role": "system", "content": random_text(rng, 1, 15)})
    first.append({"role": "user", "content": random_text(rng, 1, 15)})
    turns = []
    call_count = 0
    num_turns = rng.randint(1, 5)
    for t in range(num_turns):
        last = t == num_turns - 1
        reasoning = random_text(rng, 1, 25) if family.thinking and rng.random() < 0.85 else None
        if not last and rng.random() < 0.75:
            calls = []
            for _ in range(rng.randint(1, family.max_calls_per_turn)):
                name = rng.choice([tool["function"]["name"] for tool in TOOLS])
                call_id = f"functions.{name}:{call_count}" if family.call_ids else None
                call_count += 1
                calls.append(ToolCall(name, random_arguments(rng, name), call_id))
            content = "" if reasoning is not None or rng.random() < 0.5 else random_text(rng)
            env = []
            for call in calls:
                result = random_text(rng, 1, 20)
                if rng.random() < 0.2:
                    result = f"Error: {call.name} failed:{rng.choice(SPACES)}{random_text(rng, 1, 6)}"
                env.append({"role": "tool", "name": call.name, "content": result})
                if call.id is not None:
                    env[-1]["tool_call_id"] = call.id
            turns.append((assistant_message(reasoning, content, calls), env))
        else:
            env = [] if last else [{"role": "user", "content": random_text(rng, 1, 15)}]
            turns.append((assistant_message(reasoning, random_text(rng, 1, 20), []), env))
    return first, turns


def template_messages(family: Family, messages):
    if not family.string_arguments:
        return messages
    return [
        {
            **m,
            "tool_calls": [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"], ensure_ascii=False),
                    },
                }
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in messages
    ]


def template_text(tokenizer, family: Family, messages, add_generation_prompt: bool, tools=TOOLS) -> str:
    if family.tools_template and tools:
        messages, tools = tools_system_messages(tokenizer, family, messages, tools), None
    return tokenizer.apply_chat_template(
        template_messages(family, messages),
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
        **family.template_kwargs,
    )


def tools_system_messages(tokenizer, family: Family, messages, tools):
    """`messages` with their system messages replaced by the one system prompt, tools included, that
    `family.tools_template` writes between the BOS token and the first user turn (DeepSeek's `<｜User｜>`)."""
    template = (TEMPLATES / family.tools_template).read_text(encoding="utf-8")
    text = tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, tokenize=False, **family.template_kwargs
    )
    system_prompt = text.split(tokenizer.bos_token, 1)[1].split("<｜User｜>", 1)[0]
    return [{"role": "system", "content": system_prompt}] + [m for m in messages if m["role"] != "system"]


def encode(tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


# ---- gpt_oss ---------------------------------------------------------------------------------------------

GPT_OSS = Family(
    renderer="gpt_oss",
    template="gpt_oss.jinja",
    special_tokens=[
        "<|start|>",
        "<|end|>",
        "<|message|>",
        "<|channel|>",
        "<|constrain|>",
        "<|return|>",
        "<|call|>",
        "<|startoftext|>",
        "<|endoftext|>",
    ],
    max_calls_per_turn=1,  # <|call|> ends the turn
    thinking=True,
    template_kwargs={"strftime_now": lambda fmt: "2025-06-28"},
    options={"current_date": "2025-06-28"},
)

_HARMONY_MESSAGE = re.compile(r"<\|start\|>.*?(?:<\|end\|>|<\|call\|>|<\|return\|>)", re.S)


def gpt_oss_history_form(trajectory_text: str) -> str:
    """The documented difference: the template drops the analysis of every assistant turn that is
    followed by a final answer later in the conversation (the last turn's own analysis is kept) and
    writes every <|return|> but the conversation's last as <|end|>."""
    messages = _HARMONY_MESSAGE.findall(trajectory_text)
    assert "".join(messages) == trajectory_text
    kept = []
    for i, message in enumerate(messages):
        if message.startswith("<|start|>assistant<|channel|>analysis"):
            following = messages[i + 1]
            later_final = any(m.startswith("<|start|>assistant<|channel|>final") for m in messages[i + 1 :])
            is_last_turn = following == messages[-1] and following.endswith("<|return|>")
            if later_final and not is_last_turn:
                continue
        if message.endswith("<|return|>") and i != len(messages) - 1:
            message = message[: -len("<|return|>")] + "<|end|>"
        kept.append(message)
    return "".join(kept)


def gpt_oss_turn_text(full: str) -> str:
    """The last turn's text: what follows the last user or tool message and the next `<|start|>assistant`."""
    last = max(full.rfind("<|start|>user"), full.rfind("<|start|>functions."))
    end = full.index("<|end|>", last) + len("<|end|><|start|>assistant")
    return full[end:]


# ---- glm4_5 ----------------------------------------------------------------------------------------------

GLM = Family(
    renderer="glm4_5",
    template="glm4_5.jinja",
    special_tokens=[
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
    ],
    max_calls_per_turn=4,
    thinking=True,
)


def glm_stop_text(env) -> str:
    """The model ends a turn with the next message's role token."""
    return "<|observation|>" if env and env[0]["role"] == "tool" else "<|user|>"


def glm_history_form(trajectory_text: str) -> str:
    """The documented difference: the template renders the reasoning of every turn before the last
    user message as <think></think>, and has no stop token after the conversation's last turn."""
    assert trajectory_text.endswith("<|user|>")
    text = trajectory_text[: -len("<|user|>")]
    last_user = text.rfind("<|user|>")
    return re.sub(r"\n<think>.*?</think>", "\n<think></think>", text[:last_user], flags=re.S) + text[last_user:]


# ---- deepseek_v3 -----------------------------------------------------------------------------------------

DEEPSEEK = Family(
    renderer="deepseek_v3",
    template="deepseek_v3.jinja",
    special_tokens=[
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
        "<｜tool▁output▁begin｜>",
        "<｜tool▁output▁end｜>",
    ],
    max_calls_per_turn=4,
    thinking=False,
    string_arguments=True,
    tools_template="deepseek_v3_tools.jinja",  # vLLM's template for V3.1, with the model card's tools block
)

# ---- kimi_k2 ---------------------------------------------------------------------------------------------

KIMI = Family(
    renderer="kimi_k2",
    template="kimi_k2.jinja",
    special_tokens=[
        "<|im_system|>",
        "<|im_user|>",
        "<|im_assistant|>",
        "<|im_middle|>",
        "<|im_end|>",
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>",
        "<|tool_call_begin|>",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
    max_calls_per_turn=4,
    thinking=True,
    call_ids=True,
)

_KIMI_TURN = re.compile(r"(<\|im_assistant\|>assistant<\|im_middle\|><think>)(.*?)(</think>.*?<\|im_end\|>)", re.S)


def kimi_final_turn_text(full: str, assistant) -> str:
    """A final answer as the model samples it: the template renders the conversation's last turn
    without tool calls with an empty <think></think>; the model wrote its reasoning there."""
    turn = full[full.rindex("<|im_assistant|>assistant<|im_middle|>") + len("<|im_assistant|>assistant<|im_middle|>") :]
    assert turn.startswith("<think></think>")
    return f"<think>{assistant.get('reasoning_content') or ''}</think>" + turn[len("<think></think>") :]


def kimi_history_form(trajectory_text: str) -> str:
    """The documented difference: the template renders the reasoning of the last turn without tool
    calls and of every turn before it as <think></think>."""
    turns = list(_KIMI_TURN.finditer(trajectory_text))
    final_answers = [i for i, turn in enumerate(turns) if "<|tool_calls_section_begin|>" not in turn.group(3)]
    text, at = "", 0
    for turn in turns[: final_answers[-1] + 1]:
        text += trajectory_text[at : turn.start()] + turn.group(1) + turn.group(3)
        at = turn.end()
    return text + trajectory_text[at:]


FAMILIES = {"gpt_oss": GPT_OSS, "glm4_5": GLM, "deepseek_v3": DEEPSEEK, "kimi_k2": KIMI}
TURN_TEXT = {"gpt_oss": gpt_oss_turn_text}
FINAL_TURN_TEXT = {"kimi_k2": kimi_final_turn_text}
STOP_TEXT = {"glm4_5": glm_stop_text}
HISTORY_FORM = {"gpt_oss": gpt_oss_history_form, "glm4_5": glm_history_form, "kimi_k2": kimi_history_form}
ENV_MARKERS = {"gpt_oss": {"tool": "<|start|>functions.", "user": "<|start|>user"}, "glm4_5": {"user": "<|user|>"}}


def corpus_for(family: Family, template: str, count: int = 150) -> list[str]:
    """Texts like the conversations the tests render (the template's own rendering of them)."""
    tokenizer = build_bpe_tokenizer(family.special_tokens, ["x"], 300, chat_template=template)
    tokenizer.bos_token = family.special_tokens[0]
    rng = random.Random(12345)
    texts = []
    for _ in range(count):
        first, turns = generate_episode(rng, family)
        messages = first + [m for assistant, env in turns for m in [assistant, *env]]
        texts.append(template_text(tokenizer, family, messages, add_generation_prompt=False))
    return texts


_TOKENIZERS: dict[str, object] = {}


def tokenizer_for(name: str):
    if name not in _TOKENIZERS:
        family = FAMILIES[name]
        template = (TEMPLATES / family.template).read_text(encoding="utf-8")
        _TOKENIZERS[name] = build_bpe_tokenizer(
            family.special_tokens, corpus_for(family, template), 3000, chat_template=template
        )
        _TOKENIZERS[name].bos_token = family.special_tokens[0]
    return _TOKENIZERS[name]


def renderer_for(name: str, **options):
    return get_renderer(FAMILIES[name].renderer, tokenizer_for(name), **{**FAMILIES[name].options, **options})


def sampled_text(name: str, tokenizer, history, assistant, env) -> str:
    """What the model samples for `assistant`: the template's rendering of the conversation up to and
    including it, minus the prompt, up to and including the stop token."""
    family = FAMILIES[name]
    prompt = template_text(tokenizer, family, history, add_generation_prompt=True)
    full = template_text(tokenizer, family, history + [assistant], add_generation_prompt=False)
    if name in FINAL_TURN_TEXT and not assistant.get("tool_calls"):
        return FINAL_TURN_TEXT[name](full, assistant)
    if full.startswith(prompt):
        return full[len(prompt) :] + STOP_TEXT.get(name, lambda env: "")(env)
    return TURN_TEXT[name](full)  # the template re-rendered an earlier turn: take this turn's own text


def environment_text(name: str, tokenizer, history, assistant, env) -> str:
    """The template's text for `env` after `assistant`, and the next generation prompt."""
    family = FAMILIES[name]
    with_env = template_text(tokenizer, family, history + [assistant] + env, add_generation_prompt=True)
    upto = template_text(tokenizer, family, history + [assistant], add_generation_prompt=False)
    if with_env.startswith(upto):
        text = with_env[len(upto) :]
        stop = STOP_TEXT.get(name, lambda env: "")(env)
        assert text.startswith(stop)
        return text[len(stop) :]
    start = with_env.rfind(ENV_MARKERS[name][env[0]["role"]])
    assert start >= 0
    text = with_env[start:]
    stop = STOP_TEXT.get(name, lambda env: "")(env)
    assert text.startswith(stop)
    return text[len(stop) :]


def run_episode(name: str, seed: int):
    """Simulate one episode; returns (trajectory ids, sampled turns, template text of the whole
    conversation, the turns' assistant messages)."""
    family = FAMILIES[name]
    tokenizer = tokenizer_for(name)
    renderer = renderer_for(name)
    rng = random.Random(seed)
    first, turns = generate_episode(rng, family)
    prompt_ids = renderer.render_prompt(first, tools=TOOLS)
    assert prompt_ids == encode(tokenizer, template_text(tokenizer, family, first, add_generation_prompt=True))
    trajectory = list(prompt_ids)
    history = list(first)
    sampled_turns = []
    for assistant, env in turns:
        sampled = encode(tokenizer, sampled_text(name, tokenizer, history, assistant, env))
        assert sampled[-1] in renderer.stop_token_ids
        sampled_turns.append((sampled, assistant))
        trajectory += sampled
        if env:
            bridged = renderer.bridge(sampled, env)
            assert bridged == encode(tokenizer, environment_text(name, tokenizer, history, assistant, env))
            trajectory += bridged
        history += [assistant, *env]
    whole = template_text(tokenizer, family, history, add_generation_prompt=False)
    return trajectory, sampled_turns, whole


@pytest.mark.parametrize("name", list(FAMILIES))
def test_token_identity_over_generated_episodes(name):
    tokenizer = tokenizer_for(name)
    retokenized_differs = 0
    template_ids_differ = 0
    for seed in range(NUM_EPISODES):
        trajectory, _, whole = run_episode(name, seed)
        text = tokenizer.decode(trajectory, skip_special_tokens=False)
        if name in HISTORY_FORM:
            assert HISTORY_FORM[name](text) == whole, f"seed {seed}"
        else:
            assert trajectory == encode(tokenizer, whole), f"seed {seed}"
        retokenized_differs += encode(tokenizer, text) != trajectory
        # a family whose turns end with the next message's role token has one after the last turn
        template_ids_differ += encode(tokenizer, whole) != (trajectory[:-1] if name in STOP_TEXT else trajectory)
    print(
        f"{name}: {NUM_EPISODES} episodes, token identity 100%; re-tokenizing the trajectory's text differs in "
        f"{retokenized_differs}, the template's text of the whole conversation gives other ids in {template_ids_differ}"
    )


@pytest.mark.parametrize("name", list(FAMILIES))
def test_parse_turn_reads_back_every_sampled_turn(name):
    renderer = renderer_for(name)
    renderer.render_prompt(HAND_WRITTEN[:2], tools=TOOLS)  # the tools calls are read against
    for seed in range(200):
        _, sampled_turns, _ = run_episode(name, seed)
        for sampled, assistant in sampled_turns:
            turn = renderer.parse_turn(sampled)
            assert turn.parse_error is None, f"seed {seed}: {turn.parse_error}"
            expected_calls = [
                (c["function"]["name"], c["function"]["arguments"]) for c in assistant.get("tool_calls", [])
            ]
            assert [(c.name, c.arguments) for c in turn.tool_calls] == expected_calls
            assert turn.content == EXPECTED_CONTENT[name](assistant)
            assert turn.reasoning == EXPECTED_REASONING[name](assistant)


EXPECTED_CONTENT = {
    "gpt_oss": lambda a: "" if a.get("tool_calls") else a["content"],
    "glm4_5": lambda a: a["content"].strip(),
    "deepseek_v3": lambda a: a["content"],
    "kimi_k2": lambda a: a["content"],
}
EXPECTED_REASONING = {
    "gpt_oss": lambda a: a.get("reasoning_content") or (a["content"] or None if a.get("tool_calls") else None),
    "glm4_5": lambda a: (a.get("reasoning_content") or "").strip() or None,
    "deepseek_v3": lambda a: None,
    "kimi_k2": lambda a: a.get("reasoning_content") or "",
}


# ---- hand-written conversations --------------------------------------------------------------------------

HAND_WRITTEN = [
    {"role": "system", "content": "You are a careful assistant.\nAnswer briefly."},
    {"role": "user", "content": "Find my notes on 日本語 and sum 1, 2.5 🙂"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I should search first.",
        "thinking": "I should search first.",
        "tool_calls": [
            {
                "type": "function",
                "id": "functions.search:0",
                "function": {"name": "search", "arguments": {"query": "日本語 notes", "limit": 3}},
            }
        ],
    },
    {"role": "tool", "name": "search", "tool_call_id": "functions.search:0", "content": '["note 1", "note 2"]'},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Now compute.",
        "thinking": "Now compute.",
        "tool_calls": [
            {
                "type": "function",
                "id": "functions.compute:1",
                "function": {
                    "name": "compute",
                    "arguments": {"expression": "a+b", "values": [1, 2.5], "options": {"precision": 2, "unit": "m"}},
                },
            }
        ],
    },
    {"role": "tool", "name": "compute", "tool_call_id": "functions.compute:1", "content": "Error: unit 'm' is unknown"},
    {"role": "assistant", "content": "Two notes; the sum is 3.5.", "reasoning_content": "Done.", "thinking": "Done."},
    {"role": "user", "content": "  Thanks!\nNow write it down.  "},
]


@pytest.mark.parametrize("name", list(FAMILIES))
@pytest.mark.parametrize("cut", [2, 4, 6, 8])
def test_render_prompt_matches_the_template(name, cut):
    tokenizer = tokenizer_for(name)
    family = FAMILIES[name]
    messages = HAND_WRITTEN[:cut]
    for tools in (TOOLS, None):
        text = template_text(tokenizer, family, messages, add_generation_prompt=True, tools=tools)
        ids = renderer_for(name).render_prompt(messages, tools=tools)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert ids == encode(tokenizer, text)


# ---- gpt_oss specifics -----------------------------------------------------------------------------------


def test_gpt_oss_options_match_the_template():
    tokenizer = tokenizer_for("gpt_oss")
    messages = HAND_WRITTEN[1:2]
    for effort in ("low", "high"):
        text = tokenizer.apply_chat_template(
            messages,
            tools=TOOLS,
            add_generation_prompt=True,
            tokenize=False,
            reasoning_effort=effort,
            model_identity="You are a test model.",
            strftime_now=lambda fmt: "2030-01-02",
        )
        renderer = get_renderer(
            "gpt_oss",
            tokenizer,
            reasoning_effort=effort,
            model_identity="You are a test model.",
            current_date="2030-01-02",
        )
        assert renderer.render_prompt(messages, tools=TOOLS) == encode(tokenizer, text)
    with pytest.raises(ValueError, match="reasoning_effort must be one of"):
        get_renderer("gpt_oss", tokenizer, reasoning_effort="extreme")


def test_gpt_oss_tool_schema_types_match_the_template():
    tokenizer = tokenizer_for("gpt_oss")
    tool = {
        "type": "function",
        "function": {
            "name": "kinds",
            "description": "All kinds.",
            "parameters": {
                "type": "object",
                "properties": {
                    "s": {"type": "string", "nullable": True},
                    "b": {"type": "boolean", "default": False},
                    "strings": {"type": "array", "items": {"type": "string"}},
                    "anything": {"type": "array"},
                    "objects": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
                    "nested": {
                        "type": "object",
                        "properties": {
                            "deep": {"type": "object", "properties": {"z": {"type": "number"}}, "required": ["z"]}
                        },
                    },
                    "union": {"type": ["string", "number"]},
                    "free": {},
                    "count": {"type": "integer", "default": 3},
                    "color": {"type": "string", "enum": ["red", "green"], "default": "red"},
                },
                "required": ["s"],
            },
        },
    }
    text = tokenizer.apply_chat_template(
        HAND_WRITTEN[1:2], tools=[tool], add_generation_prompt=True, tokenize=False, **GPT_OSS.template_kwargs
    )
    assert renderer_for("gpt_oss").render_prompt(HAND_WRITTEN[1:2], tools=[tool]) == encode(tokenizer, text)
    bad = {
        "type": "function",
        "function": {
            "name": "bad",
            "description": "x",
            "parameters": {"type": "object", "properties": {"u": {"oneOf": [{"type": "string"}]}}},
        },
    }
    with pytest.raises(ValueError, match=r"bad\.u uses oneOf"):
        renderer_for("gpt_oss").render_prompt(HAND_WRITTEN[1:2], tools=[bad])
    with pytest.raises(ValueError, match="needs a description"):
        renderer_for("gpt_oss").render_prompt(
            HAND_WRITTEN[1:2], tools=[{"type": "function", "function": {"name": "n"}}]
        )


@pytest.mark.parametrize(
    "text, calls, content, reasoning, error",
    [
        # harmony's own header form: the recipient after the channel, <|constrain|>json
        (
            "<|channel|>analysis<|message|>think<|end|><|start|>assistant"
            '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "a"}<|call|>',
            [ToolCall("search", {"query": "a"})],
            "",
            "think",
            None,
        ),
        # the template's form: the recipient in the role header
        (" to=functions.now<|channel|>commentary json<|message|>{}<|call|>", [ToolCall("now", {})], "", None, None),
        ("<|channel|>final<|message|>The answer.<|return|>", [], "The answer.", None, None),
        (
            '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": <|call|>',
            [],
            "",
            None,
            "arguments are not valid JSON",
        ),
        (
            '<|channel|>commentary to=functions.search <|constrain|>json<|message|>["a"]<|call|>',
            [],
            "",
            None,
            "must be a JSON object, not list",
        ),
        (
            '<|channel|>commentary to=functions.search <|constrain|>json<|message|>{"query": "a"}',
            [],
            "",
            None,
            "is not closed",
        ),
        (
            "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>unfinished",
            [],
            "unfinished",
            "hm",
            "is not closed",
        ),
        (
            "<|channel|>commentary to=browser.search <|constrain|>json<|message|>{}<|call|>",
            [],
            "",
            None,
            "is not a function",
        ),
        ("<|message|>no channel<|return|>", [], "", None, "unreadable header"),
        ("<|channel|>secret<|message|>x<|return|>", [], "", None, "unknown channel 'secret'"),
        ("text before<|channel|>final<|message|>x<|return|>", [], "", None, "unreadable header"),
    ],
)
def test_gpt_oss_parse_turn(text, calls, content, reasoning, error):
    renderer = renderer_for("gpt_oss")
    turn = renderer.parse_turn(encode(tokenizer_for("gpt_oss"), text))
    assert turn.tool_calls == calls
    assert turn.content == content
    assert turn.reasoning == reasoning
    if error is None:
        assert turn.parse_error is None
    else:
        assert error in turn.parse_error


def test_gpt_oss_bridge_errors():
    renderer = renderer_for("gpt_oss")
    tokenizer = tokenizer_for("gpt_oss")
    final = encode(tokenizer, "<|channel|>final<|message|>x<|return|>")
    with pytest.raises(ValueError, match="no assistant message before it made a tool call"):
        renderer.bridge(final, [{"role": "tool", "name": "search", "content": "r"}])
    with pytest.raises(ValueError, match="ended with a stop token"):
        renderer.bridge(final[:-1], [{"role": "user", "content": "u"}])
    with pytest.raises(ValueError, match="not 'assistant' messages"):
        renderer.bridge(final, [{"role": "assistant", "content": "u"}])


# ---- glm4_5 specifics ------------------------------------------------------------------------------------


def test_glm_thinking_switch_matches_the_template():
    tokenizer = tokenizer_for("glm4_5")
    renderer = get_renderer("glm4_5", tokenizer, enable_thinking=False)
    for cut in (2, 4, 8):
        text = tokenizer.apply_chat_template(
            HAND_WRITTEN[:cut], tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
        )
        assert renderer.render_prompt(HAND_WRITTEN[:cut], tools=TOOLS) == encode(tokenizer, text)
    assert text.endswith("/nothink<|assistant|>\n<think></think>")
    # a user turn bridged after a final answer, without thinking
    final = encode(tokenizer, "\nDone.<|user|>")
    follow_up = {"role": "user", "content": "again"}
    whole = tokenizer.apply_chat_template(
        HAND_WRITTEN[:7] + [follow_up], tools=TOOLS, add_generation_prompt=True, tokenize=False, enable_thinking=False
    )
    assert whole.endswith(tokenizer.decode(renderer.bridge(final, [follow_up]), skip_special_tokens=False))


def test_glm_bridge_after_another_stop_token_writes_the_whole_message():
    tokenizer = tokenizer_for("glm4_5")
    renderer = renderer_for("glm4_5")
    call = "\n<tool_call>now\n</tool_call>"
    results = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    grouped = "\n<tool_response>\n1\n</tool_response>\n<tool_response>\n2\n</tool_response><|assistant|>"
    assert renderer.bridge(encode(tokenizer, call + "<|observation|>"), results) == encode(tokenizer, grouped)
    assert renderer.bridge(encode(tokenizer, call + "<|endoftext|>"), results) == encode(
        tokenizer, "<|observation|>" + grouped
    )
    with pytest.raises(ValueError, match="ended with a stop token"):
        renderer.bridge(encode(tokenizer, call), results)


@pytest.mark.parametrize(
    "text, calls, content, reasoning, error",
    [
        (
            "\n<think>plan</think>\nLet me look.\n<tool_call>search\n"
            "<arg_key>query</arg_key>\n<arg_value>12</arg_value>\n"
            "<arg_key>limit</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>now\n</tool_call><|observation|>",
            [ToolCall("search", {"query": "12", "limit": 3}), ToolCall("now", {})],
            "Let me look.",
            "plan",
            None,
        ),
        # the arguments on the name's line, and a value of an undeclared parameter read as JSON
        (
            "<tool_call>search<arg_key>query</arg_key><arg_value>a</arg_value>"
            "<arg_key>extra</arg_key><arg_value>[1, 2]</arg_value></tool_call><|observation|>",
            [ToolCall("search", {"query": "a", "extra": [1, 2]})],
            "",
            None,
            None,
        ),
        ("\n<think>unfinished", [], "", "unfinished", "<think> is not closed"),
        (
            "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a</arg_value>\n",
            [],
            "",
            None,
            "is not closed by </tool_call>",
        ),
        (
            "<tool_call>\n<arg_key>query</arg_key>\n<arg_value>a</arg_value>\n</tool_call>",
            [],
            "",
            None,
            "has no function name",
        ),
        (
            "<tool_call>search\n<arg_key>limit</arg_key>\n<arg_value>three</arg_value>\n</tool_call>",
            [],
            "",
            None,
            "'limit' is declared integer but its value is not JSON",
        ),
        (
            "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>a\n</tool_call>",
            [],
            "",
            None,
            "unreadable arguments",
        ),
        (
            "<tool_call>now\n</tool_call> and then some"
            "<tool_call>search\n<arg_key>query</arg_key>\n<arg_value>b</arg_value>\n</tool_call><|user|>",
            [ToolCall("now", {}), ToolCall("search", {"query": "b"})],
            "",
            None,
            "text after tool call 0: 'and then some'",
        ),
    ],
)
def test_glm_parse_turn(text, calls, content, reasoning, error):
    renderer = renderer_for("glm4_5")
    renderer.render_prompt(HAND_WRITTEN[:2], tools=TOOLS)
    turn = renderer.parse_turn(encode(tokenizer_for("glm4_5"), text))
    assert (turn.tool_calls, turn.content, turn.reasoning) == (calls, content, reasoning)
    if error is None:
        assert turn.parse_error is None
    else:
        assert error in turn.parse_error


# ---- deepseek_v3 specifics -------------------------------------------------------------------------------


def test_deepseek_thinking_prompt_and_turn():
    tokenizer = tokenizer_for("deepseek_v3")
    renderer = get_renderer("deepseek_v3", tokenizer, thinking=True)
    text = tokenizer.apply_chat_template(HAND_WRITTEN[:2], add_generation_prompt=True, tokenize=False, thinking=True)
    assert renderer.render_prompt(HAND_WRITTEN[:2]) == encode(tokenizer, text)
    assert text.endswith("<｜Assistant｜><think>")
    turn = renderer.parse_turn(encode(tokenizer, "I add them.</think>It is 3.5.<｜end▁of▁sentence｜>"))
    assert (turn.reasoning, turn.content, turn.parse_error) == ("I add them.", "It is 3.5.", None)
    assert "not closed by </think>" in renderer.parse_turn(encode(tokenizer, "still thinking")).parse_error
    messages = tools_system_messages(tokenizer, DEEPSEEK, HAND_WRITTEN[:2], TOOLS)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, thinking=True)
    assert renderer.render_prompt(HAND_WRITTEN[:2], tools=TOOLS) == encode(tokenizer, text)


@pytest.mark.parametrize("tools", [TOOLS[:1], TOOLS], ids=["one tool", "four tools"])
@pytest.mark.parametrize(
    "messages",
    [HAND_WRITTEN[:2], HAND_WRITTEN[1:2], HAND_WRITTEN[:6], HAND_WRITTEN[1:8]],
    ids=["system", "no system", "system, calls", "no system, calls"],
)
def test_deepseek_tools_match_the_vllm_template(messages, tools):
    """The tools' block is the system prompt that vLLM's V3.1 template renders (after its BOS token,
    before the first user turn); the rest of the prompt is V3.1's own template's."""
    tokenizer = tokenizer_for("deepseek_v3")
    with_system_prompt = tools_system_messages(tokenizer, DEEPSEEK, messages, tools)
    system_prompt = with_system_prompt[0]["content"]
    systems = [m["content"] for m in messages if m["role"] == "system"]
    assert system_prompt.startswith(
        "\n\n".join(systems) + "\n\n## Tools\nYou have access to the following tools:\n\n### search\n"
    )
    assert system_prompt.count("\n### ") == len(tools)
    v31_text = tokenizer.apply_chat_template(
        template_messages(DEEPSEEK, with_system_prompt), add_generation_prompt=True, tokenize=False
    )
    ids = renderer_for("deepseek_v3").render_prompt(messages, tools=tools)
    assert tokenizer.decode(ids, skip_special_tokens=False) == v31_text
    assert ids == encode(tokenizer, v31_text)
    assert ids != renderer_for("deepseek_v3").render_prompt(messages)


def test_deepseek_tool_errors():
    renderer = renderer_for("deepseek_v3")
    with pytest.raises(ValueError, match="tool 0 is not an OpenAI function tool"):
        renderer.render_prompt(HAND_WRITTEN[:2], tools=[{"type": "function", "function": {"description": "d"}}])
    with pytest.raises(ValueError, match="'now': the deepseek_v3 format needs a description string"):
        renderer.render_prompt(
            HAND_WRITTEN[:2], tools=[{"type": "function", "function": {"name": "now", "parameters": {}}}]
        )
    with pytest.raises(ValueError, match="'now': the deepseek_v3 format needs the parameters' JSON schema"):
        renderer.render_prompt(
            HAND_WRITTEN[:2], tools=[{"type": "function", "function": {"name": "now", "description": "d"}}]
        )


CALLS, CALL, SEP, END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
CALLS_END = "<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"


@pytest.mark.parametrize(
    "text, calls, content, error",
    [
        (
            f'Looking.{CALLS}{CALL}search{SEP}{{"query": "a"}}{END}{CALL}now{SEP}{{}}{END}{CALLS_END}',
            [ToolCall("search", {"query": "a"}), ToolCall("now", {})],
            "Looking.",
            None,
        ),
        (
            f'{CALLS}{CALL}search{SEP}{{"query": }}{END}{CALL}now{SEP}{{}}{END}{CALLS_END}',
            [ToolCall("now", {})],
            "",
            "not valid JSON",
        ),
        (f'{CALLS}{CALL}search{SEP}"a"{END}{CALLS_END}', [], "", "must be a JSON object, not str"),
        (f"{CALLS}{CALL}search{SEP}{{}}", [], "", "not closed by <｜tool▁calls▁end｜>"),
        (f"{CALLS}{CALL}search{SEP}{{}}<｜tool▁calls▁end｜>", [], "", "not closed by <｜tool▁call▁end｜>"),
        (f"{CALLS}{CALL}search{{}}{END}{CALLS_END}", [], "", "has no <｜tool▁sep｜>"),
        (f"{CALLS}{CALL}{SEP}{{}}{END}{CALLS_END}", [], "", "has no function name"),
        (
            f"{CALLS}{CALL}now{SEP}{{}}{END}<｜tool▁calls▁end｜>trailing<｜end▁of▁sentence｜>",
            [ToolCall("now", {})],
            "",
            "text after the tool calls",
        ),
    ],
)
def test_deepseek_parse_turn(text, calls, content, error):
    turn = renderer_for("deepseek_v3").parse_turn(encode(tokenizer_for("deepseek_v3"), text))
    assert (turn.tool_calls, turn.content) == (calls, content)
    if error is None:
        assert turn.parse_error is None
    else:
        assert error in turn.parse_error


# ---- kimi_k2 specifics -----------------------------------------------------------------------------------


def test_kimi_prompt_without_system_and_with_names():
    tokenizer = tokenizer_for("kimi_k2")
    renderer = renderer_for("kimi_k2")
    named = [
        {"role": "user", "name": "alice", "content": "hi"},
        {"role": "assistant", "content": "hello", "reasoning_content": "greet"},
        {"role": "user", "content": [{"type": "text", "text": "again "}, {"type": "text", "text": "please"}]},
    ]
    for messages in (HAND_WRITTEN[1:2], named):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert renderer.render_prompt(messages) == encode(tokenizer, text)
    assert "<|im_user|>alice<|im_middle|>hi" in text and "<think></think>hello" in text


def test_kimi_input_errors():
    renderer = renderer_for("kimi_k2")
    tokenizer = tokenizer_for("kimi_k2")
    no_id = [
        HAND_WRITTEN[1],
        {**HAND_WRITTEN[2], "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": {}}}]},
    ]
    with pytest.raises(ValueError, match=r"tool call 0 \(now\) has no 'id'"):
        renderer.render_prompt(no_id)
    with pytest.raises(ValueError, match="no 'tool_call_id'"):
        renderer.render_prompt(HAND_WRITTEN[1:3] + [{"role": "tool", "content": "r"}])
    with pytest.raises(ValueError, match="role 'developer' is not one the kimi_k2 format renders"):
        renderer.render_prompt([{"role": "developer", "content": "d"}])
    final = encode(tokenizer, "<think>x</think>Done.<|im_end|>")
    with pytest.raises(ValueError, match="ended with a stop token"):
        renderer.bridge(final[:-1], [{"role": "user", "content": "u"}])
    with pytest.raises(ValueError, match="not 'assistant' messages"):
        renderer.bridge(final, [{"role": "assistant", "content": "u"}])
    with pytest.raises(ValueError, match="no 'tool_call_id'"):
        renderer.bridge(final, [{"role": "tool", "name": "now", "content": "r"}])


SECTION, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|><|im_end|>"
KCALL, KARG, KEND = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


@pytest.mark.parametrize(
    "text, calls, content, reasoning, error",
    [
        (
            f'<think>look it up</think>Looking.{SECTION}{KCALL}functions.search:0{KARG}{{"query": "a"}}{KEND}'
            f"{KCALL}functions.now:1{KARG}{{}}{KEND}{SECTION_END}",
            [ToolCall("search", {"query": "a"}, "functions.search:0"), ToolCall("now", {}, "functions.now:1")],
            "Looking.",
            "look it up",
            None,
        ),
        ("<think></think>The answer.<|im_end|>", [], "The answer.", "", None),
        ("no reasoning<|im_end|>", [], "no reasoning", None, None),
        ("<think>unfinished", [], "", "unfinished", "<think> is not closed by </think>"),
        (
            f'<think></think>{SECTION}{KCALL}functions.search:0{KARG}{{"query": }}{KEND}'
            f"{KCALL}functions.now:1{KARG}{{}}{KEND}{SECTION_END}",
            [ToolCall("now", {}, "functions.now:1")],
            "",
            "",
            "arguments are not valid JSON",
        ),
        (
            f'<think></think>{SECTION}{KCALL}functions.search:0{KARG}"a"{KEND}{SECTION_END}',
            [],
            "",
            "",
            "must be a JSON object, not str",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now:0{KARG}{{}}{KEND}",
            [ToolCall("now", {}, "functions.now:0")],
            "",
            "",
            "not closed by <|tool_calls_section_end|>",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now:0{KARG}{{}}{SECTION_END}",
            [],
            "",
            "",
            "not closed by <|tool_call_end|>",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now:0{{}}{KEND}{SECTION_END}",
            [],
            "",
            "",
            "has no <|tool_call_argument_begin|>",
        ),
        (
            f"<think></think>{SECTION}{KCALL}now:0{KARG}{{}}{KEND}{SECTION_END}",
            [],
            "",
            "",
            "id 'now:0' is not functions.NAME:IDX",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now{KARG}{{}}{KEND}{SECTION_END}",
            [],
            "",
            "",
            "id 'functions.now' is not functions.NAME:IDX",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.:0{KARG}{{}}{KEND}{SECTION_END}",
            [],
            "",
            "",
            "id 'functions.:0' is not functions.NAME:IDX",
        ),
        (
            f"<think></think>{SECTION} {KCALL}functions.now:0{KARG}{{}}{KEND}{SECTION_END}",
            [ToolCall("now", {}, "functions.now:0")],
            "",
            "",
            "text between <|tool_calls_section_begin|> and the first call: ' '",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now:0{KARG}{{}}{KEND}and{KCALL}functions.now:1{KARG}{{}}{KEND}{SECTION_END}",
            [ToolCall("now", {}, "functions.now:0"), ToolCall("now", {}, "functions.now:1")],
            "",
            "",
            "text after tool call 0: 'and'",
        ),
        (
            f"<think></think>{SECTION}{KCALL}functions.now:0{KARG}{{}}{KEND}<|tool_calls_section_end|>trailing<|im_end|>",
            [ToolCall("now", {}, "functions.now:0")],
            "",
            "",
            "text after the tool calls: 'trailing'",
        ),
    ],
)
def test_kimi_parse_turn(text, calls, content, reasoning, error):
    turn = renderer_for("kimi_k2").parse_turn(encode(tokenizer_for("kimi_k2"), text))
    assert (turn.tool_calls, turn.content, turn.reasoning) == (calls, content, reasoning)
    if error is None:
        assert turn.parse_error is None
    else:
        assert error in turn.parse_error


def test_kimi_turn_read_back_feeds_the_next_prompt():
    """A parsed turn's message (its call ids) and the environment's tool messages render as the template does."""
    tokenizer = tokenizer_for("kimi_k2")
    renderer = renderer_for("kimi_k2")
    sampled = encode(tokenizer, f"<think>plan</think>{SECTION}{KCALL}functions.now:0{KARG}{{}}{KEND}{SECTION_END}")
    turn = renderer.parse_turn(sampled)
    results = [
        {"role": "tool", "name": call.name, "tool_call_id": call.id, "content": "12:00"} for call in turn.tool_calls
    ]
    messages = HAND_WRITTEN[:2] + [turn.message()] + results
    text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    prompt = renderer.render_prompt(HAND_WRITTEN[:2], tools=TOOLS)
    assert prompt + sampled + renderer.bridge(sampled, results) == encode(tokenizer, text)
    assert renderer.render_prompt(messages, tools=TOOLS) == encode(tokenizer, text)
