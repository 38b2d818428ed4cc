"""Weight syncs to vLLM servers: disk + adapter, collective + adapter, collective + merged.

Every trainer rank calls `publish(model, converter, lora, version)`: the payload is gathered on all
of them (FSDP/TP shards), rank 0 sends it and registers it on the servers, and every rank's
ServedPolicy (archon.rollout.policy) then names the same adapter and version, so that each rank's
generation uses it. No sync sees the trainer, only its model, state-dict converter and LoRA config.

- disk + adapter: the PEFT adapter is written atomically under `sync_dir` and loaded with
  `/v1/load_lora_adapter` under a new versioned name.
- collective + adapter: the adapter tensors are broadcast in buckets over a stateless group
  (TCPStore + the device's backend) to the workers' extension (archon.rollout.vllm_worker), which
  builds the adapter in memory; the server then registers it under the new name.
- collective + merged: the weights of every module that holds LoRA-adapted weights, with
  W + s*B@A where adapted, in HF names, reloaded into the served base weights; requests then use
  the base model name. Without LoRA (full-parameter training) all weights go. They go in the
  served checkpoint's format: plain, or requantized to its FP8 / MXFP4 format.

Updates during generation (generation may run in another thread), under the update policy
'continue' (rollout.update_policy): requests in flight let go of the replaced version at their next
streamed token and go on under the new one (archon.rollout.vllm), so the replaced adapter is
unloaded within the publish, and a merged publish waits only for that. Under 'finish' (the
default): in adapter mode a request in flight keeps the adapter it started with; a replaced adapter
is unloaded (and its files or tensors dropped) at a later publish, once no request of any trainer
rank holds it. In merged mode a publish holds new requests back, waits for those in flight on every
rank, swaps the weights, and lets the held requests go on the new version once every rank knows the
swap is done. A publish never waits for requests not yet started. A failure on rank 0 is raised on
every rank.
"""

from __future__ import annotations

import json
import shutil
import socket
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from archon.checkpoint.hf import HFCheckpoint
from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.device import collective_backend
from archon.lora.config import LoRAConfig
from archon.lora.peft import peft_adapter_config, save_peft_adapter
from archon.parallel.buckets import send_tensors
from archon.parallel.process_group import StatelessGroup
from archon.quant import QuantizedCheckpoint, quant_format_from_config
from archon.rollout.vllm import VLLMRolloutEngine
from archon.rollout.vllm_launch import WORKER_EXTENSION
from archon.rollout.vllm_network import (
    RequestThreads,
    VLLMServerError,
    address_towards,
    free_port,
    is_local_address,
    is_loopback_host,
)
from archon.rollout.vllm_server import VLLMServers, read_model_config
from archon.rollout.vllm_worker import COLLECTIVE_PATH_PREFIX
from archon.sync.payload import Requantize, adapter_payload, full_payload, merged_payload


def _distributed() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def _model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _share_outcome(error: Exception | None, value=None):
    """How rank 0's part of a publish went (it alone talks to the servers), told to every trainer
    rank so that all go on or all raise at once, none left waiting in a collective. Returns rank 0's
    `value`; raises a rank's own `error`, else, on the other ranks, one saying why rank 0 failed."""
    rank0_failure = None
    if _distributed():
        shared = [value, None if error is None else f"{type(error).__name__}: {error}"]
        dist.broadcast_object_list(shared, src=0)
        value, rank0_failure = shared
    if error is not None:
        raise error
    if rank0_failure is not None:
        raise RuntimeError(f"the weight sync failed on trainer rank 0: {rank0_failure}")
    return value


