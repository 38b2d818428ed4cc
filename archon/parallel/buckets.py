"""Tensors over a broadcast, in size-bounded buckets announced with name/shape/dtype metadata.

Each bucket is three broadcasts: a header [metadata bytes, payload bytes], the JSON metadata, and
the payload (raw bytes). A tensor larger than a bucket is split over several buckets by byte range
and reassembled on arrival. A header of zeros ends the stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import torch

from archon.parallel.process_group import StatelessGroup


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a sync bucket")
    return dtype


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def send_tensors(
    group: StatelessGroup, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> dict[str, int]:
    """Broadcast from rank 0; returns {"bytes", "buckets", "tensors"}."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    device = group.device
    stats = {"bytes": 0, "buckets": 0, "tensors": 0}
    entries: list[list] = []
    chunks: list[torch.Tensor] = []
    filled = 0

    def flush() -> None:
        nonlocal entries, chunks, filled
        if not entries:
            return
        meta = torch.frombuffer(bytearray(json.dumps(entries).encode()), dtype=torch.uint8).to(device)
        payload = torch.cat(chunks).to(device)
        group.broadcast(torch.tensor([meta.numel(), payload.numel()], dtype=torch.int64, device=device))
        group.broadcast(meta)
        group.broadcast(payload)
        stats["buckets"] += 1
        entries, chunks, filled = [], [], 0

    for name, tensor in named_tensors:
        data = _flat_bytes(tensor.cpu() if device.type == "cpu" else tensor)
        total = data.numel()
        stats["tensors"] += 1
        stats["bytes"] += total
        offset = 0
        while offset < total or total == 0:
            take = min(bucket_bytes - filled, total - offset)
            entries.append([name, str(tensor.dtype), list(tensor.shape), total, offset, take, filled])
            chunks.append(data[offset : offset + take])
            filled += take
            offset += take
            if filled >= bucket_bytes:
                flush()
            if total == 0:
                break
    flush()
    group.broadcast(torch.zeros(2, dtype=torch.int64, device=device))
    return stats


def receive_tensors(group: StatelessGroup) -> Iterator[tuple[str, torch.Tensor]]:
    """On ranks other than 0: yields each tensor once all of its bytes have arrived."""
    device = group.device
    partial: dict[str, torch.Tensor] = {}
    while True:
        header = group.broadcast(torch.zeros(2, dtype=torch.int64, device=device))
        meta_len, payload_len = (int(v) for v in header.tolist())
        if meta_len == 0:
            break
        meta = group.broadcast(torch.empty(meta_len, dtype=torch.uint8, device=device))
        payload = group.broadcast(torch.empty(payload_len, dtype=torch.uint8, device=device))
        for name, dtype, shape, total, offset, length, position in json.loads(bytes(meta.cpu().tolist())):
            buffer = partial.get(name)
            if buffer is None:
                buffer = partial[name] = torch.empty(total, dtype=torch.uint8, device=device)
            buffer[offset : offset + length] = payload[position : position + length]
            if offset + length == total:
                del partial[name]
                yield name, buffer.view(_dtype_from_name(dtype)).reshape(shape)
    if partial:
        raise RuntimeError(f"sync stream ended with {len(partial)} tensor(s) incomplete, e.g. {next(iter(partial))!r}")
