"""An OpenAI-compatible chat endpoint served from a rollout engine, recording the tokens it samples.

Agent code written against an OpenAI client runs unmodified; each episode gets a session with its
own base URL, and the session's Trajectory holds exactly the ids the model was prompted with and
sampled:

    with ChatCompletionsServer(engine, renderer, "policy", SamplingParams(max_new_tokens=256)) as server:
        session = server.open_session()
        client = openai.OpenAI(base_url=session.base_url, api_key=server.api_key)
        ... the agent calls client.chat.completions.create(model="policy", messages=..., tools=...) ...
        trajectory = server.close_session(session.id)

Within a session each request carries the whole conversation so far. When it extends the previous
request's messages and the assistant message returned for it (compared as parsed: role, content,
tool calls' names and arguments, tool_call_id; clients re-serialise arguments and drop reasoning),
the new messages are bridged onto the recorded ids (`Renderer.bridge`) and nothing sampled is
re-tokenized. Any other request renders the conversation from scratch: the session counts it in
`rerendered`, says why in `warnings`, and its trajectory starts again from that render.

Requests of all sessions that arrive together (within `batch_window_s`, at most `max_batch`) and
sample alike go to the engine in one `generate` call, made from one thread
(archon.agents.openai_engine); an engine whose `generate` takes `sessions=` keeps each session's
KV cache between its turns.

Every request carries the run's token (`Authorization: Bearer <api_key>`; run_agent_group hands it
to agent code as OPENAI_API_KEY) and is bounded: its body (`max_body_bytes`, `max_json_depth`), its
conversation and max_tokens (the model's context, `max_context_tokens`, and the session's budget),
the requests waiting for the engine (`max_queued_requests`: past them, 503 with Retry-After) and
the connections served at once (`max_connections`: past them, a connection waits to be accepted).

Requests are checked and messages converted by archon.agents.openai_protocol; the HTTP server and
routes are archon.agents.openai_http.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import re
import secrets
import threading
import time
import uuid
from dataclasses import replace

from archon.agents.openai_engine import EngineThread, Pending, engine_context
from archon.agents.openai_http import (  # noqa: F401 - ROUTE: at its old path
    ROUTE,
    HTTPServer,
    default_max_connections,
    handler_class,
)
from archon.agents.openai_protocol import (  # noqa: F401 - ROLES, UNSUPPORTED_WHEN_SET: at their old path
    ROLES,
    UNSUPPORTED_WHEN_SET,
    ChatRequest,
    OpenAIError,
    assistant_message,
    canonical,
    parse_request,
    template_form,
)
from archon.agents.renderer import Message, Renderer
from archon.agents.trajectory import Trajectory
from archon.rollout.base import Sample, SamplingParams

logger = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9._-]{1,128}$")
RUN_API_KEY = secrets.token_urlsafe(32)
"""The token this process's endpoints require unless given another: one per run (per process)."""
BODY_BYTES_PER_TOKEN = 32
"""The default max_body_bytes: this many bytes of request per token of the context (a message's
JSON takes a few bytes per token; the bound keeps the tokenizer's work and memory in proportion)."""
MIN_BODY_BYTES, MAX_BODY_BYTES, UNKNOWN_CONTEXT_BODY_BYTES = 2**16, 8 * 2**20, 4 * 2**20
RETRY_AFTER_S = 1
"""What a request refused for a full queue is told to wait (the Retry-After header)."""


# ---- sessions -----------------------------------------------------------------------------------


