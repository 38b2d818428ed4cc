"""Resume checkpoints and PEFT export of a trainer's adapters, which refuse to write NaN or inf.

`AdapterCheckpoints` is a part of `Trainer` (archon.trainer.trainer): it reads the trainer's model,
converter, loaded checkpoint, rank, multi_task and adapters (`_adapter`, `_lora`,
`_same_on_every_rank`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

from archon.checkpoint.resume import lora_settings
from archon.lora import task_view
from archon.lora.peft import save_peft_adapter


class NonFiniteError(RuntimeError):
    """A loss, gradient or trainable tensor is NaN or infinite where only a finite value will do."""


class AdapterCheckpoints:
    """Checkpoint and export methods of `Trainer`."""

    def _view(self, task: str | None):
        """The model as `task`'s single-adapter model (the model itself for one adapter)."""
        return task_view(self.model, task) if self.multi_task else contextlib.nullcontext()

    def _first_non_finite(self, optimizer_state: bool, optimizer) -> str | None:
        """This rank's first trainable parameter (or, with optimizer_state, AdamW state tensor of
        one) that holds NaN or inf, by name; None when all are finite."""
        for name, param in self.model.named_parameters():
            if not param.requires_grad:
                continue
            tensors = [(name, param)]
            if optimizer_state:
                state = optimizer.state.get(param, {})
                tensors += [(f"optimizer state {key!r} of {name}", value) for key, value in state.items()]
            for label, tensor in tensors:
                local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
                if torch.is_tensor(local) and local.is_floating_point() and not bool(torch.isfinite(local).all()):
                    return label
        return None

    @torch.no_grad()
    def check_finite(self, what: str, optimizer_state: bool = True, task: str | None = None) -> None:
        """Raise NonFiniteError on every rank when any rank's trainable parameters (or, with
        optimizer_state, their AdamW state) hold NaN or inf, naming the first such tensor. `what`
        says what was about to be written. With `task`: that task's adapter only."""
        name, adapter = self._adapter(task)
        with self._view(name):
            bad = self._first_non_finite(optimizer_state, adapter.optimizer)
        if not self._same_on_every_rank(bad is not None):
            return
        found = [bad]
        if dist.is_initialized() and dist.get_world_size() > 1:
            found = [None] * dist.get_world_size()
            dist.all_gather_object(found, bad)
        rank, label = next((r, b) for r, b in enumerate(found) if b is not None)
        raise NonFiniteError(
            f"refusing to write the {what}: {label!r} (rank {rank}) holds NaN or inf values; nothing was "
            "written and the earlier checkpoints and adapters are as they were"
        )

    def export_peft(
        self,
        out_dir: str | os.PathLike,
        base_model_name_or_path: str | None = None,
        task: str | None = None,
        model_card: str | None = None,
    ) -> Path:
        """Write the adapter (of `task`, in a multi-task trainer: an adapter that loads alone) in PEFT
        format (gathered from all shards; rank 0 writes), with `model_card` as its README.md when
        given (rank 0's). Refuses (NonFiniteError) an adapter with NaN or inf values."""
        name, _ = self._adapter(task)
        lora = self._lora(name)
        if lora is None:
            raise ValueError("export_peft needs a LoRA model; this trainer trains every parameter")
        self.check_finite(f"PEFT adapter {str(out_dir)!r}", optimizer_state=False, task=task)
        with self._view(name):
            path = save_peft_adapter(
                self.model,
                self.converter,
                lora,
                out_dir,
                base_model_name_or_path or str(self.loaded.path),
                write=self.rank == 0,
                model_card=model_card,
            )
        if dist.is_initialized():
            dist.barrier()
        return path

    def checkpoint_state(self, task: str | None = None) -> dict[str, Any]:
        """The trainable parameters and optimizer state (of `task` alone, under its single-adapter
        names, in a multi-task trainer), as DCP state dicts (sharded where the model is)."""
        name, adapter = self._adapter(task)
        with self._view(name):
            model_state, optim_state = get_state_dict(
                self.model, adapter.optimizer, options=StateDictOptions(ignore_frozen_params=True)
            )
        return {"model": model_state, "optimizer": optim_state}

    def load_checkpoint_state(self, state: dict[str, Any], task: str | None = None) -> None:
        name, adapter = self._adapter(task)
        with self._view(name):
            set_state_dict(
                self.model,
                adapter.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                # Frozen base weights are not in the checkpoint; dcp.load has already failed on any
                # trainable key missing from it.
                options=StateDictOptions(ignore_frozen_params=True, strict=False),
            )

    def save_checkpoint(self, manager, step: int, data_state: dict | None = None, task: str | None = None) -> Path:
        """Save a resume checkpoint for training step `step` (the RL step in the loop; it names the
        checkpoint) through a CheckpointManager. Refuses (NonFiniteError) a state with NaN or inf.
        In a multi-task trainer, `task`'s checkpoint: its adapter, optimizer and schedule alone
        (give each task its own manager, i.e. directory)."""
        name, adapter = self._adapter(task)
        self.check_finite(f"checkpoint for step {step}" + (f" of task {task!r}" if task else ""), task=task)
        trainer_state = {
            "step": step,
            "optimizer_steps": adapter.steps,
            "scheduler": adapter.schedule_state(),
            "data": data_state or {},
            "lora": lora_settings(self._lora(name)),
        }
        return manager.save(step, self.checkpoint_state(task), trainer_state)

    def load_checkpoint(self, manager, path: str | os.PathLike | None = None, task: str | None = None) -> dict | None:
        """Resume from `path` (default: the manager's latest). Returns the whole trainer state
        (`step`, `optimizer_steps`, `scheduler`, `data`, `lora`), or None when there is no checkpoint.
        A checkpoint trained with another LoRA config (rank, alpha, targets, ...) is refused, naming
        the differences; dropout may change. With `task`: that task's checkpoint, into its adapter
        alone (the other tasks are untouched)."""
        path = manager.latest() if path is None else Path(path)
        if path is None:
            return None
        name, adapter = self._adapter(task)
        state = self.checkpoint_state(task)
        trainer_state = manager.load(path, state, expected={"lora": lora_settings(self._lora(name))})
        self.load_checkpoint_state(state, task)
        adapter.steps = trainer_state["optimizer_steps"]
        adapter.load_schedule_state(trainer_state["scheduler"])
        return trainer_state
