"""A stand-in for vLLM's OpenAI server, for tests of how archon waits on, talks to and stops its
servers without starting vLLM: GET /health, GET /v1/models, POST /v1/completions (one token per
sample) and 200 with an empty object for any other POST (adapter loading).

    python tests/fake_vllm_server.py --host 127.0.0.1 --port 8000 [--model NAME]

It takes the arguments of `python -m vllm.entrypoints.openai.api_server` and ignores those it does
not know, so `vllm_package(directory)` can put it where archon's launch finds vLLM's server. With
FAKE_VLLM_STATE=DIR in its environment it writes its pid to DIR/pid once it listens, and with
FAKE_VLLM_HANG_COMPLETIONS=1 it never answers a completion (it touches DIR/completion when one
arrives), as a server busy with a long generation.
"""

from __future__ import annotations

import argparse
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


class FakeVLLMServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        host: str,
        port: int,
        model: str = "fake-model",
        not_ready_probes: int = 0,
        hang_completions: bool = False,
        state_dir: str | None = None,
    ) -> None:
        super().__init__((host, port), FakeVLLMHandler)
        self.model = model
        self.not_ready_probes = not_ready_probes
        """GET /health answers 503 this many times before it answers 200 (a server that loads)."""
        self.hang_completions = hang_completions
        self.state_dir = Path(state_dir) if state_dir else None
        self.health_probes = 0

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"


class FakeVLLMHandler(BaseHTTPRequestHandler):
    server: FakeVLLMServer

    def log_message(self, format, *args) -> None:  # quiet
        pass

    def _reply(self, status: int, body: dict | None = None) -> None:
        data = json.dumps(body if body is not None else {}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/health":
            self.server.health_probes += 1
            self._reply(503 if self.server.health_probes <= self.server.not_ready_probes else 200)
        elif self.path == "/v1/models":
            self._reply(200, {"object": "list", "data": [{"id": self.server.model, "object": "model", "parent": None}]})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        if self.path != "/v1/completions":
            self._reply(200)
            return
        if self.server.hang_completions:
            if self.server.state_dir is not None:
                (self.server.state_dir / "completion").touch()
            threading.Event().wait()
        choices = []
        for p, _ in enumerate(body["prompt"]):
            for s in range(body.get("n", 1)):
                index = p * body.get("n", 1) + s
                choices.append(
                    {
                        "index": index,
                        "token_ids": [1],
                        "logprobs": {"token_logprobs": [-0.5]},
                        "finish_reason": "length",
                    }
                )
        self._reply(200, {"choices": choices})


def vllm_package(directory: Path) -> Path:
    """Write a package `vllm` into `directory` whose vllm.entrypoints.openai.api_server runs this
    server; with `directory` first on PYTHONPATH, archon's launch starts it instead of vLLM."""
    package = directory / "vllm" / "entrypoints" / "openai"
    package.mkdir(parents=True)
    for init in (directory / "vllm", directory / "vllm" / "entrypoints", package):
        (init / "__init__.py").write_text("")
    (package / "api_server.py").write_text(
        f"import runpy\nrunpy.run_path({str(Path(__file__).resolve())!r}, run_name='__main__')\n"
    )
    return directory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="fake-model")
    args, _ = parser.parse_known_args()
    state_dir = os.environ.get("FAKE_VLLM_STATE")
    hang = os.environ.get("FAKE_VLLM_HANG_COMPLETIONS") == "1"
    server = FakeVLLMServer(args.host, args.port, args.model, hang_completions=hang, state_dir=state_dir)
    if state_dir:
        (Path(state_dir) / "pid").write_text(str(os.getpid()))
    server.serve_forever()


if __name__ == "__main__":
    main()
