"""python -m archon.serve --base-model DIR [--port N] [--host 127.0.0.1] [--api-key K] [--max-lora-rank R]"""

from __future__ import annotations

import tyro

from archon.serve.backend import Backend
from archon.serve.config import ServeConfig
from archon.serve.server import TinkerHTTPServer


def main(argv: list[str] | None = None) -> None:
    config = tyro.cli(ServeConfig, args=argv)
    server = TinkerHTTPServer(config, Backend(config))
    print(f"archon.serve: serving {config.base_model} at {server.url} (TINKER_BASE_URL)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
