"""python -m archon.serve --base-model DIR [--port N] [--host 127.0.0.1] [--api-key K] [--max-lora-rank R]

or, laid out over N ranks (rank 0 serves; FSDP2 unless --parallel.tp / --parallel.ep say otherwise):
torchrun --nproc-per-node N -m archon.serve ... [--parallel.tp 2 | --parallel.ep 2]"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import tyro

from archon.precision import fp32_islands_in_fp64
from archon.secrets import redact_logs, register_secrets
from archon.serve.backend import Backend
from archon.serve.config import ServeConfig
from archon.serve.ranks import Broadcasting, follow, init_ranks, shared_seed
from archon.serve.server import TinkerHTTPServer


def serve(config: ServeConfig, backend) -> None:
    server = TinkerHTTPServer(config, backend)
    print(f"archon.serve: serving {config.base_model} at {server.url} (TINKER_BASE_URL)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def run(config: ServeConfig, serve_on_rank0: Callable[[ServeConfig, object], None] = serve) -> None:
    """Build the Backend on every rank; rank 0 (or the one process) hands it to `serve_on_rank0`, the
    other ranks follow rank 0's calls until it returns."""
    islands = fp32_islands_in_fp64() if config.dtype == "float64" else contextlib.nullcontext()
    with islands:
        dims, rank = init_ranks(config)
        if dims is None:
            serve_on_rank0(config, Backend(config))
            return
        backend = Backend(config, dims, rank, shared_seed(rank))
        if rank != 0:
            follow(backend)
            return
        broadcasting = Broadcasting(backend)
        try:
            serve_on_rank0(config, broadcasting)
        finally:
            broadcasting.stop()


def parse(argv: list[str] | None = None) -> ServeConfig:
    return tyro.cli(ServeConfig, args=argv)


def main(argv: list[str] | None = None) -> None:
    config = parse(argv)
    # the key and the vLLM servers' secrets (archon.secrets) never reach a log line of this process
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    register_secrets(config)
    redact_logs()
    run(config)


if __name__ == "__main__":
    main()
