"""The server under torchrun: every model is laid out over the ranks by the config's `parallel`
section (FSDP2 over every rank by default; tensor parallelism, or expert parallelism for an MoE base),
requests enter on rank 0, and each call that computes or changes state is broadcast (over the default
process group, gloo on CPU) to every rank, which runs the same Backend method on its shard.

    torchrun --nproc-per-node 2 -m archon.serve --base-model DIR --port 8000 [--parallel.tp 2 | --parallel.ep 2]

Rank 0 serves HTTP and wraps its Backend in `Broadcasting`; the other ranks run `follow`, which
receives each call and runs it. Every rank runs the calls in one order (a lock on rank 0 keeps the
HTTP threads' calls from interleaving with the worker's), on one state, so a check that refuses a
request refuses it on every rank, before any collective. Rank 0 draws a seed for each call, which
every rank applies to torch's global generator: unseeded sampling draws the same tokens on every
rank, so the ranks run the same forwards.
"""

from __future__ import annotations

import os
import random
import threading
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from archon import device as devices
from archon.parallel import ParallelConfig, ParallelDims
from archon.serve.adapters import UserError
from archon.serve.config import ServeConfig

BROADCAST_CALLS = frozenset(
    {
        "create_session",
        "end_session",
        "create_model",
        "forward_backward",
        "forward_backward_many",
        "optim_step",
        "save",
        "load",
        "sampler_from_model",
        "create_sampler",
        "sample_many",
        "sample",
    }
)
"""The Backend methods that change state or compute on the model: every rank runs them. The others
(model, sampler, info, check_base_model, ...) read state every rank holds alike, on rank 0 alone."""
STOP = "stop"
IDLE_TIMEOUT = timedelta(days=365)
"""The process group's timeout: the other ranks wait in a broadcast for as long as the server idles."""


def layout_dims(parallel: ParallelConfig, world_size: int, device_type: str) -> ParallelDims:
    """The degrees `parallel` asks for over `world_size` ranks; a layout that does not fit them is
    refused naming the --parallel.* flags."""
    try:
        return parallel.dims(world_size, device_type)
    except ValueError as e:
        degrees = ", ".join(f"{name}={getattr(parallel, name)}" for name in ("dp_replicate", "dp_shard", "tp", "ep"))
        raise ValueError(
            f"--parallel.* asks for {degrees} over {world_size} rank(s): {e} (a layout over N ranks is served "
            "under torchrun --nproc-per-node N)"
        ) from None


def init_ranks(config: ServeConfig) -> tuple[ParallelDims | None, int]:
    """Under torchrun (WORLD_SIZE > 1): start the process group and return (the layout config.parallel
    asks for, this rank); otherwise (None, 0), after checking that config.parallel asks for one rank."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device_type = torch.device(config.device).type
    dims = layout_dims(config.parallel, world_size, device_type)
    if world_size == 1:
        return None, 0
    if not dist.is_initialized():
        dist.init_process_group(backend=devices.collective_backend(device_type), timeout=IDLE_TIMEOUT)
    if device_type != "cpu":
        devices.set_local_device(devices.local_device(device_type))
    return dims, dist.get_rank()


def shared_seed(rank: int) -> int:
    """A seed rank 0 draws and every rank receives (the Backend's id generator)."""
    message = [random.SystemRandom().getrandbits(63) if rank == 0 else None]
    dist.broadcast_object_list(message, src=0)
    return int(message[0])


def _run(backend, name: str, args: tuple, kwargs: dict, seed: int):
    torch.manual_seed(seed)
    return getattr(backend, name)(*args, **kwargs)


class Broadcasting:
    """Rank 0's view of its Backend: a call in BROADCAST_CALLS is sent to every rank, then run here;
    anything else is the Backend's own."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self._lock = threading.Lock()

    def __getattr__(self, name: str):
        value = getattr(self._backend, name)
        if name not in BROADCAST_CALLS:
            return value

        def broadcast_call(*args, **kwargs):
            with self._lock:
                seed = random.SystemRandom().getrandbits(63)
                dist.broadcast_object_list([(name, args, kwargs, seed)], src=0)
                return _run(self._backend, name, args, kwargs, seed)

        return broadcast_call

    def stop(self) -> None:
        """Tell the other ranks to leave `follow`."""
        with self._lock:
            dist.broadcast_object_list([(STOP, (), {}, 0)], src=0)


def follow(backend) -> None:
    """A rank other than 0: run each call rank 0 broadcasts, until it stops. A refusal is rank 0's
    to answer (every rank refuses alike); any other failure is printed."""
    while True:
        message = [None]
        dist.broadcast_object_list(message, src=0)
        name, args, kwargs, seed = message[0]
        if name == STOP:
            return
        try:
            _run(backend, name, args, kwargs, seed)
        except UserError:
            pass
        except Exception:  # noqa: BLE001 - rank 0 answers the request; this rank keeps following
            traceback.print_exc()
