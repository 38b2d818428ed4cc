"""Building a model: the model is created on the meta device with LoRA in place (a model whose
parameters cannot fit in its device's memory, or a LoRA rank above every adapted module's
min(in, out), is refused there, naming the config field), parallelized
by its family's parallelize function (TP -> activation checkpointing -> compile -> FSDP2),
materialised with `to_empty`, filled from the HF checkpoint (each rank reads only the slices it
holds), and its LoRA factors are initialised (A kaiming-uniform, B zeros) from a seeded generator,
so every layout starts from the same adapter.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from archon.checkpoint.hf import HFCheckpoint, check_model_dir, copy_local_into, local_region
from archon.checkpoint.hf_weights import load_hf_weights
from archon.checkpoint.state_dict_converter import StateDictConverter
from archon.lora import (
    LoRAConfig,
    configure_lora_modules,
    configure_task_adapters,
    init_lora_factors,
    is_lora_param,
    lora_parameters,
    lora_rank_problem,
    mark_only_lora_trainable,
    task_view,
    union_lora_config,
)
from archon.lora.peft import peft_adapter_config
from archon.parallel import ParallelConfig, ParallelDims
from archon.quant import QuantFormat, QuantizedCheckpoint, quant_format_from_config, quantize_base_weights
from archon.quant.formats import quant_format_of_config_file
from archon.spec import ModelSpec, get_spec

__all__ = ["LoadedModel", "build_model", "init_lora_weights", "load_hf_config"]


# ---- the model, its config, its MTP layers ----------------------------------------------------


@dataclass
class LoadedModel:
    model: nn.Module
    spec: ModelSpec
    args: Any
    converter: StateDictConverter
    hf_config: Any
    path: Path
    lora: LoRAConfig | None
    dims: ParallelDims | None = None
    quant_format: QuantFormat | None = None
    """The checkpoint's low-precision format (None for a plain checkpoint)."""
    quantized_hf_keys: frozenset[str] = frozenset()
    """The HF weights the checkpoint stores in `quant_format` (what a requantized export writes so)."""


def load_hf_config(path: str | os.PathLike, option: str | None = None):
    """The HF config of the model directory `path`; `option` names the setting the path came from."""
    from transformers import AutoConfig

    path = Path(path)
    check_model_dir(path, option)
    quant_format_of_config_file(path / "config.json")  # before transformers, which fails unnamed on a bad one
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{str(path / 'config.json')!r} is not a usable HF model config: {e}") from e


def supports_mtp(spec: ModelSpec) -> bool:
    """Whether the family builds multi-token-prediction layers (its model has `mtp_logits`)."""
    return callable(getattr(spec.model_cls, "mtp_logits", None))


def checkpoint_mtp_layers(spec: ModelSpec, args) -> int:
    """How many multi-token-prediction layers archon can build from a checkpoint with these args
    (0 for a family without MTP support or a checkpoint without them)."""
    return args.checkpoint_mtp_layers if supports_mtp(spec) else 0


def with_mtp_layers(spec: ModelSpec, args, config_path: Path):
    """`args` that build every MTP layer of the checkpoint; refused, naming why, where there are none."""
    if not supports_mtp(spec):
        raise ValueError(f"model family {spec.name!r} has no multi-token-prediction (MTP) layers archon can build")
    if args.checkpoint_mtp_layers <= 0:
        raise ValueError(
            f"{config_path} declares no multi-token-prediction layers ({args.mtp_config_field} is 0 or absent), "
            "so the checkpoint has none to load"
        )
    return dataclasses.replace(args, num_mtp_layers=args.checkpoint_mtp_layers)


def resolve_mtp(path: str | os.PathLike | None, setting: str, used: bool) -> bool:
    """Whether a run builds the MTP layers of the checkpoint at `path` (None: the demo's, which has
    none): `setting` "load" or "skip" (model.mtp), or "auto": when the checkpoint has them and the
    run uses them (`used`)."""
    if setting not in ("auto", "load", "skip"):
        raise ValueError(f"model.mtp={setting!r}; expected 'auto', 'load' or 'skip'")
    if setting != "auto" or path is None:
        return setting == "load"
    if not used:
        return False
    hf_config = load_hf_config(path, "model.path")
    spec = get_spec(hf_config.model_type)
    return checkpoint_mtp_layers(spec, spec.args_cls.from_hf_config(hf_config)) > 0


