"""Shared by the single-process reference (in pytest) and the torchrun workers (parallel_worker.py):
the batch, the loss, the engine settings and the measurements compared between layouts.

A layout is compared with one process in float64 (EQUALITY_DTYPE), both sides computing inside
archon.precision.fp32_islands_in_fp64: what remains between them is float64 rounding, which no CPU's
vector width, AMX tiles or thread count moves near the tolerances of the tests."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from helpers import assert_close_reporting

from archon.batch import PackedBatch
from archon.build import build_model
from archon.checkpoint.hf import copy_local_into, local_region
from archon.head import label_logprobs
from archon.lora import LoRAConfig, adapter_disabled, adapter_routing, is_lora_param, task_parameters, task_view
from archon.lora.peft import full_tensor, load_peft_adapter, save_peft_adapter
from archon.parallel import ParallelConfig, init_distributed, reduce_partial_grads
from archon.rl.losses import aggregate_token_losses, ppo_clip_token_losses, ratio_metrics
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.sync.payload import merged_payload
from archon.trainer import OptimConfig, Trainer, TrainerConfig

SEQ_LENS = (30, 13, 30, 20, 30, 5)
PROMPT_LENS = (10, 4, 12, 6, 3, 2)
MICRO_BATCH_TOKENS = 40
TRAIN_STEPS = 4  # the last step's loss is measured after 3 optimizer steps
EQUALITY_DTYPE = "float64"

LAYOUTS = {
    # name: (world size, ParallelConfig kwargs)
    "fsdp2": (2, dict(dp_shard=2, tp=1, activation_checkpoint="full")),
    "tp2": (2, dict(dp_shard=1, tp=2, activation_checkpoint="selective")),
    "fsdp2_tp2": (4, dict(dp_shard=2, tp=2)),
    "hsdp2x2": (4, dict(dp_replicate=2, dp_shard=2)),
    # Expert parallelism: experts split over 2 ranks (everything else FSDP-sharded over the same 2);
    # then over 2 of the 4 FSDP ranks, each expert shard replicated on 2 ranks.
    "ep2": (2, dict(dp_shard=2, ep=2, activation_checkpoint="full")),
    "ep2_fsdp2": (4, dict(dp_shard=4, ep=2)),
    "ep2_tp2": (4, dict(dp_shard=2, ep=2, tp=2)),
    # Context parallelism: each micro-batch's tokens split over 2 ranks (sequences straddle the
    # split); then with FSDP over the 2 data-parallel ranks, under TP (one key/value head per
    # tensor-parallel rank, repeated for the 2 context-parallel ranks), and with the experts split over
    # the 2 data-parallel ranks (each expert shard replicated over cp).
    "cp2": (2, dict(dp_shard=1, cp=2, activation_checkpoint="full")),
    "cp2_fsdp2": (4, dict(dp_shard=2, cp=2)),
    "cp2_tp2": (4, dict(dp_shard=1, cp=2, tp=2)),
    "cp2_ep2": (4, dict(dp_shard=2, cp=2, ep=2)),
}
# FSDP2 mixed precision (compute in bf16), with and without expert parallelism (FSDP2 leaves
# expert-parallel experts alone).
MIXED_PRECISION_LAYOUTS = {
    "ep2": dict(dp_shard=2, ep=2, param_dtype="bfloat16"),
    "fsdp2": dict(dp_shard=2, param_dtype="bfloat16"),
}


def assert_gradients_close_reporting(got: dict, want: dict, tol: float, where: str) -> None:
    """Each gradient in `want` (by parameter name) against `got`'s, relative to its largest |value|
    (a zero reference gradient fails: the comparison would be empty)."""
    assert got.keys() == want.keys(), f"{where}: gradients of {sorted(got.keys() ^ want.keys())} on one side only"
    for name, reference in want.items():
        scale = reference.abs().max().item()
        assert scale > 0, f"{where}: the reference gradient of {name} is zero: the comparison would be empty"
        assert_close_reporting(
            got[name] / scale,
            reference / scale,
            tol,
            f"{where}: LoRA gradient {name} over its largest |value| {scale:.3e}",
        )


def make_batch(vocab_size: int, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS]
    advantages = torch.randn(len(SEQ_LENS), generator=g).tolist()
    return PackedBatch.from_sequences(seqs, prompt_lens=PROMPT_LENS, advantages=advantages)


def engine_config(hf_path, parallel: ParallelConfig | None = None, lora_dropout: float = 0.0, **kw) -> TrainerConfig:
    kw.setdefault("micro_batch_tokens", MICRO_BATCH_TOKENS)
    kw.setdefault("head_chunk_size", 16)
    return TrainerConfig(
        model_path=str(hf_path),
        lora=LoRAConfig(rank=4, alpha=8.0, dropout=lora_dropout),
        parallel=parallel or ParallelConfig(),
        optim=OptimConfig(lr=2e-2, max_grad_norm=0.5, schedule="cosine", warmup_steps=1, total_steps=10),
        device="cpu",
        **kw,
    )


def loss_fn(batch: PackedBatch, logprobs: torch.Tensor, ctx):
    """GRPO (sequence-level mean) plus a token-mean entropy bonus, so both normalisations and the
    entropy gradient are exercised."""
    token_losses, clipped, _ = ppo_clip_token_losses(
        logprobs, batch.old_logprobs, batch.advantages, batch.loss_mask, batch.cu_seqlens, clip_low=0.2, clip_high=0.2
    )
    loss = aggregate_token_losses(token_losses, batch.loss_mask, batch.cu_seqlens, "seq_mean_token_mean", ctx)
    bonus = aggregate_token_losses(ctx.entropy, batch.loss_mask, batch.cu_seqlens, "token_mean", ctx)
    return loss - 0.01 * bonus, ratio_metrics(logprobs - batch.old_logprobs, batch.loss_mask, clipped)


@torch.no_grad()
def set_lora_values(trainer: Trainer, seed: int, in_factor_dtype: bool = False) -> None:
    """Deterministic non-zero LoRA factors (each rank copies its part of the same full tensors)."""
    set_model_lora_values(trainer.model, seed, in_factor_dtype)


@torch.no_grad()
def set_model_lora_values(model: torch.nn.Module, seed: int, in_factor_dtype: bool = False) -> None:
    """Drawn in fp32 (the same values in an fp32 and an fp64 model), or with `in_factor_dtype` in each
    factor's own dtype: fp64 factors then hold values that no fp32 tensor holds, so an export or a
    gather that passed them through fp32 would change them."""
    g = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        if is_lora_param(name):
            full = torch.randn(param.shape, generator=g, dtype=param.dtype if in_factor_dtype else torch.float32) * 0.2
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], name)


def _local_lora_values(trainer: Trainer) -> dict[str, torch.Tensor]:
    """This rank's part of every LoRA factor."""
    return {
        name: (p.to_local() if hasattr(p, "to_local") else p).detach().clone()
        for name, p in trainer.model.named_parameters()
        if is_lora_param(name)
    }


