"""The OpenAI-compatible chat endpoint, driven by the official `openai` client, on the built-in engine
and a tiny random Qwen3 over a character tokenizer with a hermes-style chat format."""

from __future__ import annotations

import inspect
import itertools
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from archon.agents.environment import StopReason
from archon.agents.openai_agents import run_agent_group
from archon.agents.openai_server import RUN_API_KEY, ChatCompletionsServer
from archon.agents.renderer import AssistantTurn, Renderer, ToolCall
from archon.build import build_model
from archon.rl.tasks import build_char_tokenizer
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.tools.align import make_tiny_hf_checkpoint

openai = pytest.importorskip("openai")

MODEL = "tiny-policy"
TOOL_CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
"""One token of the test vocabulary: the scripted model's whole tool call."""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "a + b",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    }
]


class HermesCharRenderer(Renderer):
    """A small hermes-style format: <|role|>text<|end|> turns, tools listed in a system turn, tool
    calls as <tool_call>{"name", "arguments"}</tool_call>, reasoning in <think></think>, tool results
    as user turns in <tool_response></tool_response>."""

    name = "test-hermes-char"

    def _message_text(self, message) -> str:
        if message["role"] == "tool":
            return f"<|user|><tool_response>{message['content']}</tool_response><|end|>"
        body = message.get("content") or ""
        for call in message.get("tool_calls", ()):
            function = call["function"]
            body += (
                "<tool_call>"
                + json.dumps({"name": function["name"], "arguments": function["arguments"]})
                + "</tool_call>"
            )
        return f"<|{message['role']}|>{body}<|end|>"

    def render_prompt(self, messages, tools=None):
        text = ""
        if tools:
            text += "<|system|>tools:" + "".join(json.dumps(tool["function"]) for tool in tools) + "<|end|>"
        return self.encode(text + "".join(self._message_text(m) for m in messages) + "<|assistant|>")

    @property
    def stop_token_ids(self):
        return (self.token_id("<|end|>"),)

    def parse_turn(self, sampled_ids):
        text = self.decode(sampled_ids).removesuffix("<|end|>")
        reasoning = None
        match = re.match(r"<think>(.*?)</think>", text, re.S)
        if match:
            reasoning, text = match.group(1), text[match.end() :]
        calls, error = [], None
        for raw in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
            try:
                call = json.loads(raw)
                calls.append(ToolCall(name=call["name"], arguments=call["arguments"]))
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                error = f"tool call {raw!r}: {e}"
        content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.S)
        return AssistantTurn(content=content, reasoning=reasoning, tool_calls=calls, parse_error=error)

    def bridge(self, sampled_ids, messages):
        return self.encode("".join(self._message_text(m) for m in messages) + "<|assistant|>")


class RecordingEngine(NativeRolloutEngine):
    """The built-in engine, keeping every generate call's prompts and samples."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = []

    def generate(self, prompts, sampling, **kwargs):
        samples = super().generate(prompts, sampling, **kwargs)
        self.calls.append(([list(p) for p in prompts], sampling, samples))
        return samples

    generate.__signature__ = inspect.signature(NativeRolloutEngine.generate)


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>", TOOL_CALL])
    return tokenizer


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer):
    return make_tiny_hf_checkpoint(
        "qwen3", tmp_path_factory.mktemp("qwen3") / "hf", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
    )


@pytest.fixture(scope="module")
def random_model(checkpoint):
    return build_model(checkpoint).model.eval()


@pytest.fixture(scope="module")
def scripted_model(checkpoint, tokenizer):
    """The random model made to answer every assistant header with the tool call
    <tool_call>TOOL_CALL</tool_call><|end|>: the embeddings outweigh the layers' outputs, and the
    head maps each token of that chain to the next one."""
    model = build_model(checkpoint).model.eval()
    chain = ["<|assistant|>", "<tool_call>", TOOL_CALL, "</tool_call>", "<|end|>"]
    ids = [tokenizer.convert_tokens_to_ids(token) for token in chain]
    with torch.no_grad():
        model.embed_tokens.weight.mul_(100.0)
        model.lm_head.weight.zero_()
        for current, following in itertools.pairwise(ids):
            direction = model.norm.weight * model.embed_tokens.weight[current]
            model.lm_head.weight[following] = 3.0 * direction / direction.norm()
    return model


def full_forward_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from one forward over the whole sequence (temperature 1)."""
    with torch.no_grad():
        tokens = torch.tensor(ids)
        logits = model(tokens, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))
    return torch.log_softmax(logits.float(), -1)[:-1].gather(-1, tokens[1:, None])[:, 0]