class Session:
    """One episode's conversation with the endpoint, at `base_url`. `trajectory` is None until the
    first request; `rerendered` counts the requests that did not extend the recorded conversation,
    `warnings` says why each did."""

    def __init__(self, server: ChatCompletionsServer, session_id: str) -> None:
        self.server, self.id = server, session_id
        self.base_url = f"{server.url}/sessions/{session_id}/v1"
        self.trajectory: Trajectory | None = None
        self.rerendered = 0
        self.warnings: list[str] = []
        self.closed_reason: str | None = None
        self.closed = threading.Event()
        self._lock = threading.Lock()
        """Held for a whole request: a session's requests run one at a time."""
        self.record_lock = threading.Lock()
        """Held while a request records its turn and while the session closes."""
        self._conversation: list[tuple] = []
        """The recorded messages, canonical: the last request's and the assistant message returned."""
        self._tools: list[dict] | None = None
        self._last_turn: Sample | None = None
        self._budget_spent = False
        self._renders = 0
        self._tool_call_count = 0

    @property
    def engine_session(self) -> str:
        """The engine's key for the current trajectory (a fresh one after each re-render)."""
        return f"{self.id}/{self._renders}"

    def _extension(self, request: ChatRequest) -> tuple[list[Message] | None, str | None]:
        """(the messages the request adds to the recorded conversation, None), or (None, why it does
        not extend it)."""
        if self.trajectory is None:
            return None, None
        if request.tools != self._tools:
            return None, "its tools differ from those of the recorded conversation"
        recorded = len(self._conversation)
        if len(request.messages) < recorded:
            return None, f"it has {len(request.messages)} messages, fewer than the {recorded} recorded"
        for i, (sent, kept) in enumerate(zip(request.messages, self._conversation)):
            if canonical(sent) != kept:
                return None, f"messages[{i}] ({sent['role']}) differs from the recorded conversation"
        return request.messages[recorded:], None

    def chat(self, request: ChatRequest, request_id: str) -> dict:
        server = self.server
        with self._lock:
            if self.closed.is_set():
                raise OpenAIError(400, f"session {self.id!r} is closed ({self.closed_reason})", "session_id")
            if self._budget_spent:
                raise OpenAIError(
                    400,
                    f"session {self.id!r} has used its budget of max_session_tokens={server.max_session_tokens} tokens",
                    "max_session_tokens",
                )
            new_messages, why = self._extension(request)
            if new_messages is None:
                if why is not None:
                    self.rerendered += 1
                    self.warnings.append(f"request {request_id}: rendered from scratch, because {why}")
                    server._engine.end_session(self.engine_session)
                    self._renders += 1
                trajectory = Trajectory(prompt_ids=server.renderer.render_prompt(request.messages, tools=request.tools))
                trajectory.messages = copy.deepcopy(request.messages)
                bridged: list[int] = []
                context = trajectory.prompt_ids
            else:
                trajectory = self.trajectory
                sampled = list(self._last_turn.completion_ids)
                # a turn cut by max_tokens is closed with the turn's stop token, as if it had sampled it
                closing = [] if self._last_turn.finish_reason == "stop" else [server.renderer.stop_token_ids[0]]
                bridged = closing + server.renderer.bridge(sampled + closing, new_messages)
                context = trajectory.trajectory_ids + bridged
            sampling, cut = server._sampling(request, len(context))
            sample = server._engine.submit(Pending(context, sampling, self.engine_session, cancelled=self.closed))
            turn = server.renderer.parse_turn(sample.completion_ids)
            with self.record_lock:
                if self.closed.is_set():
                    raise OpenAIError(
                        400,
                        f"session {self.id!r} was closed while its request ran ({self.closed_reason})",
                        "session_id",
                    )
                return self._record(
                    request, request_id, trajectory, new_messages, bridged, sample, turn, len(context), cut
                )

    def _record(self, request, request_id, trajectory, new_messages, bridged, sample, turn, prompt_tokens, cut) -> dict:
        """Add a request that succeeded to the trajectory; its response."""
        server = self.server
        message, self._tool_call_count = assistant_message(turn, self._tool_call_count)
        if turn.parse_error is not None:
            self.warnings.append(f"request {request_id}: the turn's tool calls did not parse: {turn.parse_error}")
        if new_messages is None:
            trajectory.start_version = sample.version
            self.trajectory, self._tools = trajectory, request.tools
            self._conversation = [canonical(m) for m in request.messages]
        else:
            trajectory.add_environment(bridged)
            trajectory.messages += copy.deepcopy(new_messages)
            self._conversation += [canonical(m) for m in new_messages]
        trajectory.add_sampled(sample.completion_ids, sample.logprobs, sample.token_versions)
        recorded = template_form(message)
        trajectory.messages.append(recorded)
        trajectory.num_turns += 1
        trajectory.num_tool_calls += len(turn.tool_calls)
        self._conversation.append(canonical(recorded))
        self._last_turn = sample
        if cut and prompt_tokens + len(sample.completion_ids) >= server.max_session_tokens:
            self._budget_spent = True  # the turn filled what was left (not a shorter engine limit)
        return server._completion(request_id, message, sample, prompt_tokens)