class WorkerChannel:
    """The stateless group between trainer rank 0 (rank 0 of the group) and every worker of the
    servers, set up on first use; tensors go over it in size-bounded buckets.

    Its calls run on threads of its own (RequestThreads), as the servers' requests do, so that a
    call stuck on a server that stopped answering never keeps the trainer from exiting.

    `host` is where the workers find trainer rank 0 (rollout.vllm.sync_host); None: rank 0's address
    on its route to the first server, found where rank 0 runs, so it holds on whichever machine a
    multi-node launch put rank 0."""

    def __init__(self, servers: VLLMServers, host: str | None, port: int, bucket_mb: float) -> None:
        self.servers = servers
        self.host, self.port, self.bucket_mb = host, port, bucket_mb
        self._group = None
        self._threads = RequestThreads("archon-vllm-sync")

    def _ensure_group(self, device: torch.device):
        if self._group is not None:
            return self._group
        workers = []
        for server in self.servers:
            info = self.servers.rpc(server, "archon_worker_info", timeout=self.servers.config.health_timeout_s)
            if not info or not isinstance(info[0], dict):
                raise VLLMServerError(
                    f"vLLM server {server.url} did not run archon's worker extension; start it with "
                    f"--worker-extension-cls {WORKER_EXTENSION}"
                )
            workers.append(len(info))
        world_size = 1 + sum(workers)
        host = self._reachable_host()
        port = self.port or free_port(host)
        backend = collective_backend(device.type)
        store = StatelessGroup.host_store(host, port, world_size)
        futures, offset = {}, 1
        for server, count in zip(self.servers, workers):
            spec = {"host": host, "port": port, "world_size": world_size, "rank_offset": offset, "backend": backend}
            futures[self._threads.submit(self.servers.rpc, server, "archon_init_sync_group", json.dumps(spec))] = server
            offset += count
        group = StatelessGroup(host, port, 0, world_size, backend, device=device, store=store)
        self.servers.wait_all(futures)
        self._group = group
        return group

    def _reachable_host(self) -> str:
        """The address the workers connect to: `host`, checked to be this machine's (the store is
        hosted here) and, on loopback, to have no server on another machine; or, unset, this
        machine's address on its route to the first server."""
        if self.host is None:
            return address_towards(self.servers[0].url)
        if not is_local_address(self.host):
            raise ValueError(
                f"rollout.vllm.sync_host={self.host!r} is not an address of this machine ({socket.gethostname()}), "
                "where trainer rank 0 runs and hosts the sync group, so the servers' workers would look for it "
                "elsewhere. Leave rollout.vllm.sync_host unset (rank 0 then takes its own address on the route to "
                "the servers; a c10d rendezvous may put rank 0 on any node) or give an address of rank 0's machine"
            )
        if is_loopback_host(self.host):
            remote = [s.url for s in self.servers if not is_local_address(urllib.parse.urlsplit(s.url).hostname)]
            if remote:
                raise ValueError(
                    f"rollout.vllm.sync_host={self.host!r} is a loopback address, which the workers of the vLLM "
                    f"server(s) on another machine ({', '.join(remote)}) cannot reach trainer rank 0 at; leave "
                    "rollout.vllm.sync_host unset or give rank 0's address on the network the servers share"
                )
        return self.host

    def send(self, method: str, spec: dict, named_tensors: Iterable, device: torch.device) -> dict:
        """Start worker method `method` on every server (it receives), send `named_tensors`, and
        fail fast when a worker fails (the group is then dropped: a broadcast that was cut off
        leaves it unusable). Returns {"bytes", "buckets", "tensors"}."""
        group = self._ensure_group(device)
        futures = {self._threads.submit(self.servers.rpc, s, method, json.dumps(spec)): s for s in self.servers}
        sender = self._threads.submit(send_tensors, group, named_tensors, int(self.bucket_mb * 2**20))
        try:
            self.servers.wait_all({**futures, sender: self.servers[0]})
        except BaseException:
            self._group = None
            raise
        return sender.result()

    def send_weights(self, named_tensors: Iterable, device: torch.device | str = "cpu") -> dict:
        """Load HF-named weights into the servers' base weights (a full-weight push)."""
        return self.send("archon_receive_weights", {}, named_tensors, torch.device(device))

    def close(self) -> None:
        self._group = None
        self._threads.close()