def _gather_per_sequence(indices: list[int], values: torch.Tensor, batch: PackedBatch):
    """Per-sequence slices of a [T_local] tensor, gathered from all ranks into global order."""
    bounds = batch.cu_seqlens.tolist()
    local = {i: values[bounds[k] : bounds[k + 1]].clone() for k, i in enumerate(indices)}
    if dist.is_initialized():
        everything = [None] * dist.get_world_size()
        dist.all_gather_object(everything, local)
        for part in everything:
            local.update(part)
    return torch.cat([local[i] for i in sorted(local)])


def run_case(trainer: Trainer, vocab_size: int, export_dir=None, merged: bool = False, generate: bool = False) -> dict:
    """Everything compared across layouts: log-probs (policy, reference, entropy), the first
    step's loss and LoRA gradients, the loss curve, an exported adapter (and whether loading it
    back restores the factors), (`merged`) the merged-mode sync payload, and (`generate`) greedy
    completions of the native rollout engine."""
    full = make_batch(vocab_size)
    dp, dp_rank = trainer.dims.dp, trainer.dims.dp_rank
    indices = list(range(dp_rank, full.num_sequences, dp))
    batch = full.select(indices)
    set_lora_values(trainer, seed=1)

    policy = trainer.logprobs(batch, with_entropy=True)
    reference = trainer.logprobs(batch, use_adapter=False)
    batch.old_logprobs = policy.logprobs
    result = {
        "logprobs": _gather_per_sequence(indices, policy.logprobs, batch),
        "entropy": _gather_per_sequence(indices, policy.entropy, batch),
        "ref_logprobs": _gather_per_sequence(indices, reference.logprobs, batch),
    }
    first = trainer.forward_backward(batch, loss_fn, with_entropy=True)
    result["first_loss"] = first["loss"]
    result["micro_batches"] = first["micro_batches"]
    result["grads"] = {
        name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
        for name, p in trainer.model.named_parameters()
        if is_lora_param(name)
    }
    step = trainer.optimizer_step()
    trainer.advance_schedule()
    losses, norms = [first["loss"]], [step["grad_norm"]]
    for _ in range(TRAIN_STEPS - 1):
        metrics = trainer.train_step(batch, loss_fn, with_entropy=True)
        losses.append(metrics["loss"])
        norms.append(metrics["grad_norm"])
    result["losses"] = losses
    result["grad_norms"] = norms
    if export_dir is not None:
        set_lora_values(trainer, seed=2, in_factor_dtype=True)
        exported = _local_lora_values(trainer)
        trainer.export_peft(export_dir)
        set_lora_values(trainer, seed=3)
        load_peft_adapter(trainer.model, trainer.converter, export_dir)
        reloaded = _local_lora_values(trainer)
        same = torch.tensor(float(all(torch.equal(reloaded[name], value) for name, value in exported.items())))
        if dist.is_initialized():
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
        result["adapter_reloaded"] = bool(same)
    if merged:
        result["merged"] = dict(merged_payload(trainer.model, trainer.converter))
    if generate:
        result["generated"] = generate_on_first_rank(trainer)
    return result


