"""The HTTP side of the chat-completions endpoint (archon.agents.openai_server): the listening
server, routes, the bearer token, the bounds on a request's head and body, JSON in and out, and
each refused request's status and OpenAI-style error body.

A request is checked in the order that reads least of it: the token (401), then Content-Length
(411, 400, 413), then the body itself, read within `idle_timeout_s` (408) and decoded with its
nesting bounded (400). A request refused before its body is read is answered, then what the
client still sends is read and dropped for a moment before the connection closes, so that the
client reads the answer instead of a reset.
"""

from __future__ import annotations

import hmac
import http.server
import json
import logging
import re
import resource
import socket
import threading
import time
import urllib.parse

from archon.agents.openai_protocol import OpenAIError, decode_body

logger = logging.getLogger("archon.agents.openai_server")  # the endpoint's one logger

ROUTE = re.compile(r"^(?:/sessions/(?P<session>[^/]+))?/v1/(?P<endpoint>models|chat/completions)$")
LISTEN_BACKLOG = 1024
"""Connections the kernel queues before they are accepted (socketserver's default of 5 reset most
of a crowd of clients that connect at once)."""
DISCARD_BYTES, DISCARD_S = 64 * 2**20, 2.0
"""The most a refused request's unread body is read and dropped, in bytes and seconds."""
MAX_CONNECTIONS = 1024


def default_max_connections() -> int:
    """MAX_CONNECTIONS, or a quarter of this process's open-file limit when that is less: a crowd
    of connections must not take the descriptors the trainer needs for its own files."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(1, min(MAX_CONNECTIONS, soft // 4))


class HTTPServer(http.server.ThreadingHTTPServer):
    """A thread per connection, at most `max_connections` at once: a connection past them waits in
    the listen backlog until one closes (an idle one closes after the handler's timeout)."""

    request_queue_size = LISTEN_BACKLOG
    daemon_threads = True

    def __init__(self, address, handler, max_connections: int) -> None:
        self._slots = threading.BoundedSemaphore(max_connections)
        self.closing = threading.Event()
        """Set before `shutdown`: a connection waiting for a slot is closed instead."""
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        while not self._slots.acquire(timeout=0.1):
            if self.closing.is_set():
                self.shutdown_request(request)
                return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: it would have freed the slot
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


def body_length(headers, method: str, max_body_bytes: int) -> int:
    """The body's size from the request's Content-Length; 411, 400 or 413 naming what is wrong."""
    if headers.get("Transfer-Encoding") is not None:
        raise OpenAIError(
            411,
            "a body sent with Transfer-Encoding is not read: send it with a Content-Length header",
            "Content-Length",
        )
    values = headers.get_all("Content-Length") or []
    if not values:
        if method == "POST":
            raise OpenAIError(411, "a POST needs a Content-Length header (the body's size in bytes)", "Content-Length")
        return 0
    if len(values) > 1:
        raise OpenAIError(400, f"the request has {len(values)} Content-Length headers; send one", "Content-Length")
    value = values[0].strip()
    if not (value.isascii() and value.isdigit()):
        raise OpenAIError(
            400, f"Content-Length must be the body's size in bytes (digits only), got {value[:40]!r}", "Content-Length"
        )
    digits = value.lstrip("0") or "0"  # compared by length first: int() of a huge string is slow
    if len(digits) > len(str(max_body_bytes)) or int(digits) > max_body_bytes:
        raise OpenAIError(
            413,
            f"the request body is {value[:40]} bytes (Content-Length), more than this endpoint takes "
            f"(max_body_bytes={max_body_bytes})",
            "max_body_bytes",
        )
    return int(digits)


def unauthorized() -> OpenAIError:
    return OpenAIError(
        401,
        "this endpoint needs the run's token as 'Authorization: Bearer <token>': agent code finds it in its "
        "environment as OPENAI_API_KEY, which openai.OpenAI() reads when given no api_key",
        code="invalid_api_key",
        headers=(("WWW-Authenticate", "Bearer"),),
    )


class EndpointHandler(http.server.BaseHTTPRequestHandler):
    """A connection's requests to `endpoint` (a ChatCompletionsServer: its `session`, `models` and
    `chat` answer the routes; its `api_key` and bounds guard them). `timeout`: the seconds a
    connection may wait for the client (a request's head or body, the next request)."""

    protocol_version = "HTTP/1.1"
    endpoint = None

    def log_message(self, format, *args) -> None:
        logger.debug("%s " + format, self.address_string(), *args)

    def _answer(self, status: int, body: dict, headers=()) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for name, value in headers:
                self.send_header(name, value)
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except OSError as e:  # the client is gone
            logger.debug("chat-completions answer %s to %s not sent: %s", status, self.path, e)
            self.close_connection = True

    def _discard_unread(self) -> None:
        """Read and drop what the client still sends of a body that was not read (for at most
        DISCARD_BYTES, DISCARD_S), so that closing does not reset the connection under the answer."""
        deadline, left = time.monotonic() + DISCARD_S, DISCARD_BYTES
        try:
            self.connection.shutdown(socket.SHUT_WR)
            while left > 0 and (wait := deadline - time.monotonic()) > 0:
                self.connection.settimeout(wait)
                chunk = self.rfile.read1(min(65536, left))
                if not chunk:
                    return
                left -= len(chunk)
        except OSError:  # the client closed, or the time is up
            return

    def _read_body(self, method: str) -> bytes:
        """The body of a request that carries the token, within the endpoint's bounds."""
        scheme, _, given = self.headers.get("Authorization", "").strip().partition(" ")
        token = self.endpoint.api_key.encode()
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(errors="replace"), token):
            raise unauthorized()
        length = body_length(self.headers, method, self.endpoint.max_body_bytes)
        try:
            raw = self.rfile.read(length) if length else b""
        except TimeoutError:
            raise OpenAIError(
                408,
                f"the request body did not arrive within idle_timeout_s={self.endpoint.idle_timeout_s} s "
                f"(Content-Length {length})",
                "Content-Length",
            ) from None
        if len(raw) < length:
            raise OpenAIError(400, f"the body ended after {len(raw)} of its {length} bytes", "Content-Length")
        self.body_read = True
        return raw

    def _serve(self, method: str, raw: bytes) -> dict:
        server = self.endpoint
        match = ROUTE.match(urllib.parse.urlsplit(self.path).path)
        if match is None:
            raise OpenAIError(
                404,
                f"no route {method} {self.path}: this endpoint serves /v1/models and /v1/chat/completions, "
                "also under /sessions/<id>",
            )
        session_id = match["session"] and urllib.parse.unquote(match["session"])
        if match["endpoint"] == "models":
            if method != "GET":
                raise OpenAIError(405, f"{match['endpoint']} takes GET, not {method}")
            if session_id is not None:
                server.session(session_id)
            return server.models()
        if method != "POST":
            raise OpenAIError(405, f"chat/completions takes POST, not {method}")
        return server.chat(decode_body(raw, server.max_json_depth), session_id)

    def _route(self, method: str) -> None:
        self.body_read = False
        try:
            self._answer(200, self._serve(method, self._read_body(method)))
        except OpenAIError as e:
            if not self.body_read:
                self.close_connection = True
            self._answer(e.status, e.body(), e.headers)
            if not self.body_read:
                self._discard_unread()
        except Exception as e:
            logger.exception("chat-completions request %s failed", self.path)
            self._answer(500, OpenAIError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")


def handler_class(server) -> type[EndpointHandler]:
    """The request handler class of `server` (a ChatCompletionsServer)."""
    return type("Handler", (EndpointHandler,), {"endpoint": server, "timeout": server.idle_timeout_s})