# ---- the server ---------------------------------------------------------------------------------


class ChatCompletionsServer:
    """`POST /v1/chat/completions` and `GET /v1/models` (unrecorded), and the same under each
    session's base URL `/sessions/<id>/v1` (recorded in the session's Trajectory).

    default_sampling: what a request does not set (max_new_tokens, temperature, top_p, top_k);
    the stop tokens are always the renderer's. max_session_tokens: the most ids a session's
    trajectory may hold (prompt, sampled and bridged); a request is cut to what is left (its
    finish_reason "length"), and the session's later requests are refused.
    batch_window_s, max_batch: how long the engine's thread waits for more requests after the
    first, and the most requests it takes into one generate call.
    api_key: the token every request must carry (`Authorization: Bearer <api_key>`; else 401);
    default: RUN_API_KEY, this process's.
    max_context_tokens: the most tokens a turn's prompt and sampled ids may take together; a request
    whose conversation or max_tokens does not fit is refused (400), a default turn length is cut to
    fit. Default: the engine's (`engine_context`); None there too: unbounded.
    max_body_bytes: the largest body read (413 past it); default BODY_BYTES_PER_TOKEN per token of
    the context, within [MIN_BODY_BYTES, MAX_BODY_BYTES] (UNKNOWN_CONTEXT_BODY_BYTES without one).
    max_json_depth: how deep a body's arrays and objects may nest (400 past it).
    max_queued_requests: chat requests taken at once (waiting for or in the engine); one more gets
    503 with Retry-After (an openai client retries it).
    max_connections: connections served at once; one more waits in the listen backlog. Default:
    `default_max_connections()`, 1024 or a quarter of the process's open-file limit.
    idle_timeout_s: how long a connection may wait for the client's next bytes (408 mid-body)."""

    def __init__(
        self,
        engine,
        renderer: Renderer,
        model_name: str,
        default_sampling: SamplingParams,
        host: str = "127.0.0.1",
        port: int = 0,
        max_session_tokens: int | None = None,
        batch_window_s: float = 0.005,
        max_batch: int = 64,
        api_key: str | None = None,
        max_context_tokens: int | None = None,
        max_body_bytes: int | None = None,
        max_json_depth: int = 64,
        max_queued_requests: int = 1024,
        max_connections: int | None = None,
        idle_timeout_s: float = 60.0,
    ) -> None:
        if default_sampling.n != 1:
            raise ValueError(f"default_sampling.n must be 1 (one choice per request), got {default_sampling.n}")
        if max_session_tokens is not None and max_session_tokens < 1:
            raise ValueError(f"max_session_tokens must be >= 1, got {max_session_tokens}")
        if max_batch < 1 or batch_window_s < 0:
            raise ValueError(f"max_batch ({max_batch}) must be >= 1 and batch_window_s ({batch_window_s}) >= 0")
        self.engine, self.renderer, self.model_name = engine, renderer, model_name
        self.default_sampling = replace(default_sampling, stop_token_ids=tuple(renderer.stop_token_ids))
        self.max_session_tokens = max_session_tokens
        self.host, self.port = host, port
        self.batch_window_s, self.max_batch = batch_window_s, max_batch
        if api_key is not None and (len(api_key) < 16 or not api_key.isascii() or not api_key.isprintable()):
            raise ValueError("api_key must be at least 16 printable ASCII characters")
        self.api_key = api_key if api_key is not None else RUN_API_KEY
        self.max_context_tokens = max_context_tokens if max_context_tokens is not None else engine_context(engine)
        self.max_body_bytes = max_body_bytes if max_body_bytes is not None else self._default_body_bytes()
        self.max_json_depth, self.max_queued_requests = max_json_depth, max_queued_requests
        self.max_connections = max_connections if max_connections is not None else default_max_connections()
        self.idle_timeout_s = idle_timeout_s
        for name in (
            "max_context_tokens",
            "max_body_bytes",
            "max_json_depth",
            "max_queued_requests",
            "max_connections",
            "idle_timeout_s",
        ):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self._sessions: dict[str, Session] = {}
        self._closed_sessions: dict[str, str] = {}
        """Why each closed session closed, so that its late requests are told."""
        self._lock = threading.Lock()
        self._request_count = 0
        self.queued_requests = 0
        """Chat requests taken and not yet answered."""
        self._http: HTTPServer | None = None
        self._engine: EngineThread | None = None

    def __repr__(self) -> str:  # never the token
        return f"ChatCompletionsServer({self.model_name!r}, http://{self.host}:{self.port})"

    def _default_body_bytes(self) -> int:
        """BODY_BYTES_PER_TOKEN per token a request's conversation may take (the context, or the
        session budget when smaller), within [MIN_BODY_BYTES, MAX_BODY_BYTES]."""
        known = [n for n in (self.max_context_tokens, self.max_session_tokens) if n is not None]
        if not known:
            return UNKNOWN_CONTEXT_BODY_BYTES
        return min(MAX_BODY_BYTES, max(MIN_BODY_BYTES, BODY_BYTES_PER_TOKEN * min(known)))

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> ChatCompletionsServer:
        if self._http is not None:
            return self
        self._engine = EngineThread(self.engine, self.batch_window_s, self.max_batch)
        self._http = HTTPServer((self.host, self.port), handler_class(self), self.max_connections)
        self.port = self._http.server_address[1]
        threading.Thread(target=self._http.serve_forever, name="chat-completions-http", daemon=True).start()
        return self

    def close(self) -> None:
        """Stop serving; sessions still open are closed (their trajectories are dropped). Safe to call twice."""
        if self._http is None:
            return
        for session_id in list(self._sessions):
            self.close_session(session_id, reason="the server closed")
        self._http.closing.set()
        self._http.shutdown()
        self._http.server_close()
        self._engine.close()
        self._http = None

    def __enter__(self) -> ChatCompletionsServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def url(self) -> str:
        if self._http is None:
            raise RuntimeError("the server is not started: call start() or use it as a context manager")
        return f"http://{self.host}:{self.port}"

    @property
    def generate_calls(self) -> int:
        """The engine's generate calls so far (requests that coincide share one)."""
        return self._engine.generate_calls if self._engine is not None else 0

    # ---- sessions -------------------------------------------------------------------------------
    def open_session(self, session_id: str | None = None) -> Session:
        session_id = session_id if session_id is not None else uuid.uuid4().hex[:16]
        if not SESSION_ID.match(session_id):
            raise ValueError(f"session id {session_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-'")
        with self._lock:
            if session_id in self._sessions or session_id in self._closed_sessions:
                raise ValueError(f"session id {session_id!r} is already used on this server")
            session = self._sessions[session_id] = Session(self, session_id)
        return session

    def session(self, session_id: str) -> Session:
        with self._lock:
            if session_id in self._sessions:
                return self._sessions[session_id]
            if session_id in self._closed_sessions:
                raise OpenAIError(
                    400, f"session {session_id!r} is closed ({self._closed_sessions[session_id]})", "session_id"
                )
        raise OpenAIError(
            400, f"unknown session {session_id!r}: open it with ChatCompletionsServer.open_session", "session_id"
        )

    def close_session(self, session_id: str, reason: str = "closed by the server's owner") -> Trajectory:
        """End a session: its later requests (and one still running) get an error naming `reason`.
        Its trajectory (one with no ids when it made no request)."""
        with self._lock:
            session = self._sessions.pop(session_id, None)
            if session is None:
                raise KeyError(f"no open session {session_id!r}")
            self._closed_sessions[session_id] = reason
        with session.record_lock:
            session.closed_reason = reason
            session.closed.set()
        self._engine.end_session(session.engine_session)
        return session.trajectory if session.trajectory is not None else Trajectory(prompt_ids=[])

    # ---- requests -------------------------------------------------------------------------------
    def _next_request_id(self) -> str:
        with self._lock:
            self._request_count += 1
            return f"chatcmpl-{self._request_count}"

    def _sampling(self, request: ChatRequest, context_len: int) -> tuple[SamplingParams, bool]:
        """The request's sampling parameters, and whether the session budget cut its max_tokens. The
        turn fits the model's context: a conversation or a max_tokens that does not is refused."""
        sampling = self.default_sampling
        max_new = request.max_tokens or sampling.max_new_tokens
        if self.max_context_tokens is not None:
            room = self.max_context_tokens - context_len
            if room < 1:
                raise OpenAIError(
                    400,
                    f"the conversation takes {context_len} tokens, the model's whole context of "
                    f"{self.max_context_tokens} tokens",
                    "messages",
                )
            if request.max_tokens is not None and request.max_tokens > room:
                raise OpenAIError(
                    400,
                    f"'max_tokens' is {request.max_tokens}, more than the {room} tokens that the conversation's "
                    f"{context_len} leave of the model's context of {self.max_context_tokens} tokens",
                    "max_tokens",
                )
            max_new = min(max_new, room)
        cut = False
        if self.max_session_tokens is not None:
            left = self.max_session_tokens - context_len
            if left < 1:
                raise OpenAIError(
                    400,
                    f"the conversation takes {context_len} tokens, the session's whole budget of "
                    f"max_session_tokens={self.max_session_tokens}",
                    "max_session_tokens",
                )
            cut, max_new = max_new > left, min(max_new, left)
        updates = {"max_new_tokens": max_new, "seed": request.seed}
        for name in ("temperature", "top_p"):
            if getattr(request, name) is not None:
                updates[name] = getattr(request, name)
        return replace(sampling, **updates), cut

    def _completion(self, request_id: str, message: dict, sample: Sample, prompt_tokens: int) -> dict:
        if sample.finish_reason == "length":
            finish_reason = "length"
        else:
            finish_reason = "tool_calls" if message.get("tool_calls") else "stop"
        completion_tokens = len(sample.completion_ids)
        return {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    @contextlib.contextmanager
    def _queued(self):
        """A place among the max_queued_requests taken at once; 503 with Retry-After when none is free."""
        with self._lock:
            if self.queued_requests >= self.max_queued_requests:
                raise OpenAIError(
                    503,
                    f"the endpoint has max_queued_requests={self.max_queued_requests} requests waiting for the "
                    f"engine: retry after {RETRY_AFTER_S} s",
                    "max_queued_requests",
                    kind="server_error",
                    headers=(("Retry-After", str(RETRY_AFTER_S)),),
                )
            self.queued_requests += 1
        try:
            yield
        finally:
            with self._lock:
                self.queued_requests -= 1

    def chat(self, body, session_id: str | None) -> dict:
        """One chat-completions request (the body, parsed JSON), in a session or unrecorded."""
        with self._queued():
            return self._chat(body, session_id)

    def _chat(self, body, session_id: str | None) -> dict:
        session = self.session(session_id) if session_id is not None else None
        request = parse_request(body)
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise OpenAIError(
                404, f"the model {model!r} does not exist: this endpoint serves {self.model_name!r}", "model"
            )
        request_id = self._next_request_id()
        if session is not None:
            return session.chat(request, request_id)
        prompt = self.renderer.render_prompt(request.messages, tools=request.tools)
        sampling, _ = self._sampling(request, len(prompt))
        sample = self._engine.submit(Pending(prompt, sampling, engine_session=request_id))
        self._engine.end_session(request_id)
        message, _ = assistant_message(self.renderer.parse_turn(sample.completion_ids), 0)
        return self._completion(request_id, message, sample, len(prompt))

    def models(self) -> dict:
        return {
            "object": "list",
            "data": [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "archon"}],
        }
