"""The weight sync: how the trainer's adapter (or weights) reaches the rollout engine, as one
strategy object built from the config (`build_weight_sync`) and owned by the loop.

    sync = build_weight_sync(config.rollout, rollout, lora=config.lora, sync_dir=RUN_DIR / "vllm_adapters")
    metrics = sync.publish(model, converter, lora, version)   # on every trainer rank
    sync.close()

Strategies: in-process (the native engine shares the model: publishing only advances the version
its samples are tagged with), and for vLLM (archon.sync.vllm) disk + adapter, collective + adapter
and collective + merged. A sync gets the trainer's state (model, state-dict converter, LoRA
config), never the trainer; the rollout engine never sees either.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from torch import nn

from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora.config import LoRAConfig
from archon.rollout.base import RolloutEngine
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.policy import ServedPolicy
from archon.rollout.vllm import VLLMRolloutEngine
from archon.rollout.vllm_config import VLLMConfig, merged_needs_collective
from archon.sync.vllm import CollectiveAdapterSync, CollectiveMergedSync, DiskAdapterSync, WorkerChannel


class RolloutSyncConfig(Protocol):
    """What a sync is built from: the two fields of the run's rollout config
    (archon.rl.config.RolloutConfig) that `build_weight_sync` reads."""

    @property
    def engine(self) -> str: ...

    @property
    def vllm(self) -> VLLMConfig: ...


class WeightSync(Protocol):
    def publish(
        self, model: nn.Module, converter: StateDictConverter, lora: LoRAConfig | None, version: int
    ) -> dict[str, float]:
        """Make `version` (the model's current adapter or weights) the one new rollout requests
        use; every trainer rank calls it. Returns metrics: `sync_s`, and on the sending rank what
        went (`adapter_bytes` or `weight_bytes`, ...)."""

    def close(self) -> None:
        """Drop what the sync holds (a process group); the servers stay the rollout engine's."""


class InProcessSync:
    """The native engine generates with the trainer's own model: its weights are current as soon as
    the optimizer steps, so publishing only advances the version."""

    def __init__(self, policy: ServedPolicy) -> None:
        self.policy = policy

    def publish(
        self, model: nn.Module, converter: StateDictConverter, lora: LoRAConfig | None, version: int
    ) -> dict[str, float]:
        start = time.perf_counter()
        self.policy.publish(None, version)
        return {"sync_s": time.perf_counter() - start}

    def close(self) -> None:
        pass


def build_weight_sync(
    config: RolloutSyncConfig,
    rollout: RolloutEngine,
    *,
    lora: LoRAConfig | None,
    sync_dir: str | Path,
    task: str | None = None,
    channel=None,
) -> WeightSync:
    """The sync for `config.engine` and, with vLLM, `config.vllm.transport` and the servers' mode
    (`rollout.mode`: rollout.vllm.mode, or the family's). `sync_dir`: where the disk transport
    writes adapters unless rollout.vllm.sync_dir is set.

    Multi-task runs build one sync per task: `task` names the task (its adapters are served under
    names of their own, side by side with the other tasks'), `rollout` is the task's view of the
    servers (its own policy), and the collective transport's `channel` (a WorkerChannel) is shared
    by the tasks' syncs and closed by the caller. Merged mode serves one set of weights, so it
    cannot serve several tasks: it is refused."""
    if config.engine == "native":
        if not isinstance(rollout, NativeRolloutEngine):
            raise TypeError(f"rollout.engine='native' needs a NativeRolloutEngine, got {type(rollout).__name__}")
        return InProcessSync(rollout.policy)
    if config.engine != "vllm":
        raise ValueError(f"rollout.engine must be 'native' or 'vllm', got {config.engine!r}")
    if not isinstance(rollout, VLLMRolloutEngine):
        raise TypeError(f"rollout.engine='vllm' needs a VLLMRolloutEngine, got {type(rollout).__name__}")
    vllm, mode = config.vllm, rollout.mode
    if task is not None and mode == "merged":
        raise ValueError(
            "rollout.vllm.mode='merged' folds one adapter into the served weights, so one server cannot serve several "
            "tasks' adapters; a multi-task run needs rollout.vllm.mode='adapter' (a family whose vLLM LoRA does not "
            "cover its adapted modules cannot be trained with several tasks on vLLM)"
        )
    if mode == "adapter" and lora is None:
        raise ValueError(
            "rollout.vllm.mode='adapter' sends the LoRA adapter, but lora=None (every weight is trained); "
            "use rollout.vllm.mode='merged' with rollout.vllm.transport='collective'"
        )
    if vllm.transport == "disk":
        if mode == "merged":
            raise ValueError(merged_needs_collective(vllm, lora=lora is not None))
        return DiskAdapterSync(rollout, vllm.sync_dir or sync_dir, task)
    if vllm.transport != "collective":
        raise ValueError(f"rollout.vllm.transport must be 'disk' or 'collective', got {vllm.transport!r}")
    if task is not None:
        return CollectiveAdapterSync(rollout, channel, task, owns_channel=False)
    channel = WorkerChannel(rollout.servers, vllm.sync_host, vllm.sync_port, vllm.bucket_mb)
    if mode == "adapter":
        return CollectiveAdapterSync(rollout, channel)
    return CollectiveMergedSync(rollout, channel)
