"""The HTTP side of the Tinker-compatible server: the endpoints the `tinker` SDK calls, API-key
checks, and the futures protocol.

Requests that compute (create_model, forward_backward, optim_step, the checkpoints, asample) are
queued to one worker thread, which runs them in arrival order (the SDK sends a training client's
requests one after another), and answered at once with a request id; the SDK then polls
`retrieve_future`, which waits a few seconds for the result and otherwise answers `try_again`.
A refused request's future fails with category "user" (the SDK raises RequestFailedError with the
message); a refused direct request gets HTTP 400 (BadRequestError), an unknown path 404, a missing
or wrong API key 401.
"""

from __future__ import annotations

import json
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pydantic

from archon.serve.backend import Backend
from archon.serve.config import ServeConfig
from archon.serve.futures import Futures, HTTPError
from archon.serve.handlers import ROUTES, client_config
from archon.serve.wire import PROTO_CONTENT_TYPE, WireError


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: TinkerHTTPServer

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the stdlib's name
        if self.server.verbose:
            super().log_message(format, *args)

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        self._handle("GET")

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        self._handle("POST")

    def _handle(self, method: str) -> None:
        try:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            self._check_key()
            result = self.server.route(method, self.path.split("?", 1)[0], body, self.headers.get("Content-Type", ""))
            if isinstance(result, bytes):
                self._send(200, result, PROTO_CONTENT_TYPE)
            else:
                self._send(200, json.dumps(result).encode(), "application/json")
        except HTTPError as e:
            self._send(e.status, json.dumps({"detail": str(e)}).encode(), "application/json")
        except Exception as e:  # noqa: BLE001 - answer, and keep serving
            traceback.print_exc()
            self._send(500, json.dumps({"detail": f"{type(e).__name__}: {e}"}).encode(), "application/json")

    def _check_key(self) -> None:
        key = self.server.config.api_key
        if key is not None and self.headers.get("X-API-Key") != key:
            raise HTTPError(401, "missing or wrong API key (send it in the X-API-Key header)")

    def _send(self, status: int, payload: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


class TinkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, config: ServeConfig, backend: Backend, verbose: bool = False) -> None:
        self.config = config
        self.backend = backend
        self.futures = Futures()
        self.verbose = verbose
        super().__init__((config.host, config.port), _Handler)

    def server_close(self) -> None:
        super().server_close()
        self.backend.close()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def route(self, method: str, path: str, body: bytes, content_type: str) -> Any:
        if path == "/api/v1/client/config":
            return client_config()
        for (route_method, prefix, exact), handler in ROUTES.items():
            if method == route_method and (path == prefix if exact else path.startswith(prefix)):
                try:
                    return handler(self, path, body, content_type)
                except (pydantic.ValidationError, WireError, json.JSONDecodeError) as e:
                    raise HTTPError(400, f"{path}: {e}") from None
        raise HTTPError(404, f"no endpoint {method} {path}")


def start_server(config: ServeConfig, verbose: bool = False) -> TinkerHTTPServer:
    """Build the base model, bind, and serve in a background thread; returns the server (`.url`,
    `.shutdown()`)."""
    server = TinkerHTTPServer(config, Backend(config), verbose)
    threading.Thread(target=server.serve_forever, name="archon-serve-http", daemon=True).start()
    return server


__all__ = ["HTTPError", "TinkerHTTPServer", "start_server"]
