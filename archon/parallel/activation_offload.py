"""Activation offload: the tensors autograd saves inside each transformer block wait in host memory.

During a block's forward, every saved tensor on the compute device that is at least
OFFLOAD_MIN_BYTES and is not a parameter (nor a view of one: FSDP2's gathered weights and the LoRA
factors stay where they are) is copied to pinned host memory, and the device tensor is released
once the copy has finished. In the backward, the first use of block i's saved tensors brings back
block i's (if not there yet) and starts bringing back block i-1's, so that copy overlaps block i's
backward. On CUDA the copies run on a side stream ordered against the compute stream by events;
on other accelerators they are plain synchronous copies.

It wraps the block's forward outside activation checkpointing: with full or selective
checkpointing what autograd saves for a block is its inputs (torch's checkpoint saves them as saved
tensors), and those are offloaded; the tensors saved while a block is recomputed in the backward
are checkpointing's own and stay on the device.

`ActivationOffload(offload=False)` only counts what the hooks see, so a run without offload can be
measured the same way; `offload_host_tensors=True` treats CPU tensors as device tensors (copies
into fresh host buffers, originals dropped), so the bookkeeping runs and can be measured on a CPU.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

OFFLOAD_MIN_BYTES = 1 << 20
"""Saved tensors smaller than this stay on the device: their copies would cost more in launches than
they free."""


@dataclass
class OffloadStats:
    """Counts since the last `ActivationOffload.reset_stats()`."""

    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    resident_bytes: int = 0
    """Bytes of saved activations on the compute device now (each saved tensor once)."""
    peak_resident_bytes: int = 0
    """The most `resident_bytes` reached: what saved activations held on the device at their peak."""


class _BlockSaved:
    """What one forward of one block saved: its offloaded records, and the block that ran before it
    (whose records the backward brings back while this block's backward runs)."""

    def __init__(self, previous: _BlockSaved | None) -> None:
        self.offloaded: list[weakref.ref[_Saved]] = []
        """Weak: a record lives as long as autograd holds it, and keeps its block alive."""
        self.previous = weakref.ref(previous) if previous is not None else None
        self.prefetched = False


class _Saved:
    """One saved activation as the pack hook stored it.

    device_tensor: the tensor on the compute device, detached (None once offloaded and released, or
        after every use was unpacked); host: its host copy (offloaded records only); event: the
        CUDA event recorded after the copy that last wrote device_tensor or host.
    """

    __slots__ = (
        "group",
        "stats",
        "source",
        "version",
        "device",
        "device_tensor",
        "host",
        "event",
        "nbytes",
        "uses",
        "unpacked",
        "resident",
        "__weakref__",
    )

    def __init__(self, group: _BlockSaved, stats: OffloadStats, tensor: torch.Tensor) -> None:
        self.group = group
        self.stats = stats
        self.source = weakref.ref(tensor)
        self.version = tensor._version
        self.device = tensor.device
        self.device_tensor: torch.Tensor | None = tensor.detach()
        self.host: torch.Tensor | None = None
        self.event: torch.cuda.Event | None = None
        self.nbytes = tensor.numel() * tensor.element_size()
        self.uses = 0
        self.unpacked = 0
        self.resident = False
        self.set_resident(True)

    def set_resident(self, resident: bool) -> None:
        """Count the bytes in the stats' resident total while the record holds a compute-device tensor
        that autograd has not been given back yet."""
        if resident == self.resident:
            return
        self.resident = resident
        if resident:
            self.stats.resident_bytes += self.nbytes
            self.stats.peak_resident_bytes = max(self.stats.peak_resident_bytes, self.stats.resident_bytes)
        else:
            self.stats.resident_bytes -= self.nbytes

    def __del__(self) -> None:
        # autograd frees the saved tensors of nodes the backward never ran (outputs the loss ignores)
        self.set_resident(False)


def _is_parameter(t: torch.Tensor) -> bool:
    return isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)