def assert_sampled_logprobs_match_the_model(model, trajectory) -> None:
    """Every sampled id's recorded log-prob is the model's for it after the trajectory before it."""
    expected = full_forward_logprobs(model, trajectory.trajectory_ids)[len(trajectory.prompt_ids) - 1 :]
    sampled = torch.tensor(trajectory.sampled_mask)
    torch.testing.assert_close(torch.tensor(trajectory.logprobs)[sampled], expected[sampled], atol=1e-4, rtol=0)


def client_for(base_url: str):
    """A client of the servers here, which require this process's token (their default)."""
    return openai.OpenAI(base_url=base_url, api_key=RUN_API_KEY, max_retries=0, timeout=60)


def reserialised(message) -> dict:
    """The assistant message as a client sends it back: arguments re-serialised, reasoning dropped."""
    sent = {"role": "assistant", "content": message.content}
    if message.tool_calls:
        sent["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": json.dumps(json.loads(call.function.arguments), indent=2, sort_keys=True),
                },
            }
            for call in message.tool_calls
        ]
    return sent


def test_tool_conversation_keeps_the_sampled_ids(scripted_model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    engine = RecordingEngine(scripted_model)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0)
    with ChatCompletionsServer(engine, renderer, MODEL, sampling) as server:
        models = client_for(f"{server.url}/v1").models.list()
        assert [m.id for m in models.data] == [MODEL]
        session = server.open_session("episode-0")
        client = client_for(session.base_url)
        messages = [{"role": "system", "content": "Add."}, {"role": "user", "content": "1+2?"}]
        for turn in range(3):
            response = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=8)
            choice = response.choices[0]
            assert choice.finish_reason == "tool_calls"
            [call] = choice.message.tool_calls
            assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
                f"call_{turn}",
                "add",
                {"a": 1, "b": 2},
            )
            assert response.usage.completion_tokens == 4
            messages += [
                reserialised(choice.message),
                {"role": "tool", "tool_call_id": call.id, "content": str(3 + turn)},
            ]
        trajectory = server.close_session(session.id)

    assert session.rerendered == 0 and session.warnings == []
    assert len(engine.calls) == 3
    turns = [samples[0] for _, _, samples in engine.calls]
    call = tokenizer.convert_tokens_to_ids(["<tool_call>", TOOL_CALL, "</tool_call>", "<|end|>"])
    assert [t.completion_ids for t in turns] == [call] * 3
    tools_text = "<|system|>tools:" + json.dumps(TOOLS[0]["function"]) + "<|end|>"
    prompt = renderer.encode(tools_text + "<|system|>Add.<|end|><|user|>1+2?<|end|><|assistant|>")
    bridges = [renderer.encode(f"<|user|><tool_response>{3 + k}</tool_response><|end|><|assistant|>") for k in range(2)]
    assert trajectory.prompt_ids == prompt
    assert trajectory.completion_ids == call + bridges[0] + call + bridges[1] + call
    assert (
        trajectory.sampled_mask
        == [True] * 4 + [False] * len(bridges[0]) + [True] * 4 + [False] * len(bridges[1]) + [True] * 4
    )
    # each turn was prompted with the trajectory so far, verbatim
    assert engine.calls[1][0][0] == prompt + call + bridges[0]
    assert engine.calls[2][0][0] == prompt + call + bridges[0] + call + bridges[1]
    sampled_logprobs = [lp for lp, sampled in zip(trajectory.logprobs, trajectory.sampled_mask) if sampled]
    assert sampled_logprobs == [lp for t in turns for lp in t.logprobs]
    assert_sampled_logprobs_match_the_model(scripted_model, trajectory)
    assert trajectory.num_turns == 3 and trajectory.num_tool_calls == 3
    assert [m["role"] for m in trajectory.messages] == ["system", "user"] + ["assistant", "tool"] * 2 + ["assistant"]
    assert trajectory.messages[2]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 2}