def _configure_lora(
    model: nn.Module, lora: LoRAConfig | None, task_loras: dict[str, LoRAConfig] | None, converter
) -> None:
    """Give the meta model's LoRA modules their ranks: one adapter (`lora`) or one per task."""
    if task_loras is not None:
        configure_task_adapters(model, task_loras, converter.hf_name)
    elif lora is not None:
        configure_lora_modules(model, lora, converter.hf_name)


def _keep_quantized(model: nn.Module, converter, checkpoint: QuantizedCheckpoint, dtype: torch.dtype) -> None:
    """Store every base weight of the meta `model` whose checkpoint tensors are quantized in their
    format (archon.quant.quantize_base_weights)."""
    hf_keys = checkpoint.keys()
    keys = {}
    for key in (k for k, _ in model.named_parameters() if not is_lora_param(k)):
        sources = converter.hf_sources(key, hf_keys)
        quantized = [s for s in sources if s in checkpoint.quantized]
        if quantized:
            keys[key] = checkpoint.fmt
    quantize_base_weights(model, keys, dtype)


# ---- size ------------------------------------------------------------------------------------

PROBE_LAYERS = 8
"""A model deeper than this is first estimated from a meta-device copy with only its first
PROBE_LAYERS decoder layers: each layer costs about a millisecond to build even on the meta device,
so an absurd layer count (a mistyped config) would take many minutes before the size is known."""


@dataclass
class ParameterBytes:
    """Bytes of a model's parameters (base weights in the build dtype, LoRA factors in fp32):
    outside the decoder layers and in each decoder layer built, with the LoRA share of each."""

    outside_layers: int
    outside_layers_lora: int
    layers: list[int]
    layers_lora: list[int]

    def for_layers(self, num_layers: int) -> tuple[int, int]:
        """(all bytes, LoRA bytes) of the model with `num_layers` decoder layers; layers beyond those
        built are taken to be of the built layers' mean size."""

        def extend(sizes: list[int]) -> int:
            return sum(sizes) + (num_layers - len(sizes)) * sum(sizes) // max(1, len(sizes))

        return self.outside_layers + extend(self.layers), self.outside_layers_lora + extend(self.layers_lora)


def parameter_bytes(model: nn.Module, dtype: torch.dtype) -> ParameterBytes:
    """The parameter bytes of a (meta-device) model whose decoder layers are `model.layers`."""
    base_size = torch.empty((), dtype=dtype).element_size()
    layer_of = {id(p): i for i, layer in enumerate(model.layers) for p in layer.parameters()}
    sizes = ParameterBytes(0, 0, [0] * len(model.layers), [0] * len(model.layers))
    for name, param in model.named_parameters():
        lora = is_lora_param(name)
        # LoRA factors are kept in fp32; quantized storage (uint8 / int32) keeps its own width
        nbytes = param.numel() * (4 if lora else base_size if param.is_floating_point() else param.element_size())
        layer = layer_of.get(id(param))
        if layer is None:
            sizes.outside_layers += nbytes
            sizes.outside_layers_lora += nbytes if lora else 0
        else:
            sizes.layers[layer] += nbytes
            sizes.layers_lora[layer] += nbytes if lora else 0
    return sizes


def _with_layers(args, num_layers: int):
    """`args` with only its first `num_layers` decoder layers (per-layer lists cut to match)."""
    changes: dict[str, Any] = {"num_hidden_layers": num_layers}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, list) and len(value) == args.num_hidden_layers:
            changes[f.name] = value[:num_layers]
    return dataclasses.replace(args, **changes)


