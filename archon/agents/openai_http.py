"""The HTTP side of the chat-completions endpoint (archon.agents.openai_server): routes, JSON in
and out, and each refused request's status and OpenAI-style error body."""

from __future__ import annotations

import http.server
import json
import logging
import re
import urllib.parse

from archon.agents.openai_protocol import OpenAIError

logger = logging.getLogger("archon.agents.openai_server")  # the endpoint's one logger

ROUTE = re.compile(r"^(?:/sessions/(?P<session>[^/]+))?/v1/(?P<endpoint>models|chat/completions)$")


def handler_class(server):
    """The request handler class of `server` (a ChatCompletionsServer: its `session`, `models` and
    `chat` answer the routes)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args) -> None:
            logger.debug("%s " + format, self.address_string(), *args)

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, method: str) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
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
                    self._answer(200, server.models())
                    return
                if method != "POST":
                    raise OpenAIError(405, f"chat/completions takes POST, not {method}")
                try:
                    body = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise OpenAIError(400, f"the request body is not valid JSON ({e})") from None
                self._answer(200, server.chat(body, session_id))
            except OpenAIError as e:
                self._answer(e.status, e.body())
            except Exception as e:
                logger.exception("chat-completions request %s failed", self.path)
                self._answer(500, OpenAIError(500, f"{type(e).__name__}: {e}", kind="server_error").body())

        def do_GET(self) -> None:
            self._route("GET")

        def do_POST(self) -> None:
            self._route("POST")

    return Handler
