"""The adapters a server holds on its one frozen base: each training client's LoRA model (its own
LoRA factors and AdamW, every frozen base tensor shared with the base model), and their checkpoints
on disk (a PEFT adapter, plus the optimizer state as DCP for save_state), named by `tinker://` paths.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from archon.build import LoadedModel, build_model
from archon.checkpoint.atomic import atomic_directory, atomic_write_json
from archon.checkpoint.state_dict_converter import is_lora_param
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import load_peft_adapter, lora_config_from_peft, save_peft_adapter

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "experts")
UNEMBED_TARGETS = ("lm_head",)
OPTIMIZER_DIR = "optimizer"
META_FILE = "tinker_checkpoint.json"
KIND_DIRS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")


class UserError(ValueError):
    """A request the server refuses: it names what is wrong, and the server goes on serving."""


def lora_targets(available: tuple[str, ...], train_attn: bool, train_mlp: bool, train_unembed: bool) -> tuple[str, ...]:
    """The family's LoRA targets (its spec's lora_targets) a Tinker LoraConfig asks for."""
    chosen = []
    for name in available:
        if name in MLP_TARGETS:
            wanted = train_mlp
        elif name in UNEMBED_TARGETS:
            wanted = train_unembed
        else:
            wanted = train_attn
        if wanted:
            chosen.append(name)
    if not chosen:
        raise UserError(
            f"lora_config selects no module of this model (train_attn={train_attn}, train_mlp={train_mlp}, "
            f"train_unembed={train_unembed}); its LoRA targets are {list(available)}"
        )
    return tuple(chosen)


def share_frozen_base(model: nn.Module, base: nn.Module) -> None:
    """Point every frozen (non-LoRA) parameter of `model` at the same tensor of `base`, so that the
    adapters on one base hold one copy of it. Both were built from the same checkpoint."""
    base_modules = dict(base.named_modules())
    for module_name, module in model.named_modules():
        reference = base_modules.get(module_name)
        if reference is None:
            continue
        for name, param in list(module._parameters.items()):
            if param is None or is_lora_param(f"{module_name}.{name}") or name not in reference._parameters:
                continue
            shared = reference._parameters[name]
            if shared is not None and shared.shape == param.shape and shared.dtype == param.dtype:
                module._parameters[name] = shared


@dataclass
class TrainingModel:
    """One training client: its LoRA model on the shared base and its AdamW."""

    model_id: str
    session_id: str
    loaded: LoadedModel
    lora: LoRAConfig
    optimizer: torch.optim.AdamW
    steps: int = 0

    @property
    def model(self) -> nn.Module:
        return self.loaded.model

    def lora_tensors(self) -> dict[str, torch.Tensor]:
        """A copy of the adapter's factors, by archon parameter name."""
        return {name: p.detach().clone() for name, p in lora_parameters(self.model).items()}


def build_adapter_model(
    base: LoadedModel, path: str, lora: LoRAConfig, dtype: torch.dtype, device: str, seed: int, **layout
) -> LoadedModel:
    """A LoRA model of the base checkpoint at `path` whose frozen tensors are the base's. With a
    layout (build_model's dims and parallel) it is sharded, and holds its own shard of the base:
    FSDP2 lays out each model's parameters itself."""
    loaded = build_model(path, lora=lora, dtype=dtype, device=device, seed=seed, **layout)
    if not layout:
        share_frozen_base(loaded.model, base.model)
    return loaded


def new_optimizer(model: nn.Module) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)


# ---- tinker:// paths and checkpoint directories ------------------------------------------------


def checkpoint_name(name: str) -> str:
    if not _NAME.match(name):
        raise UserError(f"checkpoint name {name!r} must be letters, digits, '.', '_' or '-'")
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    """kind: "weights" (save_state) or "sampler_weights" (save_weights_for_sampler)."""
    return f"tinker://{model_id}/{kind}/{name}"