class ActivationOffload:
    """Saved-tensor hooks that keep each block's saved activations in host memory between its forward
    and its backward (see the module docstring); one object serves every block of a model.

    offload: False only counts what would be offloaded (stats), moving nothing.
    offload_host_tensors: also offload tensors already on the CPU, into fresh host buffers (a CPU run
        measuring the bookkeeping; it frees no device memory).
    min_bytes: saved tensors smaller than this stay where they are.
    """

    def __init__(
        self, *, offload: bool = True, offload_host_tensors: bool = False, min_bytes: int = OFFLOAD_MIN_BYTES
    ) -> None:
        self.offload = offload
        self.offload_host_tensors = offload_host_tensors
        self.min_bytes = min_bytes
        self.stats = OffloadStats()
        self._last_block: weakref.ref[_BlockSaved] | None = None
        self._current: _BlockSaved | None = None
        self._saved_by_id: weakref.WeakValueDictionary[int, _Saved] = weakref.WeakValueDictionary()
        """Live records by the id() of the tensor saved: a tensor saved by several ops (a linear's input
        under q, k and v; the rotary tables every block reads) is copied once."""
        self._copying: list[_Saved] = []
        """Offloaded records whose device tensor is held until their copy to host has finished."""
        self._side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def reset_stats(self) -> None:
        """Start counting again (between steps); the resident bytes carry over as the new peak's floor."""
        stats = self.stats
        stats.tensors_offloaded = stats.bytes_offloaded = 0
        stats.peak_resident_bytes = stats.resident_bytes

    # ---- the block forward ---------------------------------------------------------------------
    def wrap(self, module: nn.Module) -> nn.Module:
        """Make `module`'s forward run under the hooks; its parameters keep their names."""
        forward = module.forward

        @functools.wraps(forward)
        def offloaded_forward(*args, **kwargs):
            previous = self._last_block() if self._last_block is not None else None
            group = _BlockSaved(previous)
            self._current = group
            try:
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    return forward(*args, **kwargs)
            finally:
                self._current = None
                self._last_block = weakref.ref(group)
                self._release_copied()

        module.forward = offloaded_forward
        return module

    def _on_compute_device(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.offload_host_tensors

    def _pack(self, tensor: torch.Tensor):
        group = self._current
        if (
            group is None
            or type(tensor) is not torch.Tensor  # tensor subclasses (DTensor) keep their own layout
            or not self._on_compute_device(tensor)
            or _is_parameter(tensor)
        ):
            return tensor
        record = self._saved_by_id.get(id(tensor))
        if record is None or record.source() is not tensor or record.version != tensor._version:
            record = _Saved(group, self.stats, tensor)
            self._saved_by_id[id(tensor)] = record
            if self.offload and record.nbytes >= self.min_bytes:
                self._to_host(record)
                group.offloaded.append(weakref.ref(record))
                self.stats.tensors_offloaded += 1
                self.stats.bytes_offloaded += record.nbytes
        elif record.group is not group:
            # Saved again by a later block: it comes back with that block, the first the backward reaches,
            # and stays until its last use.
            record.group = group
            if record.host is not None:
                group.offloaded.append(weakref.ref(record))
        record.uses += 1
        return record

    def _to_host(self, record: _Saved) -> None:
        t = record.device_tensor
        if t.device.type == "cuda":
            record.host = torch.empty_like(t, device="cpu", pin_memory=True)
            record.event = self._copy_on_side_stream(record.host, t, t.device)
            # The device tensor may be freed (and its memory reused by the compute stream) only once
            # the side stream has read it.
            self._copying.append(record)
            self._release_copied()
            return
        record.host = torch.empty_like(t, device="cpu")
        record.host.copy_(t)
        self._drop_device_tensor(record)

    def _release_copied(self) -> None:
        """Let go of the device tensors whose copy to host has finished."""
        still_copying = []
        for record in self._copying:
            if record.event.query():
                self._drop_device_tensor(record)
            else:
                still_copying.append(record)
        self._copying = still_copying

    def _drop_device_tensor(self, record: _Saved) -> None:
        record.device_tensor = None
        record.set_resident(False)

    # ---- the backward --------------------------------------------------------------------------
    def _unpack(self, packed):
        if not isinstance(packed, _Saved):
            return packed
        record = packed
        group = record.group
        if not group.prefetched:
            self._bring_back(group)
        previous = group.previous() if group.previous is not None else None
        if previous is not None and not previous.prefetched:
            self._bring_back(previous)
        if record.device_tensor is None:  # a second backward over the same graph (retain_graph)
            self._bring_back_record(record)
        tensor = record.device_tensor
        if record.event is not None and tensor.device.type == "cuda":
            torch.cuda.current_stream(tensor.device).wait_event(record.event)
        record.unpacked += 1
        if record.unpacked >= record.uses:
            # The last use: autograd holds the tensor it was given until that node's backward has run.
            # An offloaded record lets its device copy go (a second backward brings it back again); a
            # kept one is freed with the graph.
            record.unpacked = 0
            if record.host is not None:
                record.device_tensor = None
            record.set_resident(False)
        return tensor

    def _bring_back(self, group: _BlockSaved) -> None:
        group.prefetched = True
        for record_ref in group.offloaded:
            record = record_ref()
            if record is not None and record.device_tensor is None:
                self._bring_back_record(record)

    def _bring_back_record(self, record: _Saved) -> None:
        host = record.host
        # Allocated on the compute stream, which uses it; on CUDA written by the side stream once the
        # compute stream is past any earlier use of that memory.
        tensor = torch.empty_like(host, device=record.device)
        if record.device.type == "cuda":
            record.event = self._copy_on_side_stream(tensor, host, record.device)
        else:
            tensor.copy_(host)
        record.device_tensor = tensor
        record.set_resident(True)

    # ---- bookkeeping ---------------------------------------------------------------------------
    def _copy_on_side_stream(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> torch.cuda.Event:
        """dst.copy_(src) on the device's side stream, after the work queued so far on the compute
        stream; returns the event recorded after the copy."""
        side = self._side_stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        return event

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._side_streams:
            self._side_streams[device] = torch.cuda.Stream(device)
        return self._side_streams[device]


def check_activation_offload(device_type: str, compile: bool) -> None:
    """Refuse `parallel.activation_offload=True` where it cannot help or cannot run."""
    if device_type == "cpu":
        raise ValueError(
            "parallel.activation_offload=True on a CPU device: activations already live in host memory, "
            "so there is no device memory to free; leave it off"
        )
    if compile:
        raise ValueError(
            "parallel.activation_offload=True with parallel.compile=True: the offload hooks are Python code run "
            "on every tensor a block saves, and compiled blocks are not run under them; use one or the other"
        )


def apply_activation_offload(
    blocks: Iterable[nn.Module],
    *,
    offload: bool = True,
    offload_host_tensors: bool = False,
    min_bytes: int = OFFLOAD_MIN_BYTES,
) -> ActivationOffload:
    """Wrap each block's forward (after activation checkpointing) in one ActivationOffload's hooks;
    the arguments are ActivationOffload's."""
    activation_offload = ActivationOffload(
        offload=offload, offload_host_tensors=offload_host_tensors, min_bytes=min_bytes
    )
    for block in blocks:
        activation_offload.wrap(block)
    return activation_offload
