"""python -m archon.serve --base-model DIR [--port N] [--host 127.0.0.1] [--api-key K] [--max-lora-rank R]

or, sharded with FSDP2 over N ranks (rank 0 serves): torchrun --nproc-per-node N -m archon.serve ..."""

from __future__ import annotations

import contextlib

import tyro

from archon.precision import fp32_islands_in_fp64
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


def main(argv: list[str] | None = None) -> None:
    config = tyro.cli(ServeConfig, args=argv)
    islands = fp32_islands_in_fp64() if config.dtype == "float64" else contextlib.nullcontext()
    with islands:
        dims, rank = init_ranks(config.device)
        if dims is None:
            serve(config, Backend(config))
            return
        backend = Backend(config, dims, rank, shared_seed(rank))
        if rank != 0:
            follow(backend)
            return
        broadcasting = Broadcasting(backend)
        try:
            serve(config, broadcasting)
        finally:
            broadcasting.stop()


if __name__ == "__main__":
    main()
