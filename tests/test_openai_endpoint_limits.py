"""The chat-completions endpoint against hostile and crowded clients, on the built-in engine and a
tiny random Qwen3 (512 positions) over a character tokenizer: the per-run bearer token, the bounds
on every part of a request, and a crowd of simultaneous clients. Each bad request must get a 4xx
naming what is wrong, and the server must go on answering."""

from __future__ import annotations

import http.client
import json
import logging
import os
import resource
import socket
import threading
import time

import pytest

from archon.agents.openai_agents import run_agent_group
from archon.agents.openai_server import ChatCompletionsServer
from archon.build import build_model
from archon.rl.tasks import build_char_tokenizer
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.tools.align import make_tiny_hf_checkpoint
from tests.test_openai_server import HermesCharRenderer

openai = pytest.importorskip("openai")

MODEL = "tiny-policy"
CONTEXT = 512
"""The tiny checkpoint's max_position_embeddings: the endpoint's context."""
HELLO = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    checkpoint = make_tiny_hf_checkpoint(
        "qwen3", tmp_path_factory.mktemp("qwen3") / "hf", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
    )
    model = build_model(checkpoint).model.eval()
    assert model.args.max_position_embeddings == CONTEXT
    return model


@pytest.fixture
def server(model, tokenizer):
    with ChatCompletionsServer(
        NativeRolloutEngine(model), HermesCharRenderer(tokenizer), MODEL, SamplingParams(max_new_tokens=4)
    ) as server:
        yield server


def auth(server) -> dict:
    return {"Authorization": f"Bearer {server.api_key}"}


def request(server, method: str, path: str, body: bytes | None = None, headers: dict | None = None, timeout=30):
    """(status, headers, parsed JSON body) of one request on a fresh connection."""
    connection = http.client.HTTPConnection(server.host, server.port, timeout=timeout)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def raw_exchange(server, head: bytes, body: bytes = b"", timeout: float = 10.0) -> tuple[int, dict]:
    """Send `head` (the request line and headers, without the blank line) and `body` on a raw
    socket, keep it open, and read the answer: (status, parsed JSON body). A server that waits for
    more of the body times out here."""
    with socket.create_connection((server.host, server.port), timeout=timeout) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        header_block, _, rest = data.partition(b"\r\n\r\n")
        status = int(header_block.split(b" ")[1])
        length = int(
            next(
                line.split(b":")[1]
                for line in header_block.split(b"\r\n")
                if line.lower().startswith(b"content-length")
            )
        )
        while len(rest) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return status, json.loads(rest)


def post_head(server, path: str, length_header: bytes | None, authorized: bool = True) -> bytes:
    lines = [f"POST {path} HTTP/1.1".encode(), f"Host: {server.host}".encode(), b"Content-Type: application/json"]
    if authorized:
        lines.append(f"Authorization: Bearer {server.api_key}".encode())
    if length_header is not None:
        lines.append(length_header)
    return b"\r\n".join(lines)


def assert_still_serving(server) -> None:
    status, _, body = request(server, "POST", "/v1/chat/completions", json.dumps(HELLO).encode(), auth(server))
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


# ---- the bearer token -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic dXNlcjpwdw=="}, {"Authorization": "Bearer"}],
    ids=["none", "wrong token", "other scheme", "empty"],
)
def test_requests_without_the_token_get_401(server, headers):
    session = server.open_session()
    for method, path, body in [
        ("GET", "/v1/models", None),
        ("POST", "/v1/chat/completions", json.dumps(HELLO).encode()),
        ("POST", f"/sessions/{session.id}/v1/chat/completions", json.dumps(HELLO).encode()),
    ]:
        status, answer_headers, answer = request(server, method, path, body, headers)
        assert status == 401, (method, path)
        assert answer_headers["WWW-Authenticate"] == "Bearer"
        assert answer["error"]["code"] == "invalid_api_key" and "OPENAI_API_KEY" in answer["error"]["message"]
        assert server.api_key not in json.dumps(answer)
    assert server.generate_calls == 0 and session.trajectory is None
    assert_still_serving(server)


def test_the_openai_client_needs_the_token(server):
    session = server.open_session()
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0).chat.completions.create(
            model=MODEL, messages=messages
        )
    client = openai.OpenAI(base_url=session.base_url, api_key=server.api_key, max_retries=0)
    assert client.chat.completions.create(model=MODEL, messages=messages).choices[0].message.role == "assistant"