GEN_PROMPTS = ([1, 2, 3], [4, 5, 6, 7, 8], [9])


def generate_on_first_rank(trainer: Trainer) -> list[list[int]]:
    """Greedy completions of GEN_PROMPTS by the native engine, generated on the first data-parallel
    rank only (in two chunks): the other ranks mirror its forwards with nothing to generate."""
    prompts = list(GEN_PROMPTS) if trainer.dims.dp_rank == 0 else []
    engine = NativeRolloutEngine(trainer.model, trainer.device, max_batch_sequences=2)
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=5, temperature=0))
    return [s.completion_ids for s in samples]


# ---- several tasks (multi-LoRA) -------------------------------------------------------------------

MULTI_TASK_LORAS = {
    # different ranks and targets: "b" adapts a few attention and dense MLP modules and no experts
    "a": LoRAConfig(rank=4, alpha=8.0),
    "b": LoRAConfig(rank=2, alpha=3.0, target_modules=("q_proj", "v_proj", "o_proj", "down_proj"), experts=False),
}
TASK_OF_SEQUENCE = (0, 1, 1, 0, 1, 0)
MULTI_TASK_LAYOUTS = {"fsdp2": LAYOUTS["fsdp2"], "tp2": LAYOUTS["tp2"], "ep2": LAYOUTS["ep2"]}
GEN_ADAPTERS = (0, 1, 1)


def _multi_task_logprobs(model, batch: PackedBatch, task_of_token: torch.Tensor | None) -> torch.Tensor:
    """[T] log-probs of the labels at the loss-mask positions (0 elsewhere); each token with its task's
    adapter (task_of_token None: the model as it is, e.g. a task's view)."""
    routing = adapter_routing(model, task_of_token) if task_of_token is not None else contextlib.nullcontext()
    with routing:
        hidden = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
    index = batch.loss_mask.nonzero()[:, 0]
    lp, _ = label_logprobs(hidden[index], model.output_weight, batch.labels[index], 1.0, 16)
    return torch.zeros(batch.num_tokens, dtype=lp.dtype).index_copy(0, index, lp)


def _reshard(model) -> None:
    """Put FSDP2's sharded parameters back in place after a forward (before they are read or written)."""
    if hasattr(model, "reshard"):
        model.reshard()