def memory_for_parameters(device: torch.device | str) -> tuple[int, str] | None:
    """(bytes, what they are) that `device` has free for a model's parameters; None where unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device}"
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "of available memory (MemAvailable in /proc/meminfo)"
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "of available physical memory"
    except (ValueError, OSError):
        return None


def _gib(nbytes: int | float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB"


# Config fields that set the size of one decoder layer (those the family's args have).
_LAYER_WIDTH_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "n_routed_experts",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
)


@dataclass
class SizeCheck:
    """Refuses a model whose parameters cannot fit in the memory of its device, naming the config
    field responsible. Under FSDP/TP a process holds about 1/(dp_shard*tp) of them, and the processes
    of one host share its RAM."""

    config_path: Path
    args: Any
    dtype: torch.dtype
    device: torch.device | str
    dims: ParallelDims | None
    lora_field: str
    """The LoRA setting, as the error names it (e.g. "lora.rank=16")."""

    def check(self, sizes: ParameterBytes, num_layers: int) -> None:
        available = memory_for_parameters(self.device)
        if available is None:
            return
        limit, where = available
        total, lora = sizes.for_layers(num_layers)
        share = 1 if self.dims is None else self.dims.dp_shard * self.dims.cp * self.dims.tp
        holders = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if torch.device(self.device).type == "cpu" else 1
        needed = total * holders // share
        if needed <= limit:
            return
        args, base = self.args, total - lora
        layer_fields = [f.name for f in dataclasses.fields(args) if f.name in _LAYER_WIDTH_FIELDS]
        if lora > base:
            culprit = f"{self.lora_field}: the LoRA factors take {_gib(lora)}"
        elif (sizes.outside_layers - sizes.outside_layers_lora) * holders // share > limit:
            culprit = (
                f"vocab_size={args.vocab_size}, hidden_size={args.hidden_size} in {self.config_path}: the embedding "
                f"and output head take {_gib(sizes.outside_layers - sizes.outside_layers_lora)}"
            )
        elif (sizes.outside_layers + max(sizes.layers)) * holders // share > limit:
            widths = ", ".join(f"{name}={getattr(args, name)}" for name in layer_fields)
            culprit = f"{widths} in {self.config_path}: one decoder layer takes {_gib(max(sizes.layers))}"
        else:
            culprit = (
                f"num_hidden_layers={num_layers} in {self.config_path}: {num_layers} decoder layers of about "
                f"{_gib(sum(sizes.layers) / len(sizes.layers))} each"
            )
        dtype = str(self.dtype).removeprefix("torch.")
        raise ValueError(
            f"{culprit}; the model's parameters ({dtype} base weights, fp32 LoRA factors) would take about "
            f"{_gib(needed)} here, more than the {_gib(limit)} {where}"
        )


@torch.no_grad()
def init_lora_weights(model: nn.Module, seed: int = 0) -> None:
    """Every adapter's A and B as PEFT starts them (`init_lora_factors`).

    Each full factor is drawn from one seeded generator, the A factors in parameter order, and every
    rank copies the part it holds, so sharded and single-process models start from the same adapter.
    """
    generator = torch.Generator().manual_seed(seed)
    params = lora_parameters(model)
    for name, lora_a in params.items():
        parts = name.split(".")
        if "lora_a" not in parts:
            continue
        b_name = ".".join("lora_b" if part == "lora_a" else part for part in parts)
        lora_b = params[b_name]
        full_a, full_b = torch.empty(lora_a.shape), torch.empty(lora_b.shape)
        init_lora_factors(full_a, full_b, generator)
        for key, param, full in ((name, lora_a, full_a), (b_name, lora_b, full_b)):
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], key)


def _check_multi_task_layout(
    task_loras: dict[str, LoRAConfig], dims: ParallelDims, parallel: ParallelConfig | None
) -> None:
    """Refuse the layouts a multi-task model does not run under, naming the setting."""
    if parallel is not None and parallel.compile:
        raise ValueError(
            "parallel.compile=True: a multi-task (several adapters) model runs eagerly (its grouped matmuls over "
            "the tasks' fp32 factors have no compiled kernel); set parallel.compile=False"
        )
    dropping = [task for task, lora in task_loras.items() if lora.dropout > 0]
    if dims.tp_enabled and dropping:
        raise ValueError(
            f"task(s) {dropping}: lora.dropout > 0 with tp={dims.tp}; a multi-task model's adapters draw their "
            "dropout on each tensor-parallel rank's part of the activations, which would not be one dropout of the "
            "whole; set the tasks' lora.dropout to 0 or parallel.tp to 1"
        )


def build_model(
    path: str | os.PathLike,
    lora: LoRAConfig | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    parallel: ParallelConfig | None = None,
    dims: ParallelDims | None = None,
    seed: int = 0,
    path_option: str | None = None,
    task_loras: dict[str, LoRAConfig] | None = None,
    quantized_base: str = "keep",
    mtp: bool = False,
    mtp_lora: bool = False,
) -> LoadedModel:
    """Build the archon model for the HF checkpoint at `path` and load its weights.

    Base weights take `dtype`; LoRA factors stay fp32. With LoRA only the adapter is trainable,
    without it every parameter is. Parallelism: pass `dims` (and `parallel` for AC/compile/FSDP
    options) to use the family's parallelize function.
    `path_option` names the setting `path` came from, for error messages.
    `task_loras` (instead of `lora`) builds a multi-task model: one adapter per task, in this order,
    on the one frozen base (archon.lora.MultiLoRALinear); each task's adapter starts as the one a
    single-adapter model with its config and `seed` would. Under FSDP2, TP and EP each task's
    factors are laid out as a single adapter's; parallel.compile, and LoRA dropout under TP, are
    refused.
    A quantized checkpoint (FP8 block-scaled or MXFP4, named by its config's `quantization_config`)
    keeps its quantized weights in their format, frozen, dequantized per GEMM
    (`quantized_base="keep"`, archon.quant), or is dequantized into `dtype` as it loads
    (`quantized_base="dequantize"`).
    `mtp`: also build and load the checkpoint's multi-token-prediction layers (`model.mtp`,
    models/common/mtp.py), which are skipped otherwise; a checkpoint or family without them is refused.
    `mtp_lora`: their blocks carry `lora` too (to train them); otherwise they have none.
    """
    path = Path(path)
    hf_config = load_hf_config(path, path_option)
    spec = get_spec(hf_config.model_type)
    args = _model_args(spec, hf_config, path, lora, task_loras, mtp, mtp_lora)
    lora = _adapter_config(spec, lora, task_loras)
    checkpoint, quant_format = _open_checkpoint(path, hf_config, quantized_base)
    keep_quantized = quant_format is not None and quantized_base == "keep"
    if task_loras is not None and dims is not None:
        _check_multi_task_layout(task_loras, dims, parallel)
    if task_loras is not None:
        lora_field = "the tasks' lora.rank (" + ", ".join(f"{t}: {c.rank}" for t, c in task_loras.items()) + ")"
    else:
        lora_field = f"lora.rank={lora.rank}" if lora is not None else "lora.rank"
    size = SizeCheck(path / "config.json", args, dtype, device, dims, lora_field)

    converter = spec.state_dict_converter_cls(args)
    if args.num_hidden_layers > PROBE_LAYERS:  # see PROBE_LAYERS
        _check_probe_size(spec, args, lora, task_loras, checkpoint if keep_quantized else None, dtype, size)
    with torch.device("meta"):
        model = spec.model_cls(args, lora)
    _check_lora_ranks(model, lora, task_loras, converter)
    _configure_lora(model, lora, task_loras, converter)
    if keep_quantized:
        _keep_quantized(model, converter, checkpoint, dtype)
    size.check(parameter_bytes(model, dtype), args.num_hidden_layers)
    _check_peft_export(model, converter, lora, task_loras, path)
    _set_dtypes(model, dtype, lora)

    if dims is not None:
        model = _parallelize(model, spec, dims, parallel or ParallelConfig())
    model.to_empty(device=device)
    load_hf_weights(model, converter, checkpoint)
    quantization = (quant_format, frozenset(checkpoint.quantized)) if quant_format is not None else (None, frozenset())
    if task_loras is not None:
        for task in task_loras:
            with task_view(model, task):
                init_lora_weights(model, seed)
        return LoadedModel(model, spec, args, converter, hf_config, path, None, dims, *quantization)
    if lora is not None:
        init_lora_weights(model, seed)
    return LoadedModel(model, spec, args, converter, hf_config, path, lora, dims, *quantization)


def _model_args(spec: ModelSpec, hf_config, path: Path, lora, task_loras, mtp: bool, mtp_lora: bool):
    """The family's args for `hf_config`, with the checkpoint's MTP layers when `mtp` (see build_model)."""
    args = spec.args_cls.from_hf_config(hf_config)
    if mtp:
        args = with_mtp_layers(spec, args, path / "config.json")
        args = dataclasses.replace(args, mtp_lora=mtp_lora and (lora is not None or task_loras is not None))
    elif mtp_lora:
        raise ValueError("build_model: mtp_lora=True needs the MTP layers (mtp=True)")
    return args


def _adapter_config(spec: ModelSpec, lora, task_loras) -> LoRAConfig | None:
    """The LoRA config the model is built with (the union of the tasks'), each checked against the family."""
    if task_loras is not None:
        if lora is not None:
            raise ValueError("build_model takes either lora (one adapter) or task_loras (one per task), not both")
        if not task_loras:
            raise ValueError("task_loras must name at least one task")
        for task, task_lora in task_loras.items():
            try:
                task_lora.validate(spec.lora_targets, spec.name)
            except ValueError as e:
                raise ValueError(f"task {task!r}: {e}") from None
        return union_lora_config(task_loras)
    if lora is not None:
        lora.validate(spec.lora_targets, spec.name)
    return lora


def _open_checkpoint(path: Path, hf_config, quantized_base: str) -> tuple[HFCheckpoint, QuantFormat | None]:
    """The checkpoint at `path` (its quantized view if quantized), and its format (None for a plain one)."""
    checkpoint = HFCheckpoint(path)
    quantization_config = getattr(hf_config, "quantization_config", None)
    if hasattr(quantization_config, "to_dict"):
        quantization_config = quantization_config.to_dict()
    quant_format = quant_format_from_config(quantization_config, str(path / "config.json"))
    if quantized_base not in ("keep", "dequantize"):
        raise ValueError(f"model.quantized_base={quantized_base!r}; expected 'keep' or 'dequantize'")
    if quant_format is not None:
        checkpoint = QuantizedCheckpoint(checkpoint, quant_format)
    return checkpoint, quant_format


def _check_probe_size(spec: ModelSpec, args, lora, task_loras, quantized, dtype: torch.dtype, size: SizeCheck) -> None:
    """The size check on a meta copy with PROBE_LAYERS decoder layers (see PROBE_LAYERS); `quantized`:
    the checkpoint whose quantized weights the model keeps so, if it does."""
    shallow_args = _with_layers(args, PROBE_LAYERS)
    shallow_converter = spec.state_dict_converter_cls(shallow_args)
    with warnings.catch_warnings():  # rank patterns of deeper layers match nothing in the shallow copy
        warnings.simplefilter("ignore")
        with torch.device("meta"):
            shallow = spec.model_cls(shallow_args, lora)
        _configure_lora(shallow, lora, task_loras, shallow_converter)
    if quantized is not None:
        _keep_quantized(shallow, shallow_converter, quantized, dtype)
    size.check(parameter_bytes(shallow, dtype), args.num_hidden_layers)


def _check_lora_ranks(model: nn.Module, lora, task_loras, converter) -> None:
    """Refuse a LoRA rank above every adapted module's min(in, out) (`lora_rank_problem`)."""
    if task_loras is not None:
        for task, task_lora in task_loras.items():
            if (problem := lora_rank_problem(model, task_lora, converter.hf_name)) is not None:
                raise ValueError(f"task {task!r}: {problem}")
    elif lora is not None and (problem := lora_rank_problem(model, lora, converter.hf_name)) is not None:
        raise ValueError(problem)


def _check_peft_export(model: nn.Module, converter, lora, task_loras, path: Path) -> None:
    """Fail now, not at the first export, where an adapter has no PEFT form."""
    if task_loras is not None:
        for task, task_lora in task_loras.items():
            with task_view(model, task):
                try:
                    peft_adapter_config(model, converter, task_lora, str(path))
                except ValueError as e:
                    raise ValueError(f"task {task!r}: {e}") from None
    elif lora is not None:
        peft_adapter_config(model, converter, lora, str(path))


def _set_dtypes(model: nn.Module, dtype: torch.dtype, lora: LoRAConfig | None) -> None:
    """Base weights in `dtype`, LoRA factors in fp32 or fp64; with LoRA only the adapter trains."""
    model.to(dtype)
    lora_dtype = torch.promote_types(dtype, torch.float32)  # fp32, or fp64 under an fp64 base
    for name, param in model.named_parameters():
        if is_lora_param(name):
            param.data = param.data.to(lora_dtype)
    if lora is not None:
        mark_only_lora_trainable(model)


def _parallelize(model: nn.Module, spec: ModelSpec, dims: ParallelDims, parallel: ParallelConfig) -> nn.Module:
    """The model through its family's parallelize function, when the layout or the options need it."""
    needs_pipeline = (
        dims.distributed or parallel.activation_checkpoint != "none" or parallel.activation_offload or parallel.compile
    )
    if not needs_pipeline:
        return model
    if spec.parallelize_fn is None:
        raise ValueError(f"model family {spec.name!r} has no parallelize function (ModelSpec.parallelize_fn)")
    return spec.parallelize_fn(model, dims, parallel)