def test_an_edited_history_is_rendered_again(random_model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    engine = RecordingEngine(random_model)
    with ChatCompletionsServer(engine, renderer, MODEL, SamplingParams(max_new_tokens=6, temperature=1.0)) as server:
        session = server.open_session()
        client = client_for(session.base_url)
        messages = [{"role": "user", "content": "hi"}]
        first = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
        edited = [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": "more"},
        ]
        response = client.chat.completions.create(model=MODEL, messages=edited)
        trajectory = server.close_session(session.id)
    assert session.rerendered == 1
    assert "messages[0] (user) differs" in session.warnings[0]
    second = engine.calls[1][2][0]
    assert trajectory.prompt_ids == renderer.encode(
        f"<|user|>hello<|end|><|assistant|>{first.content}<|end|><|user|>more<|end|><|assistant|>"
    )
    assert trajectory.completion_ids == second.completion_ids and all(trajectory.sampled_mask)
    assert trajectory.logprobs == second.logprobs
    assert response.choices[0].message.content == renderer.parse_turn(second.completion_ids).content
    assert_sampled_logprobs_match_the_model(random_model, trajectory)


def test_concurrent_sessions_are_batched(random_model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    engine = RecordingEngine(random_model)
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0)
    sessions_n, turns_n = 8, 2
    results, barrier = {}, threading.Barrier(sessions_n)
    with ChatCompletionsServer(engine, renderer, MODEL, sampling, batch_window_s=0.05) as server:
        sessions = [server.open_session(f"s{i}") for i in range(sessions_n)]

        def agent(i: int) -> None:
            client = client_for(sessions[i].base_url)
            messages, replies = [{"role": "user", "content": f"question {i}"}], []
            for turn in range(turns_n):
                barrier.wait()
                response = client.chat.completions.create(model=MODEL, messages=messages)
                replies.append(response.choices[0])
                messages += [
                    {"role": "assistant", "content": response.choices[0].message.content},
                    {"role": "user", "content": f"next {i}"},
                ]
            results[i] = replies

        threads = [threading.Thread(target=agent, args=(i,)) for i in range(sessions_n)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        trajectories = [server.close_session(s.id) for s in sessions]
        calls = server.generate_calls
    assert len(results) == sessions_n
    assert calls == len(engine.calls) < sessions_n * turns_n
    assert max(len(prompts) for prompts, _, _ in engine.calls) > 1
    end = renderer.stop_token_ids[0]
    for i, (trajectory, session) in enumerate(zip(trajectories, sessions)):
        assert session.rerendered == 0
        assert trajectory.prompt_ids == renderer.encode(f"<|user|>question {i}<|end|><|assistant|>")
        first, second = results[i]
        n1 = trajectory.sampled_mask.index(False)
        turn1 = trajectory.completion_ids[:n1]
        assert renderer.parse_turn(turn1).content == first.message.content
        closing = "" if first.finish_reason == "stop" else "<|end|>"
        bridge = renderer.encode(f"{closing}<|user|>next {i}<|end|><|assistant|>")
        assert trajectory.completion_ids[n1 : n1 + len(bridge)] == bridge
        assert (turn1[-1] == end) == (first.finish_reason == "stop")
        turn2 = trajectory.completion_ids[n1 + len(bridge) :]
        assert all(trajectory.sampled_mask[n1 + len(bridge) :])
        assert renderer.parse_turn(turn2).content == second.message.content
        assert_sampled_logprobs_match_the_model(random_model, trajectory)


def test_the_session_budget_cuts_then_refuses(random_model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    prompt_len = len(renderer.render_prompt([{"role": "user", "content": "hi"}]))
    engine = NativeRolloutEngine(random_model)
    budget = prompt_len + 3
    with ChatCompletionsServer(
        engine, renderer, MODEL, SamplingParams(max_new_tokens=50, temperature=0), max_session_tokens=budget
    ) as server:
        session = server.open_session()
        client = client_for(session.base_url)
        messages = [{"role": "user", "content": "hi"}]
        response = client.chat.completions.create(model=MODEL, messages=messages)
        trajectory = session.trajectory
        if response.choices[0].finish_reason == "length":
            assert len(trajectory.trajectory_ids) == budget
            messages += [
                {"role": "assistant", "content": response.choices[0].message.content},
                {"role": "user", "content": "x"},
            ]
            with pytest.raises(openai.BadRequestError, match="max_session_tokens"):
                client.chat.completions.create(model=MODEL, messages=messages)
        else:  # the greedy turn stopped within the budget; the next prompt alone is over it
            assert len(trajectory.trajectory_ids) <= budget
            messages += [
                {"role": "assistant", "content": response.choices[0].message.content},
                {"role": "user", "content": "x"},
            ]
            with pytest.raises(openai.BadRequestError, match="max_session_tokens"):
                client.chat.completions.create(model=MODEL, messages=messages)


def post(url: str, data: bytes) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {RUN_API_KEY}"}
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize(
    "change, param",
    [
        ({"n": 2}, "n"),
        ({"stop": ["\n"]}, "stop"),
        ({"messages": None}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"tools": ["add"]}, "tools[0]"),
        ({"max_tokens": "8"}, "max_tokens"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "content": "",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ],
)
def test_bad_requests_name_the_field(random_model, tokenizer, change, param):
    with ChatCompletionsServer(
        NativeRolloutEngine(random_model), HermesCharRenderer(tokenizer), MODEL, SamplingParams()
    ) as server:
        session = server.open_session()
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **change}
        body = {k: v for k, v in body.items() if v is not None}
        status, answer = post(f"{session.base_url}/chat/completions", json.dumps(body).encode())
        assert (
            status == 400 and answer["error"]["param"] == param and answer["error"]["type"] == "invalid_request_error"
        )
        assert f"'{param}'" in answer["error"]["message"]
        assert session.trajectory is None and server.generate_calls == 0


def test_unknown_sessions_and_malformed_bodies(random_model, tokenizer):
    with ChatCompletionsServer(
        NativeRolloutEngine(random_model), HermesCharRenderer(tokenizer), MODEL, SamplingParams()
    ) as server:
        with pytest.raises(openai.BadRequestError, match="unknown session 'nope'") as caught:
            client_for(f"{server.url}/sessions/nope/v1").chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        assert caught.value.body["param"] == "session_id"
        status, body = post(f"{server.url}/v1/chat/completions", b'{"messages": [')
        assert status == 400 and "not valid JSON" in body["error"]["message"]
        status, body = post(f"{server.url}/v1/completions", b"{}")
        assert status == 404 and "/v1/chat/completions" in body["error"]["message"]
        session = server.open_session()
        server.close_session(session.id, reason="done here")
        with pytest.raises(openai.BadRequestError, match="is closed \\(done here\\)"):
            client_for(session.base_url).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.NotFoundError, match="serves 'tiny-policy'"):
            client_for(f"{server.url}/v1").chat.completions.create(
                model="gpt-4o", messages=[{"role": "user", "content": "hi"}]
            )


def test_agent_groups_record_stop_reasons(random_model, tokenizer):
    release = threading.Event()
    late_errors = []

    def agent(base_url: str, row: dict) -> float:
        client = client_for(base_url)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["prompt"]}])
        kind = row["kinds"].pop()
        if kind == "raise":
            raise RuntimeError("the tool crashed")
        if kind == "hang":
            release.wait(30)
            try:
                client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "again"}])
            except openai.BadRequestError as e:
                late_errors.append(e.body["message"])
            return 0.0
        return float(len(reply.choices[0].message.content))

    row = {"prompt": "go", "kinds": ["raise", "hang", "ok", "ok"]}
    engine = NativeRolloutEngine(random_model)
    with ChatCompletionsServer(
        engine, HermesCharRenderer(tokenizer), MODEL, SamplingParams(max_new_tokens=4)
    ) as server:
        started = time.monotonic()
        trajectories = run_agent_group(server, agent, row, group_size=4, timeout_s=3.0)
        assert time.monotonic() - started < 20
        release.set()
        for _ in range(100):
            if late_errors:
                break
            time.sleep(0.05)
    reasons = sorted(t.stop_reason.value for t in trajectories)
    assert reasons == ["done", "done", "env_error", "timeout"]
    failed = next(t for t in trajectories if t.stop_reason == StopReason.ENV_ERROR)
    assert failed.error == "RuntimeError: the tool crashed" and failed.num_turns == 1
    timed_out = next(t for t in trajectories if t.stop_reason == StopReason.TIMEOUT)
    assert "timeout_s=3.0" in timed_out.error and timed_out.num_turns == 1
    for t in trajectories:
        if t.stop_reason == StopReason.DONE:
            assert t.reward == float(len(HermesCharRenderer(tokenizer).parse_turn(t.completion_ids).content))
    assert late_errors and "is closed (the agent ran past timeout_s=3.0)" in late_errors[0]


