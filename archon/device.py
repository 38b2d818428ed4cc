"""The one place that knows about device kinds and their collective backends.

cuda -> nccl, npu (Ascend, via torch_npu) -> hccl, cpu -> gloo.
"""

from __future__ import annotations

import functools
import os

import torch

COLLECTIVE_BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}


@functools.cache
def npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401
    except ImportError:
        return False
    return torch.npu.is_available()


def device_type(requested: str = "auto") -> str:
    """Resolve 'auto' (or an explicit kind) to 'cuda', 'npu' or 'cpu', failing clearly if unavailable."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "cuda"
        if npu_available():
            return "npu"
        return "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' requested but torch.cuda.is_available() is False")
    if requested == "npu" and not npu_available():
        raise RuntimeError("device 'npu' requested but torch_npu is not installed or no NPU is visible")
    if requested not in COLLECTIVE_BACKENDS:
        raise ValueError(f"unknown device {requested!r}; expected one of auto, {', '.join(COLLECTIVE_BACKENDS)}")
    return requested


def collective_backend(kind: str) -> str:
    return COLLECTIVE_BACKENDS[device_type(kind)]


def local_device(kind: str = "auto") -> torch.device:
    """The device this process computes on: for accelerators, the one matching LOCAL_RANK."""
    kind = device_type(kind)
    if kind == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(kind, index)


def set_local_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif device.type == "npu":
        torch.npu.set_device(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":
        torch.npu.synchronize(device)


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if npu_available():
        torch.npu.manual_seed_all(seed)