class _VLLMSync:
    """What every vLLM sync shares: the rollout engine's servers and policy, versioned adapter
    names, the publish timing, and agreement between trainer ranks."""

    def __init__(self, rollout: VLLMRolloutEngine, task: str | None = None) -> None:
        """`task`: in a multi-task run, the task whose adapter this sync publishes (under names
        of its own; `rollout` is then the task's view of the servers, with the task's policy)."""
        self.servers = rollout.servers
        self.task = task
        self.policy = rollout.policy
        self.rank = rollout.rank
        self.model_name = str(rollout.model)
        self.session = rollout.session
        self.continues = rollout.update_policy == "continue"
        """Requests in flight go on under a new version (rollout.update_policy='continue'): they let
        go of the replaced one at their next streamed chunk."""

    def publish(
        self, model: nn.Module, converter: StateDictConverter, lora: LoRAConfig | None, version: int
    ) -> dict[str, float]:
        """Send the model's adapter (or merged weights) as `version`; every trainer rank calls it.
        Returns what was sent (on rank 0: `*_bytes`, `buckets`, `load_s`) and `sync_s`."""
        start = time.perf_counter()
        metrics = self._publish(model, converter, lora, version)
        return {**metrics, "sync_s": time.perf_counter() - start}

    def _publish(self, model, converter, lora, version) -> dict[str, float]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _AdapterSync(_VLLMSync):
    """Adapter mode: the new version is registered under a new name; old names are unloaded once
    no request holds them."""

    def _publish(self, model, converter, lora, version) -> dict[str, float]:
        if lora is None:
            raise ValueError("adapter sync needs a LoRA model; use rollout.vllm.mode='merged' to send full weights")
        label = self.session if self.task is None else f"{self.session}-{self.task}"
        name = f"archon-{label}-v{version}"
        metrics, error = {}, None
        try:
            metrics = self._send_adapter(model, converter, lora, name)
        except Exception as e:  # noqa: BLE001 - raised on every rank by _share_outcome
            error = e
        name = _share_outcome(error, name)  # the other ranks generate under rank 0's name
        replaced = self.policy.name
        self.policy.publish(name, version)
        if self.continues and replaced != name:  # moments, not a generation: unload it now if we can
            self.policy.wait_released({replaced}, self.servers.config.health_timeout_s)
        self._unload_unused()
        return metrics

    def _unload_unused(self) -> None:
        """Unload the replaced adapters that no request of any trainer rank holds any more."""
        leased = self.policy.leased_names()
        if _distributed():
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, leased)
            leased = set().union(*everyone)
        for name in self.policy.take_unused(leased):
            if self.rank == 0:
                self._unload(name)

    def _register(self, name: str, path: str) -> None:
        body = {"lora_name": name, "lora_path": path}
        self.servers.on_each(self.servers.request, "POST", "/v1/load_lora_adapter", body, 600)

    def _unload(self, name: str) -> None:
        self.servers.on_each(self.servers.request, "POST", "/v1/unload_lora_adapter", {"lora_name": name})

    def _send_adapter(self, model, converter, lora, name: str) -> dict[str, float]:
        raise NotImplementedError


class DiskAdapterSync(_AdapterSync):
    """The PEFT adapter written to `sync_dir/<name>` (which the servers must be able to read)."""

    def __init__(self, rollout: VLLMRolloutEngine, sync_dir: str | Path, task: str | None = None) -> None:
        super().__init__(rollout, task)
        self.sync_dir = Path(sync_dir)

    def _send_adapter(self, model, converter, lora, name: str) -> dict[str, float]:
        path = self.sync_dir / name
        save_peft_adapter(model, converter, lora, path, self.model_name, write=self.rank == 0)
        if self.rank != 0:
            return {}
        written = time.perf_counter()
        self._register(name, str(path.resolve()))
        return {
            "adapter_bytes": float((path / "adapter_model.safetensors").stat().st_size),
            "load_s": time.perf_counter() - written,
        }

    def _unload(self, name: str) -> None:
        super()._unload(name)
        shutil.rmtree(self.sync_dir / name, ignore_errors=True)


