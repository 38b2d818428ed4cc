"""vLLM server processes: launch (with the command line and environment of
archon.rollout.vllm_launch), wait until healthy, their logs and the root cause of a failure, HTTP
requests to them, archon's worker RPCs (/collective_rpc), and shutdown. Generation
(archon.rollout.vllm) and weight sync (archon.sync) both talk to servers through `VLLMServers`.

Security: a launched server listens on `host` (loopback by default). Only the collective transport
needs vLLM's dev mode (`/collective_rpc`), which vLLM's `--api-key` does not guard; a launch in dev
mode on a non-loopback host is refused unless `allow_dev_mode_on_network` is set. archon's worker
methods also require a per-run secret that reaches the servers in their environment
(ARCHON_WORKER_SECRET), never on a command line. `api_key` guards the generation routes.

The client is thread-safe: every request opens its own connection, and the pool runs requests of
several callers (a generating thread and a publishing one) at once.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import http.client
import json
import os
import re
import secrets
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from archon.checkpoint.hf import read_json_file
from archon.rollout.vllm_config import VLLMConfig
from archon.rollout.vllm_launch import WORKER_EXTENSION, server_command, server_environment
from archon.rollout.vllm_network import (
    RequestThreads,
    VLLMServerError,
    check_port_free,
    is_loopback_host,
    probe_health,
)
from archon.rollout.vllm_worker import WORKER_SECRET_ENV

PROGRESS_EVERY_S = 30.0
"""How often the wait for starting servers says where it stands."""
HEALTH_CHECK_EVERY_S = 10.0
"""How often wait_all checks the health of the servers it waits on (every health_timeout_s when
that is shorter)."""


def looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.path.exists(model) or model.count("/") != 1


def read_model_config(model: str) -> dict | None:
    """The config.json of a local model directory (None for a hub name)."""
    path = Path(model).expanduser() / "config.json"
    return read_json_file(path, "model config") if path.is_file() else None


def max_position_embeddings(model_config: dict) -> int | None:
    """The model's context length from its config (top level, or text_config for multimodal ones)."""
    for section in (model_config, model_config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def resolve_max_model_len(
    configured: int | None,
    model_config: dict | None,
    longest_prompt_tokens: int | None,
    max_new_tokens: int | None,
    model: str = "the model",
) -> int | None:
    """The --max-model-len for a launched server: `configured` when set (it must hold the run's
    sequences), else the longest prompt plus max_new_tokens, which must fit in the model's
    max_position_embeddings. None when nothing is known (vLLM then takes the model's own)."""
    limit = max_position_embeddings(model_config) if model_config else None
    needed = None
    if longest_prompt_tokens is not None and max_new_tokens is not None:
        needed = longest_prompt_tokens + max_new_tokens
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"rollout.vllm.max_model_len must be positive, got {configured}")
        if needed is not None and configured < needed:
            raise ValueError(
                f"rollout.vllm.max_model_len {configured} is below the run's longest sequence: the longest "
                f"prompt has {longest_prompt_tokens} tokens and up to {max_new_tokens} new tokens are "
                f"generated ({needed}); raise max_model_len or leave it unset to derive it"
            )
        return configured  # vLLM checks it against the context, RoPE scaling included
    if needed is None:
        return None
    if limit is not None and needed > limit:
        raise ValueError(
            f"the run's longest sequence does not fit in {model}: the longest prompt has "
            f"{longest_prompt_tokens} tokens and up to {max_new_tokens} new tokens are generated "
            f"({needed}), above its max_position_embeddings {limit}; lower rollout.max_new_tokens (or "
            f"eval.max_new_tokens), drop long prompts with data.max_prompt_tokens, or, if the model's RoPE "
            f"scaling serves longer sequences, set rollout.vllm.max_model_len"
        )
    return needed


# A Python exception line ("ValueError: ...", "pydantic_core._pydantic_core.ValidationError: ...",
# "Exception: ...", "AssertionError"), after the "(EngineCore pid=N) " or "(APIServer pid=N) ERROR ... [file.py:N] "
# prefix vLLM puts on its processes' lines.
_LOG_PREFIX = re.compile(r"^(?:\([\w ]+pid=\d+\)\s*)?(?:(?:ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?")