def run_multi_task_case(
    hf_path,
    vocab_size: int,
    parallel: ParallelConfig | None = None,
    export_dir=None,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A two-task model (tasks of other ranks and targets) on a packed batch that mixes the tasks'
    sequences: log-probs (adapters on, off, and task b's view), each task's LoRA gradients
    (gathered), each task's PEFT export (`export_dir`), and greedy completions of a mixed generation
    by the native engine (on the first data-parallel rank only) before and after the adapters change.
    `dtype`: of the base weights (the LoRA factors are fp32, or fp64 under an fp64 base)."""
    dims = None
    if parallel is not None:
        _, _, world = init_distributed("cpu")
        dims = parallel.dims(world, "cpu")
    loaded = build_model(hf_path, task_loras=MULTI_TASK_LORAS, dims=dims, parallel=parallel, dtype=dtype)
    model = loaded.model
    set_model_lora_values(model, seed=1, in_factor_dtype=True)  # exported as they are: fp64 bits kept
    full = make_batch(vocab_size)
    dp, dp_rank = (dims.dp, dims.dp_rank) if dims is not None else (1, 0)
    indices = list(range(dp_rank, full.num_sequences, dp))
    batch = full.select(indices)
    task_of_token = torch.tensor([TASK_OF_SEQUENCE[i] for i in indices]).repeat_interleave(torch.tensor(batch.seq_lens))

    def gathered(values):
        return _gather_per_sequence(indices, values, batch)

    result = {}
    model.eval()
    with torch.no_grad():
        result["logprobs"] = gathered(_multi_task_logprobs(model, batch, task_of_token))
        with adapter_disabled(model):
            result["ref_logprobs"] = gathered(_multi_task_logprobs(model, batch, task_of_token))
        with task_view(model, "b"):
            result["view_b_logprobs"] = gathered(_multi_task_logprobs(model, batch, None))
    _reshard(model)
    model.train()
    logprobs = _multi_task_logprobs(model, batch, task_of_token)
    (-(logprobs * batch.advantages).sum()).backward()
    reduce_partial_grads(model)
    result["grads"] = {
        task: {name: full_tensor(p.grad).clone() for name, p in task_parameters(model, task).items()}
        for task in MULTI_TASK_LORAS
    }
    if export_dir is not None:
        for task, lora in MULTI_TASK_LORAS.items():
            with task_view(model, task):
                save_peft_adapter(
                    model,
                    loaded.converter,
                    lora,
                    f"{export_dir}/{task}",
                    str(hf_path),
                    write=not dist.is_initialized() or dist.get_rank() == 0,
                )
        if dist.is_initialized():
            dist.barrier()
    model.eval()
    prompts = list(GEN_PROMPTS) if dp_rank == 0 else []
    adapters = list(GEN_ADAPTERS) if dp_rank == 0 else []
    engine = NativeRolloutEngine(model, "cpu", max_batch_sequences=2)
    sampling = SamplingParams(max_new_tokens=5, temperature=0)
    result["generated"] = [s.completion_ids for s in engine.generate(prompts, sampling, adapters=adapters)]
    _reshard(model)
    set_model_lora_values(model, seed=4)  # a changed adapter: the next generation must use it
    result["generated_after_change"] = [s.completion_ids for s in engine.generate(prompts, sampling, adapters=adapters)]
    return result


def run_mixed_precision(hf_path, vocab_size: int, parallel: ParallelConfig, **config) -> dict:
    """Log-probs (every rank's, in global order) and the loss of one training step of a layout whose
    parallel.param_dtype differs from the parameters' dtype. `config`: other TrainerConfig fields."""
    trainer = Trainer(engine_config(hf_path, parallel, **config))
    full = make_batch(vocab_size)
    indices = list(range(trainer.dims.dp_rank, full.num_sequences, trainer.dims.dp))
    batch = full.select(indices)
    set_lora_values(trainer, seed=1)
    policy = trainer.logprobs(batch, with_entropy=True)
    batch.old_logprobs = policy.logprobs
    first = trainer.train_step(batch, loss_fn, with_entropy=True)
    return {"logprobs": _gather_per_sequence(indices, policy.logprobs, batch), "first_loss": first["loss"]}


def quantized_storage_layout(model: torch.nn.Module) -> dict[str, dict]:
    """Where this rank's part of each quantized base weight (archon.quant) lies: per archon key, the
    box of the whole data and scale storage it holds (`local_region`, None for the whole), their
    placements, the number of shards the layout cuts them into, and the bytes held here and in all."""
    from torch.distributed.tensor import DTensor

    from archon.quant import quantized_weights

    def shards(t):  # FSDP2 over TP shards dim 0 twice: Shard on one mesh dim, _StridedShard on the other
        if not isinstance(t, DTensor):
            return 1
        return math.prod(t.device_mesh.size(i) for i, p in enumerate(t.placements) if not p.is_replicate())

    def nbytes(t):
        return t.numel() * t.element_size()

    out = {}
    for key, (module, name) in quantized_weights(model).items():
        data, scale = module.storage(name)
        local = [t.to_local() if isinstance(t, DTensor) else t for t in (data, scale)]
        out[key] = {
            "regions": [local_region(data), local_region(scale)],
            "placements": [str(t.placements) if isinstance(t, DTensor) else None for t in (data, scale)],
            "shards": [shards(data), shards(scale)],
            "local_bytes": sum(nbytes(t) for t in local),
            "bytes": sum(nbytes(t) for t in (data, scale)),
            "column_block": module._quantized[name].fmt.column_block,
            "inputs_per_byte": 2 if module._quantized[name].fmt.method == "mxfp4" else 1,
        }
    return out


def run_full_finetune(
    hf_path, vocab_size: int, parallel: ParallelConfig | None = None, steps: int = 2, dtype: str = "float32"
) -> list[float]:
    """Losses of a few full-parameter steps (no LoRA): the embedding and unembedding, which live in
    the FSDP root and are read by the head outside the model's forward, are trained too."""
    config = engine_config(hf_path, parallel, dtype=dtype)
    config.lora = None
    config.optim = OptimConfig(lr=1e-3, max_grad_norm=0.5)
    trainer = Trainer(config)
    full = make_batch(vocab_size)
    batch = full.select(list(range(trainer.dims.dp_rank, full.num_sequences, trainer.dims.dp)))
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    return [trainer.train_step(batch, loss_fn, with_entropy=True)["loss"] for _ in range(steps + 1)]


JOB_SEPARATOR = "--then"  # between the scenarios of one launch (tests/parallel_worker.py)


def launch(nproc: int, *worker_args: str, timeout: int = 420) -> None:
    """Run tests/parallel_worker.py under torchrun (standalone rendezvous on a free port)."""
    launch_jobs(nproc, [list(worker_args)], timeout=timeout)


def launch_jobs(nproc: int, jobs: list[list[str]], timeout_per_job: int = 420, timeout: int | None = None) -> None:
    """Run several scenarios of tests/parallel_worker.py one after the other in one torchrun launch
    (each job: the arguments of one scenario), so the processes start and import once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker_args = [arg for index, job in enumerate(jobs) for arg in ([JOB_SEPARATOR] if index else []) + list(job)]
    worker = Path(__file__).with_name("parallel_worker.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(worker),
        *worker_args,
    ]
    # PYTHONFAULTHANDLER: a worker that crashes prints where it was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    timeout = timeout if timeout is not None else timeout_per_job * len(jobs)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )


def reshard_job(out_dir, name: str, path, first: str, second: str) -> list[str]:
    """The worker arguments (a job of launch_jobs, on 2 ranks) that run `name` (the checkpoint at
    `path`) under layouts `first` and `second` with checkpoints in `out_dir` and resume each
    checkpoint under the other layout (tests/parallel_worker.py `reshard`); check it with
    check_resumed_across_layouts."""
    return ["reshard", "--out", str(out_dir), "--layouts", first, second, "--ckpt", f"{name}={path}"]


def check_resumed_across_layouts(out_dir, name: str, path, first: str, second: str, tol: float, reshard_batch) -> dict:
    """What reshard_job(out_dir, name, path, first, second) ran, then the `first` layout's checkpoint
    resumed in this process (steps 2 and 3 on `reshard_batch(trainer, vocab, step)`), all in
    EQUALITY_DTYPE: every resumed run continues with the uninterrupted `first` run's losses and
    gradient norms (to `tol`), and a fresh model's do not. Returns the results by (name, layout[,
    resumed layout])."""
    from archon.checkpoint.hf import HFCheckpoint
    from archon.checkpoint.resume import CheckpointManager
    from archon.precision import fp32_islands_in_fp64

    results = torch.load(out_dir / "reshard.pt")
    uninterrupted = results[(name, first)]

    def check(got, where):  # [(loss, grad norm)] per step
        check_resumed_steps(got, uninterrupted, tol, f"{name}: {where} against the uninterrupted {first} run")

    check(results[(name, second)], f"uninterrupted {second}")
    check(results[(name, first, second)], f"{first} checkpoint resumed under {second}")
    check(results[(name, second, first)], f"{second} checkpoint resumed under {first}")
    vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
    with fp32_islands_in_fp64():
        resumed = Trainer(engine_config(path, dtype=EQUALITY_DTYPE))
        resumed.load_checkpoint(CheckpointManager(out_dir / f"{name}-{first}", keep_last=1))
        steps = [resumed.train_step(reshard_batch(resumed, vocab, step), loss_fn, with_entropy=True) for step in (2, 3)]
        check([(m["loss"], m["grad_norm"]) for m in steps], f"{first} checkpoint resumed in one process")
        # Without the checkpoint the same steps give other gradients: the comparison has teeth.
        fresh = Trainer(engine_config(path, dtype=EQUALITY_DTYPE))
        fresh_norm = fresh.train_step(reshard_batch(fresh, vocab, 2), loss_fn, with_entropy=True)["grad_norm"]
    assert abs(fresh_norm / uninterrupted[0][1] - 1) > 1e-2, (
        f"{name}: a fresh model's gradient norm {fresh_norm} is within 1% of the resumed run's {uninterrupted[0][1]}"
    )
    return results


def check_resumed_steps(got: list, want: list, tol: float, where: str) -> None:
    """[(loss, gradient norm)] per step of a resumed run against the uninterrupted run's: the losses
    (of on-policy steps, which barely depend on the parameters) and the gradient norms (which do)."""
    assert_close_reporting([loss for loss, _ in got], [loss for loss, _ in want], tol, f"{where}: losses")
    assert_close_reporting([norm for _, norm in got], [norm for _, norm in want], tol, f"{where}: gradient norms")