class CollectiveAdapterSync(_AdapterSync):
    """The adapter tensors broadcast to the workers, built there in memory."""

    def __init__(
        self, rollout: VLLMRolloutEngine, channel: WorkerChannel, task: str | None = None, owns_channel: bool = True
    ) -> None:
        super().__init__(rollout, task)
        self.channel = channel
        self.owns_channel = owns_channel
        """False where several tasks' syncs share one channel (its owner closes it once)."""

    def _send_adapter(self, model, converter, lora, name: str) -> dict[str, float]:
        tensors = adapter_payload(model, converter)  # gathered on every rank
        if self.rank != 0:
            return {}
        peft_config = peft_adapter_config(model, converter, lora, self.model_name)
        spec = {"name": name, "peft_config": peft_config}
        stats = self.channel.send("archon_receive_adapter", spec, tensors.items(), _model_device(model))
        sent = time.perf_counter()
        self._register(name, COLLECTIVE_PATH_PREFIX + name)
        return {
            "adapter_bytes": float(stats["bytes"]),
            "buckets": float(stats["buckets"]),
            "load_s": time.perf_counter() - sent,
        }

    def _unload(self, name: str) -> None:
        super()._unload(name)
        self.servers.on_each(self.servers.rpc, "archon_remove_adapter", name)

    def close(self) -> None:
        if self.owns_channel:
            self.channel.close()


def served_quantization(model: str) -> Requantize | None:
    """(format, the HF weights it stores so) of the served checkpoint `model` when its config.json
    names a `quantization_config` (archon.quant); None for a plain checkpoint, or a model that is
    not a local directory (a hub name)."""
    model_config = read_model_config(model)
    where = str(Path(model) / "config.json")
    fmt = quant_format_from_config((model_config or {}).get("quantization_config"), where)
    if fmt is None:
        return None
    return fmt, frozenset(QuantizedCheckpoint(HFCheckpoint(model), fmt).quantized)


class CollectiveMergedSync(_VLLMSync):
    """Merged (or, without LoRA, all) weights reloaded into the served base weights; requests then
    use the base model. The swap runs with no request in flight on any trainer rank.

    The weights go in the served checkpoint's format: dequantized (the trainer's build dtype) to a
    server of a plain checkpoint, whatever the trainer's base; requantized to the format of a
    served FP8 / MXFP4 checkpoint, whose quantized layers vLLM's in-place reload fills from
    checkpoint tensors (data and scale) as it loads them from disk (`served_quantization`)."""

    def __init__(self, rollout: VLLMRolloutEngine, channel: WorkerChannel) -> None:
        super().__init__(rollout)
        self.channel = channel
        self.requantize = served_quantization(self.model_name) if self.rank == 0 else None
        """Rank 0's (format, HF weights) of the served checkpoint; None: send plain weights."""

    def _publish(self, model, converter, lora, version) -> dict[str, float]:
        payload = merged_payload if lora is not None else full_payload
        metrics, error = {}, None
        # every rank holds its requests back until rank 0's send has returned and all know how it went
        with self.policy.exclusive():
            if _distributed():  # every rank's requests in flight have ended
                dist.barrier()
            weights = payload(model, converter, self.requantize)  # gathered on every rank; only rank 0 quantizes
            try:
                if self.rank == 0:
                    stats = self.channel.send("archon_receive_weights", {}, weights, _model_device(model))
                    metrics = {"weight_bytes": float(stats["bytes"]), "buckets": float(stats["buckets"])}
            except Exception as e:  # noqa: BLE001 - raised on every rank by _share_outcome
                error = e
            if _distributed():  # the other ranks' gathers; on rank 0, those a failed send left
                for _ in weights:
                    pass
            _share_outcome(error)
            self.policy.publish(None, version)
        return metrics

    def close(self) -> None:
        self.channel.close()