def log_root_cause(log_text: str) -> str | None:
    """The line of a server log that says why it died: the last exception raised, with the indented
    detail lines that follow it (pydantic puts the reason there). vLLM's processes re-raise a
    failure of another one with errors that point back at it ("See root cause above", "See stack
    trace for root cause", "check the stack trace above for the root cause"); those are passed over
    for the exception before them."""
    lines = [_LOG_PREFIX.sub("", line, count=1) for line in log_text.splitlines()]
    found = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.fullmatch(line.rstrip())]
    while len(found) > 1 and "root cause" in lines[found[-1]].lower():
        found.pop()
    if not found:
        return None
    start = found[-1]
    cause = [lines[start].rstrip()]
    for line in lines[start + 1 : start + 6]:
        if not line.startswith(" ") or not line.strip() or line.strip().startswith("For further information"):
            break
        cause.append(line.rstrip())
    return "\n".join(cause)


class Server:
    """One server: its URL, and its process and log when archon launched it."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path

    def log_report(self, tail_lines: int = 10, exception: bool = True) -> str:
        """Why the server failed, as its log says: the exception that ended it (with `exception`;
        else, or without one, the last lines), then where the whole log is."""
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace")
        cause = log_root_cause(text) if exception else None
        if cause is None:
            cause = "the log's last lines:\n" + "\n".join(text.splitlines()[-tail_lines:])
        return f"{cause}\nFull server log: {self.log_path.resolve()}"

    def died(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        if code < 0:  # killed by a signal: an exception in the log is an older one the server survived
            return (
                f"vLLM server {self.url} was killed by {signal.Signals(-code).name}: {self.log_report(exception=False)}"
            )
        return f"vLLM server {self.url} exited with code {code}: {self.log_report()}"


class VLLMServers:
    """The servers of a run: launched here (rank 0, no `config.urls`) or given by URL.

    `lora` launches them with LoRA enabled (adapter mode); `hf_overrides` are passed as
    `--hf-overrides` (the family's config fields vLLM reads differently). Ranks other than 0 only
    connect, to generate on the servers rank 0 was given or launched."""

    def __init__(
        self,
        config: VLLMConfig,
        model: str | None,
        *,
        lora: bool,
        hf_overrides: dict | None = None,
        log_dir: str | os.PathLike | None = None,
        rank: int = 0,
        model_config: dict | None = None,
        longest_prompt_tokens: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """`longest_prompt_tokens` and `max_new_tokens` (the most any request asks for) size the
        launched servers' max_model_len when the config leaves it unset."""
        self.config = config
        self.rank = rank
        self.model = model
        self.lora = lora
        self.hf_overrides = hf_overrides or {}
        self.api_key = config.api_key or os.environ.get("VLLM_API_KEY") or None
        self.model_config = model_config
        self.max_model_len = None
        self.longest_sequence = None
        if longest_prompt_tokens is not None and max_new_tokens is not None:
            self.longest_sequence = longest_prompt_tokens + max_new_tokens
        self.worker_secret = None  # what archon's worker methods require; only rank 0 calls them
        if not config.urls and rank == 0:
            if model is None:
                raise ValueError("vLLM rollouts need a model path to launch servers (or urls of running ones)")
            if (
                config.transport == "collective"
                and not is_loopback_host(config.host)
                and not config.allow_dev_mode_on_network
            ):
                raise ValueError(
                    f"refusing to launch vLLM in dev mode on non-loopback host {config.host!r}: the collective "
                    f"transport needs /collective_rpc, which vLLM's api-key does not guard, so anyone who "
                    f"reaches the port could call the workers. Use host 127.0.0.1, or set "
                    f"rollout.vllm.allow_dev_mode_on_network on a private network"
                )
            self.max_model_len = resolve_max_model_len(
                config.max_model_len, model_config, longest_prompt_tokens, max_new_tokens, model
            )
            # a secret the user already shares with servers is kept; else a new one for this run
            self.worker_secret = os.environ.get(WORKER_SECRET_ENV) or secrets.token_hex(32)
        elif rank == 0 and config.transport == "collective":
            self.worker_secret = os.environ.get(WORKER_SECRET_ENV)
            if not self.worker_secret:
                raise ValueError(
                    f"the collective transport to servers given by rollout.vllm.urls needs their worker "
                    f"secret: start the servers with {WORKER_SECRET_ENV}=<secret> in their environment and "
                    f"set the same variable for the trainer"
                )
        self.log_dir = Path(log_dir or ".") / "vllm_logs"
        self._requests = RequestThreads("archon-vllm-request")
        self.servers: list[Server] = []
        self.served_model = None
        if rank != 0:
            self.servers = [Server(u) for u in config.urls]
            if self.servers:
                self.served_model = self._served_model_name()
            return
        if config.urls:
            self.servers = [Server(u) for u in config.urls]
        else:
            self.servers = [self._launch(i) for i in range(config.num_servers)]
        try:
            self._wait_until_healthy()
            self.served_model = self._served_model_name()
        except BaseException:
            self.close()
            raise

    def _launch(self, index: int) -> Server:
        cfg = self.config
        port = cfg.port + index
        check_port_free(cfg.host, port)
        args = server_command(
            cfg,
            self.model,
            port,
            model_config=self.model_config,
            max_model_len=self.max_model_len,
            hf_overrides=self.hf_overrides,
            lora=self.lora,
        )
        env = server_environment(cfg, index, worker_secret=self.worker_secret, api_key=self.api_key)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"server_{index}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return Server(f"http://{cfg.host}:{port}", process, log_path)

    def _wait_until_healthy(self) -> None:
        """Wait for every server to answer /health, saying every PROGRESS_EVERY_S where the wait
        stands. A launched server is waited for while its process lives (it listens only once the
        model is loaded). A server given by URL is running already: it is waited for only while it
        answers 503 (not ready); anything else (a refused connection, a host that does not
        resolve, an answer that is not HTTP or not vLLM's, no answer within health_timeout_s)
        fails at once, naming the URL and what was seen."""
        timeout_s = self.config.startup_timeout_s
        start = time.monotonic()
        next_progress = start + PROGRESS_EVERY_S
        for server in self.servers:
            launched = server.process is not None
            while True:
                reason = server.died()
                if reason:
                    raise VLLMServerError(f"vLLM server failed to start: {reason}")
                probe_timeout = min(5.0, self.config.health_timeout_s) if launched else self.config.health_timeout_s
                state, seen = probe_health(server.url, probe_timeout)
                if state == "healthy":
                    break
                if not launched and state != "starting":
                    if state == "silent":
                        seen += " (rollout.vllm.health_timeout_s)"
                    raise VLLMServerError(
                        f"vLLM server {server.url} (rollout.vllm.urls) cannot be used: {seen}. Check the URL and "
                        f"that a vLLM server runs there and answers GET /health with 200 before the run starts"
                    )
                elapsed = time.monotonic() - start
                if elapsed > timeout_s:
                    log = f": {server.log_report()}" if launched else f"; {seen}"
                    raise VLLMServerError(
                        f"vLLM server {server.url} was not healthy within {timeout_s:.0f} s "
                        f"(rollout.vllm.startup_timeout_s){log}"
                    )
                if time.monotonic() >= next_progress:
                    log = f"; its log: {server.log_path.resolve()}" if server.log_path is not None else ""
                    print(
                        f"waiting for vLLM server {server.url} to start: {elapsed:.0f} s of at most {timeout_s:.0f} s "
                        f"(rollout.vllm.startup_timeout_s); {seen}{log}",
                        flush=True,
                    )
                    next_progress = time.monotonic() + PROGRESS_EVERY_S
                time.sleep(1.0)

    def _served_model_name(self) -> str:
        server = self.servers[0]
        listing = self.request(server, "GET", "/v1/models")
        models = listing.get("data") if isinstance(listing, dict) else None
        base = None
        if isinstance(models, list):
            base = next((m for m in models if isinstance(m, dict) and m.get("parent") is None and "id" in m), None)
        if base is None:
            raise VLLMServerError(
                f"vLLM server {server.url} answered GET /v1/models with {str(listing)[:200]!r}, which is not a vLLM "
                f"server's model list; is this a vLLM server?"
            )
        served_len = base.get("max_model_len")
        if self.longest_sequence is not None and isinstance(served_len, int) and served_len < self.longest_sequence:
            raise ValueError(
                f"vLLM server {server.url} serves at most {served_len} tokens per sequence (its "
                f"max_model_len), below the run's longest prompt plus max_new_tokens ({self.longest_sequence})"
            )
        return base["id"]

    def _http_request(self, server: Server, method: str, path: str, body: dict | None) -> urllib.request.Request:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(server.url + path, data=data, method=method, headers=headers)

    @contextlib.contextmanager
    def _answer_errors(self, server: Server, path: str):
        """Network and HTTP failures of a request to `server` as VLLMServerError, saying why."""
        try:
            yield
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise VLLMServerError(f"vLLM server {server.url}{path} answered HTTP {e.code}: {detail}") from None
        except http.client.HTTPException as e:  # before OSError: a connection closed without an answer is both
            reason = server.died() or f"its answer is not HTTP ({type(e).__name__}: {e})"
            raise VLLMServerError(f"vLLM server {server.url} failed during {path}: {reason}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = server.died() or f"it did not answer ({e})"
            raise VLLMServerError(f"vLLM server {server.url} is unreachable during {path}: {reason}") from None

    def request(self, server: Server, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        request = self._http_request(server, method, path, body)
        with self._answer_errors(server, path):
            with urllib.request.urlopen(request, timeout=timeout or self.config.health_timeout_s) as response:
                raw = response.read()
        text = raw.decode()
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    def stream(self, server: Server, path: str, body: dict, timeout: float | None = None) -> Iterator[dict]:
        """POST `body` (with "stream": true) and yield the server-sent events' JSON objects as they
        come. Closing the generator early closes the connection, and vLLM then aborts the request."""
        request = self._http_request(server, "POST", path, body)
        with self._answer_errors(server, path):
            with urllib.request.urlopen(request, timeout=timeout or self.config.health_timeout_s) as response:
                for line in response:
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[len(b"data:") :].strip()
                    if data == b"[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event and "choices" not in event:
                        raise VLLMServerError(
                            f"vLLM server {server.url}{path} failed while streaming: {event['error']}"
                        )
                    yield event

    def check_alive(self, server: Server) -> None:
        reason = server.died()
        if reason:
            raise VLLMServerError(reason)
        state, seen = probe_health(server.url, self.config.health_timeout_s)
        if state == "healthy":
            return
        if state == "silent":
            seen += " (rollout.vllm.health_timeout_s)"
        raise VLLMServerError(f"vLLM server {server.url} stopped answering: {server.died() or seen}")

    def wait_all(self, futures: dict) -> list:
        """Results of `futures` (future -> server), checking the servers' health while waiting."""
        pending = set(futures)
        last_check = time.monotonic()
        check_every = min(HEALTH_CHECK_EVERY_S, self.config.health_timeout_s)
        while pending:
            done, pending = concurrent.futures.wait(
                pending, timeout=1.0, return_when=concurrent.futures.FIRST_EXCEPTION
            )
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
            if pending and time.monotonic() - last_check > check_every:
                for server in {futures[f] for f in pending}:
                    self.check_alive(server)
                last_check = time.monotonic()
        return [f.result() for f in futures]

    def __iter__(self):
        return iter(self.servers)

    def __len__(self) -> int:
        return len(self.servers)

    def __getitem__(self, index: int) -> Server:
        return self.servers[index]

    def submit(self, fn, *args) -> concurrent.futures.Future:
        """Run `fn(*args)` on a thread of its own (requests to several servers at once)."""
        return self._requests.submit(fn, *args)

    def on_each(self, fn, *args) -> list:
        """`fn(server, *args)` for every server at once; their results, waited for while the
        servers' health is checked (see wait_all)."""
        return self.wait_all({self.submit(fn, server, *args): server for server in self.servers})

    def health(self) -> list[dict]:
        status = []
        for server in self.servers:
            try:
                self.check_alive(server)
                status.append({"url": server.url, "alive": True})
            except VLLMServerError as e:
                status.append({"url": server.url, "alive": False, "error": str(e)})
        return status

    # ---- archon worker methods ------------------------------------------------------------------
    def rpc(self, server: Server, method: str, *args: str, timeout: float = 600) -> list:
        body = {"method": method, "args": list(args), "kwargs": {"secret": self.worker_secret}}
        try:
            result = self.request(server, "POST", "/collective_rpc", body, timeout=timeout)
        except VLLMServerError as e:
            if "HTTP 404" in str(e):
                raise VLLMServerError(
                    f"vLLM server {server.url} has no /collective_rpc route; start it with VLLM_SERVER_DEV_MODE=1 "
                    f"and --worker-extension-cls {WORKER_EXTENSION} for the collective transport"
                ) from None
            if "HTTP 500" in str(e):  # the route hides the worker's exception; its log has it
                if server.log_path is not None:
                    cause = log_root_cause(server.log_path.read_text(errors="replace")) or "see the server log"
                    why = f"{cause}\nFull server log: {server.log_path.resolve()}"
                else:
                    why = (
                        f"see the server's log; 'archon worker RPC refused' there means the trainer's "
                        f"{WORKER_SECRET_ENV} is not the server's"
                    )
                raise VLLMServerError(
                    f"archon worker method {method} failed on vLLM server {server.url}: {why}"
                ) from None
            raise
        return result["results"] if isinstance(result, dict) else []

    def close(self) -> None:
        """Stop the servers launched here (servers given by URL are left running). Requests still
        in flight fail at once, and nothing waits for them."""
        self._requests.close()
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                try:
                    os.killpg(server.process.pid, signal.SIGTERM)
                    os.killpg(server.process.pid, signal.SIGCONT)  # a stopped server handles the SIGTERM now
                except ProcessLookupError:
                    continue
                try:
                    server.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.process.pid, signal.SIGKILL)
                    server.process.wait()