def test_agents_find_the_token_in_their_environment_and_nothing_writes_it(server, caplog, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "the user's own key")
    seen = []

    def agent(base_url: str, row: dict) -> float:
        seen.append(os.environ["OPENAI_API_KEY"])
        client = openai.OpenAI(base_url=base_url, max_retries=0)  # reads OPENAI_API_KEY
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": row["prompt"]}])
        return float(len(reply.choices[0].message.content or ""))

    with caplog.at_level(logging.DEBUG):
        trajectories = run_agent_group(server, agent, {"prompt": "go"}, group_size=3, timeout_s=60)
        status, _, _ = request(server, "GET", "/v1/models")  # a refused request is logged too
    assert status == 401
    assert [t.stop_reason.value for t in trajectories] == ["done"] * 3
    assert seen == [server.api_key] * 3
    assert os.environ["OPENAI_API_KEY"] == "the user's own key"  # put back when the group ends
    assert caplog.records and server.api_key not in caplog.text
    assert all(server.api_key not in repr(vars(t)) for t in trajectories)
    assert server.api_key not in repr(server)


# ---- bounds ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "length_header, status, names",
    [
        (None, 411, "Content-Length"),
        (b"Content-Length: -1", 400, "Content-Length"),
        (b"Content-Length: abc", 400, "Content-Length"),
        (b"Content-Length: 1e12", 400, "Content-Length"),
        (b"Content-Length: +5", 400, "Content-Length"),
        (b"Content-Length: 1000000000000", 413, "max_body_bytes"),
        (b"Content-Length: 2\r\nContent-Length: 2", 400, "Content-Length"),
        (b"Transfer-Encoding: chunked", 411, "Content-Length"),
    ],
    ids=["missing", "negative", "non-numeric", "float", "signed", "1e12", "twice", "chunked"],
)
def test_bad_content_lengths_are_answered_at_once(server, length_header, status, names):
    session = server.open_session()
    head = post_head(server, f"/sessions/{session.id}/v1/chat/completions", length_header)
    started = time.monotonic()
    got, body = raw_exchange(server, head, b"{}")  # the socket stays open: no answer would be a hang
    assert time.monotonic() - started < 5
    assert got == status and names in body["error"]["message"]
    assert session.trajectory is None
    assert_still_serving(server)


def test_a_10_mb_body_gets_413_naming_the_limit(server):
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 10_000_000}]}).encode()
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 413 and answer["error"]["param"] == "max_body_bytes"
    assert f"max_body_bytes={server.max_body_bytes}" in answer["error"]["message"]
    assert server.generate_calls == 0
    assert_still_serving(server)


def test_a_stalled_body_gets_408(model, tokenizer):
    with ChatCompletionsServer(
        NativeRolloutEngine(model), HermesCharRenderer(tokenizer), MODEL, SamplingParams(), idle_timeout_s=1.0
    ) as server:
        started = time.monotonic()
        status, body = raw_exchange(server, post_head(server, "/v1/chat/completions", b"Content-Length: 100"), b"{")
        assert status == 408 and "idle_timeout_s=1.0" in body["error"]["message"]
        assert time.monotonic() - started < 5
        assert_still_serving(server)


@pytest.mark.parametrize("depth", [65, 20_000], ids=["one past the bound", "past the recursion limit"])
def test_deeply_nested_json_gets_400(server, depth):
    lists = depth - 1  # inside the body's object
    body = b'{"model": "tiny-policy", "messages": ' + b"[" * lists + b"]" * lists + b"}"
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 400 and "max_json_depth=64 levels" in answer["error"]["message"]
    assert_still_serving(server)


def test_json_at_the_depth_bound_is_read(server):
    body = b'{"model": "tiny-policy", "messages": [' + b"[" * 62 + b"]" * 62 + b"]}"  # 64 levels
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 400 and answer["error"]["param"] == "messages[0]"  # read, then refused for what it says
    schema: dict = {"type": "string"}
    for _ in range(5):
        schema = {"type": "object", "properties": {"a": schema}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = json.dumps({**HELLO, "tools": tools}).encode()
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 200, answer


@pytest.mark.parametrize("max_tokens", [CONTEXT, 10**9, 2**31])
def test_max_tokens_past_the_context_gets_400(server, max_tokens):
    body = json.dumps({**HELLO, "max_tokens": max_tokens}).encode()
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 400 and answer["error"]["param"] == "max_tokens"
    assert f"context of {CONTEXT} tokens" in answer["error"]["message"]
    assert server.generate_calls == 0
    assert_still_serving(server)


def test_messages_past_the_context_get_400(server):
    session = server.open_session()
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * CONTEXT}]}).encode()
    status, _, answer = request(server, "POST", f"/sessions/{session.id}/v1/chat/completions", body, auth(server))
    assert status == 400 and answer["error"]["param"] == "messages"
    assert f"context of {CONTEXT} tokens" in answer["error"]["message"]
    assert server.generate_calls == 0 and session.trajectory is None