@pytest.mark.skipif(
    "sessions" not in inspect.signature(NativeRolloutEngine.generate).parameters,
    reason="this NativeRolloutEngine keeps no sessions between generate calls (generate has no sessions=)",
)
def test_kept_engine_sessions_prefill_only_the_new_ids(random_model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    engine = NativeRolloutEngine(random_model)
    with ChatCompletionsServer(engine, renderer, MODEL, SamplingParams(max_new_tokens=4, temperature=1.0)) as server:
        session = server.open_session()
        client = client_for(session.base_url)
        messages = [{"role": "user", "content": "hi"}]
        for turn in range(3):
            reply = client.chat.completions.create(model=MODEL, messages=messages).choices[0].message
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": f"turn {turn}"}]
        trajectory = server.close_session(session.id)
    # (closing the server waits for its engine thread, which ends the engine session first)
    # the first turn prefills its prompt; each later one its previous turn's last id and the bridged ids
    bridged = [len(list(group)) for sampled, group in itertools.groupby(trajectory.sampled_mask) if not sampled]
    assert engine.stats.prefill_tokens == len(trajectory.prompt_ids) + sum(1 + n for n in bridged)
    assert len(bridged) == 2 and engine.session_tokens == 0
    assert_sampled_logprobs_match_the_model(random_model, trajectory)


def test_a_turn_cut_by_the_engine_leaves_the_rest_of_the_session_budget(random_model, tokenizer):
    """A request for more than the session has left is cut to what is left; when the engine then
    stops the turn sooner (the run's turn limit), the budget is not spent and the session goes on."""
    from archon.agents.agent_episodes import TurnLimitedEngine

    renderer = HermesCharRenderer(tokenizer)
    prompt_len = len(renderer.render_prompt([{"role": "user", "content": "hi"}]))
    engine = TurnLimitedEngine(NativeRolloutEngine(random_model), max_turn_tokens=2)
    budget = prompt_len + 40
    with ChatCompletionsServer(
        engine, renderer, MODEL, SamplingParams(max_new_tokens=50, temperature=0), max_session_tokens=budget
    ) as server:
        session = server.open_session()
        client = client_for(session.base_url)
        messages = [{"role": "user", "content": "hi"}]
        response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100)
        assert response.choices[0].finish_reason == "length" and response.usage.completion_tokens == 2
        messages += [
            {"role": "assistant", "content": response.choices[0].message.content},
            {"role": "user", "content": "x"},
        ]
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=100)
        assert second.usage.completion_tokens == 2