def checkpoint_dir(root: Path, path: str) -> Path:
    """The directory of the checkpoint a `tinker://<model id>/<weights|sampler_weights>/<name>` path names."""
    if not path.startswith("tinker://"):
        raise UserError(f"checkpoint path {path!r} is not a tinker:// path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KIND_DIRS or not parts[0] or not parts[2]:
        raise UserError(f"checkpoint path {path!r} is not tinker://<model id>/<weights|sampler_weights>/<name>")
    directory = root / parts[0] / parts[1] / checkpoint_name(parts[2])
    if not (directory / META_FILE).is_file():
        raise UserError(f"no checkpoint at {path!r} (looked in {str(directory)!r})")
    return directory


def save_checkpoint(
    root: Path,
    trained: TrainingModel,
    kind: str,
    name: str,
    base_name: str,
    with_optimizer: bool,
    overwrite: bool,
    write: bool = True,
) -> str:
    """Write the adapter (and with_optimizer, its AdamW state) atomically; returns its tinker:// path.
    Under FSDP2 every rank calls this and gathers the adapter; only the `write` rank writes. (Every
    rank sees the directory as it was: the writer renames it into place after the gather.)"""
    path = tinker_path(trained.model_id, kind, checkpoint_name(name))
    directory = root / trained.model_id / kind / name
    if directory.exists() and not overwrite:
        raise UserError(f"checkpoint {path!r} exists already; save with overwrite=True to replace it")
    if not write:
        save_peft_adapter(trained.model, trained.loaded.converter, trained.lora, directory, base_name, write=False)
        return path
    with atomic_directory(directory) as tmp:
        save_peft_adapter(trained.model, trained.loaded.converter, trained.lora, tmp / "adapter", base_name)
        if with_optimizer:
            model_state, optim_state = get_state_dict(
                trained.model, trained.optimizer, options=StateDictOptions(ignore_frozen_params=True)
            )
            dcp.save(
                {"model": model_state, "optimizer": optim_state}, checkpoint_id=str(tmp / OPTIMIZER_DIR), no_dist=True
            )
        atomic_write_json(
            tmp / META_FILE,
            {"tinker_path": path, "model_id": trained.model_id, "base_model": base_name, "steps": trained.steps},
        )
    return path


def export_peft(root: Path, path: str, out_dir: Path) -> Path:
    """Copy the PEFT adapter of the checkpoint at `path` (a tinker:// path) to `out_dir`, atomically:
    a directory `peft.PeftModel.from_pretrained(base, out_dir)` loads."""
    source = checkpoint_dir(root, path) / "adapter"
    with atomic_directory(out_dir) as tmp:
        for file in source.iterdir():
            shutil.copy2(file, tmp / file.name)
    return Path(out_dir)


def checkpoint_lora(directory: Path) -> LoRAConfig:
    return lora_config_from_peft(directory / "adapter")


def load_checkpoint(directory: Path, trained: TrainingModel, with_optimizer: bool) -> None:
    """Load the adapter (and with_optimizer, the AdamW state saved with it) into `trained`."""
    try:
        load_peft_adapter(trained.model, trained.loaded.converter, directory / "adapter")
    except (KeyError, ValueError) as e:
        raise UserError(f"checkpoint {str(directory)!r} does not fit model {trained.model_id!r}: {e}") from None
    meta = json.loads((directory / META_FILE).read_text())
    if not with_optimizer:
        return
    if not (directory / OPTIMIZER_DIR).is_dir():
        raise UserError(
            f"checkpoint {meta['tinker_path']!r} holds no optimizer state (save it with save_state, not "
            "save_weights_for_sampler)"
        )
    model_state, optim_state = get_state_dict(
        trained.model, trained.optimizer, options=StateDictOptions(ignore_frozen_params=True)
    )
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(directory / OPTIMIZER_DIR), no_dist=True)
    set_state_dict(
        trained.model,
        trained.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(ignore_frozen_params=True, strict=False),
    )
    trained.steps = int(meta.get("steps", 0))