def test_the_default_turn_length_is_cut_to_the_context(model, tokenizer):
    renderer = HermesCharRenderer(tokenizer)
    content = "x" * (CONTEXT - len(renderer.render_prompt([{"role": "user", "content": ""}])) - 3)
    with ChatCompletionsServer(
        NativeRolloutEngine(model), renderer, MODEL, SamplingParams(max_new_tokens=50, temperature=0)
    ) as server:
        session = server.open_session()
        client = openai.OpenAI(base_url=session.base_url, api_key=server.api_key, max_retries=0)
        reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}])
        assert reply.usage.prompt_tokens == CONTEXT - 3
        assert reply.usage.completion_tokens <= 3
        assert len(session.trajectory.trajectory_ids) <= CONTEXT


@pytest.mark.parametrize("n", [True, 2, 10**12, "1"])
def test_n_other_than_1_gets_400(server, n):
    body = json.dumps({**HELLO, "n": n}).encode()
    status, _, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
    assert status == 400 and answer["error"]["param"] == "n"


# ---- a crowd --------------------------------------------------------------------------------------


def test_256_simultaneous_requests_all_get_answers(server):
    clients = 256
    barrier, statuses, errors = threading.Barrier(clients), [], []
    body = json.dumps(HELLO).encode()

    def client() -> None:
        try:
            barrier.wait(60)
            statuses.append(request(server, "POST", "/v1/chat/completions", body, auth(server), timeout=120)[0])
        except Exception as e:  # a reset connection, a timeout: the failure this test is about
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    assert errors == [] and statuses == [200] * clients
    assert server.generate_calls >= clients // server.max_batch


class GatedEngine(NativeRolloutEngine):
    """The built-in engine, whose generate calls wait for `gate`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def generate(self, prompts, sampling, sessions=None):
        self.gate.wait(60)
        return super().generate(prompts, sampling, sessions=sessions)


def test_a_full_queue_answers_503_and_the_openai_client_retries(model, tokenizer):
    engine = GatedEngine(model)
    with ChatCompletionsServer(
        engine, HermesCharRenderer(tokenizer), MODEL, SamplingParams(max_new_tokens=2), max_queued_requests=2
    ) as server:
        body = json.dumps(HELLO).encode()
        queued = [
            threading.Thread(target=request, args=(server, "POST", "/v1/chat/completions", body, auth(server)))
            for _ in range(2)
        ]
        for thread in queued:
            thread.start()
        while server.queued_requests < 2:
            time.sleep(0.01)
        status, headers, answer = request(server, "POST", "/v1/chat/completions", body, auth(server))
        assert status == 503 and headers["Retry-After"] == "1" and answer["error"]["param"] == "max_queued_requests"

        replies = []
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=5)
        retrying = threading.Thread(
            target=lambda: replies.append(client.chat.completions.create(model=MODEL, messages=HELLO["messages"]))
        )
        started = time.monotonic()
        retrying.start()
        time.sleep(0.5)
        engine.gate.set()
        retrying.join(60)
        for thread in queued:
            thread.join(60)
        assert replies and replies[0].choices[0].message.role == "assistant"
        assert time.monotonic() - started >= 1.0  # it waited out Retry-After at least once


def test_connections_past_max_connections_wait_for_a_free_one(model, tokenizer):
    with ChatCompletionsServer(
        NativeRolloutEngine(model),
        HermesCharRenderer(tokenizer),
        MODEL,
        SamplingParams(max_new_tokens=2),
        max_connections=1,
    ) as server:
        first = http.client.HTTPConnection(server.host, server.port, timeout=30)
        first.request("GET", "/v1/models", headers=auth(server))
        assert first.getresponse().read()  # the connection stays open (keep-alive), holding the one slot
        answers = []
        second = threading.Thread(
            target=lambda: answers.append(request(server, "GET", "/v1/models", None, auth(server)))
        )
        second.start()
        second.join(1.0)
        assert second.is_alive() and answers == []  # waiting in the listen backlog
        first.close()
        second.join(30)
        assert answers and answers[0][0] == 200


def test_connections_are_bounded_by_the_open_file_limit(model, tokenizer):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4000, hard), hard))  # above what this process has open
    try:
        server = ChatCompletionsServer(
            NativeRolloutEngine(model), HermesCharRenderer(tokenizer), MODEL, SamplingParams()
        )
        assert server.max_connections == min(4000, hard) // 4
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
