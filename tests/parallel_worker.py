"""torchrun worker for the multi-process tests (not collected by pytest).

    python -m torch.distributed.run --nproc_per_node N tests/parallel_worker.py parity \
        --out OUT --layouts fsdp2 tp2 --ckpt qwen3=DIR qwen3_moe=DIR
    ... tests/parallel_worker.py parity --out OUT --layouts qwen3:cp2_tp2 qwen3_moe:cp2_ep2 --ckpt ...
    ... tests/parallel_worker.py resume --out OUT --ckpt qwen3=DIR --phase first|second
    ... tests/parallel_worker.py skip --out OUT --ckpt qwen3=DIR --layouts fsdp2 tp2
    ... tests/parallel_worker.py reshard --out OUT --ckpt qwen3_moe=DIR gpt_oss=DIR --layouts ep2 fsdp2
    ... tests/parallel_worker.py multi_task --out OUT --ckpt qwen3=DIR qwen3_moe=DIR --layouts fsdp2 tp2 ep2
    ... tests/parallel_worker.py quantized --out OUT --ckpt fp8=DIR mxfp4=DIR --layouts fp8:fsdp2 mxfp4:ep2
    ... tests/parallel_worker.py parity --out OUT ... --then skip --out OUT2 ...   (one after the other)

Rank 0 writes its results with torch.save to OUT (a file for parity, a directory for resume).

What is compared with one process runs in float64 (cases.EQUALITY_DTYPE) inside
archon.precision.fp32_islands_in_fp64, which main enters for every scenario (float32 and bfloat16
runs compute as they would without it).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

# The script's own folder (tests/) comes first on sys.path: put the checkout this file belongs to
# first instead (whatever an editable install points at), import the project, then add the folder
# back for parallel_cases.
_TESTS_DIR = sys.path.pop(0)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from archon.checkpoint.hf import HFCheckpoint  # noqa: E402
from archon.checkpoint.resume import CheckpointManager  # noqa: E402
from archon.parallel import ParallelConfig  # noqa: E402
from archon.precision import fp32_islands_in_fp64  # noqa: E402
from archon.trainer import Trainer  # noqa: E402

sys.path.append(_TESTS_DIR)
import parallel_cases as cases  # noqa: E402
from worker_exit import exit_when_every_rank_is_done  # noqa: E402


def count_reads():
    """Count the checkpoint elements this process reads."""
    counter = {"elements": 0}
    get, get_slice = HFCheckpoint.get, HFCheckpoint.get_slice

    def counted_get(self, key):
        t = get(self, key)
        counter["elements"] += t.numel()
        return t

    def counted_get_slice(self, key, region):
        t = get_slice(self, key, region)
        counter["elements"] += t.numel()
        return t

    HFCheckpoint.get, HFCheckpoint.get_slice = counted_get, counted_get_slice
    return counter


def parity(args) -> None:
    """Each --layouts LAYOUT under every --ckpt model, each MODEL:LAYOUT under that model only."""
    ckpts = dict(item.split("=", 1) for item in args.ckpt)
    counter = count_reads()
    results = {}
    for model_type, path in ckpts.items():
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        total = sum(torch.Size(HFCheckpoint(path).shape(k)).numel() for k in HFCheckpoint(path).keys())
        layouts = [item.rpartition(":")[2] for item in args.layouts if item.rpartition(":")[0] in ("", model_type)]
        for layout in layouts:
            world, kwargs = cases.LAYOUTS[layout]
            assert world == int(os.environ["WORLD_SIZE"]), (layout, world)
            counter["elements"] = 0
            trainer = Trainer(cases.engine_config(path, ParallelConfig(**kwargs), dtype=cases.EQUALITY_DTYPE))
            read = torch.tensor([counter["elements"]])
            gathered = [torch.zeros_like(read) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, read)
            export_dir = Path(args.out).parent / f"peft-{model_type}-{layout}"
            expert_parallel = layout.startswith("ep")
            result = cases.run_case(
                trainer,
                vocab,
                export_dir=export_dir,
                merged=expert_parallel,
                generate=expert_parallel or layout.startswith("cp"),
            )
            result["read_elements"] = [int(t) for t in gathered]
            result["checkpoint_elements"] = total
            result["export_dir"] = str(export_dir)
            del trainer
            if layout == "fsdp2":
                # the production dtype, whose FSDP2 reduce (fp32) and grouped expert GEMMs the fp64
                # runs do not take
                result["float32"] = cases.run_case(Trainer(cases.engine_config(path, ParallelConfig(**kwargs))), vocab)
            if layout == "fsdp2" and model_type == "qwen3":
                result["full_ft_losses"] = cases.run_full_finetune(
                    path, vocab, ParallelConfig(**kwargs), dtype=cases.EQUALITY_DTYPE
                )
            if layout == "ep2":
                result["mixed_precision"] = {
                    name: cases.run_mixed_precision(path, vocab, ParallelConfig(**kwargs))
                    for name, kwargs in cases.MIXED_PRECISION_LAYOUTS.items()
                }
            results[(model_type, layout)] = result
    if dist.get_rank() == 0:
        torch.save(results, args.out)


def quantized(args) -> None:
    """Quantized bases (archon.quant) under each layout, `--layouts NAME:LAYOUT` picking the
    checkpoint named NAME in --ckpt: what `parity` measures (with the merged payload and the native
    engine's completions), the checkpoint elements each rank read, and where each rank's part of
    every quantized weight lies (cases.quantized_storage_layout, all ranks'); under fsdp2 also one
    bf16 step (parallel.param_dtype) with the base kept quantized and dequantized at load."""
    ckpts = dict(item.split("=", 1) for item in args.ckpt)
    counter = count_reads()
    results = {}
    for item in args.layouts:
        name, layout = item.split(":")
        path = ckpts[name]
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        world, kwargs = cases.LAYOUTS[layout]
        assert world == int(os.environ["WORLD_SIZE"]), (layout, world)
        counter["elements"] = 0
        trainer = Trainer(cases.engine_config(path, ParallelConfig(**kwargs), dtype=cases.EQUALITY_DTYPE))
        read = [None] * dist.get_world_size()
        dist.all_gather_object(read, counter["elements"])
        storage = [None] * dist.get_world_size()
        dist.all_gather_object(storage, cases.quantized_storage_layout(trainer.model))
        export_dir = Path(args.out).parent / f"peft-{name}-{layout}"
        result = cases.run_case(trainer, vocab, export_dir=export_dir, merged=True, generate=True)
        del trainer
        result.update(read_elements=read, storage=storage, export_dir=str(export_dir))
        checkpoint = HFCheckpoint(path)
        result["checkpoint_elements"] = sum(torch.Size(checkpoint.shape(k)).numel() for k in checkpoint.keys())
        if layout == "fsdp2":
            bf16 = ParallelConfig(**kwargs, param_dtype="bfloat16")
            result["mixed_precision"] = {
                base: cases.run_mixed_precision(path, vocab, bf16, quantized_base=base)
                for base in ("keep", "dequantize")
            }
        results[(name, layout)] = result
    if dist.get_rank() == 0:
        torch.save(results, args.out)


def resume(args) -> None:
    """first: 8 uninterrupted steps, then a fresh run of 4 steps that checkpoints and is killed.
    second: resume that checkpoint and run the last 4 steps."""
    (path,) = [item.split("=", 1)[1] for item in args.ckpt]
    vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
    parallel = ParallelConfig(dp_shard=int(os.environ["WORLD_SIZE"]))
    out = Path(args.out)
    manager = CheckpointManager(out / "checkpoints", keep_last=2)

    def trainer_of(**kw):
        # float64: a checkpoint that rounded a parameter or an optimizer moment to fp32 would show
        return Trainer(cases.engine_config(path, parallel, lora_dropout=0.1, dtype=cases.EQUALITY_DTYPE, **kw))

    def run(trainer, first_step, last_step, save=False):
        losses = []
        for step in range(first_step, last_step):
            batch = resume_batch(trainer, vocab, step)
            losses.append(trainer.train_step(batch, cases.loss_fn, with_entropy=True)["loss"])
            if save:
                trainer.save_checkpoint(manager, step + 1, data_state={"next_step": step + 1})
        return losses

    if args.phase == "first":
        uninterrupted = run(trainer_of(), 0, 8)
        first_half = run(trainer_of(), 0, 4, save=True)
        if dist.get_rank() == 0:
            torch.save({"uninterrupted": uninterrupted, "first_half": first_half}, out / "first.pt")
        dist.barrier()
        # Killed: no clean shutdown, nothing after the checkpoint survives.
        os._exit(0)
    # Another seed: everything that matters must come from the checkpoint.
    trainer = trainer_of(seed=123)
    data_state = trainer.load_checkpoint(manager)["data"]
    second_half = run(trainer, data_state["next_step"], 8)
    if dist.get_rank() == 0:
        torch.save(
            {
                "second_half": second_half,
                "resumed_step": data_state["next_step"],
                "checkpoints": [p.name for p in manager.checkpoints()],
            },
            out / "second.pt",
        )


def skip(args) -> None:
    """A NaN loss on rank 1 only: every rank skips the update and keeps its parameters and optimizer
    state; the next update is taken everywhere."""
    (path,) = [item.split("=", 1)[1] for item in args.ckpt]
    vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]

    def nan_on_rank_1(batch, logprobs, ctx):
        loss, metrics = cases.loss_fn(batch, logprobs, ctx)
        return (loss * float("nan") if dist.get_rank() == 1 else loss), metrics

    def local_state(trainer):
        state = {}
        for name, p in trainer.model.named_parameters():
            if p.requires_grad:
                state[name] = p.detach().to_local().clone() if hasattr(p, "to_local") else p.detach().clone()
                for key, value in trainer.optimizer.state.get(p, {}).items():
                    value = value.to_local() if hasattr(value, "to_local") else value
                    state[f"{name}/{key}"] = torch.as_tensor(value).clone()
        return state

    results = {}
    for layout in args.layouts:
        trainer = Trainer(cases.engine_config(path, ParallelConfig(**cases.LAYOUTS[layout][1])))
        batch = resume_batch(trainer, vocab, 0)
        trainer.train_step(batch, cases.loss_fn, with_entropy=True)
        before = local_state(trainer)
        bad = trainer.train_step(batch, nan_on_rank_1, with_entropy=True)
        after = local_state(trainer)
        unchanged = before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())
        good = trainer.train_step(batch, cases.loss_fn, with_entropy=True)
        mine = {
            "skipped": [bad["skipped"], good["skipped"]],
            "unchanged": unchanged,
            "optimizer_steps": trainer.optimizer_steps,
        }
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        results[layout] = everyone
    if dist.get_rank() == 0:
        torch.save(results, args.out)


def reshard(args) -> None:
    """Checkpoints move between layouts (expert-parallel and not): each layout trains 2 steps, saves,
    and trains 2 more; then each resumes the other's checkpoint and trains the same last 2 steps."""
    out = Path(args.out)
    results = {}
    for model_type, path in (item.split("=", 1) for item in args.ckpt):
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]

        def trainer_for(layout):
            parallel = ParallelConfig(**cases.LAYOUTS[layout][1])
            return Trainer(cases.engine_config(path, parallel, dtype=cases.EQUALITY_DTYPE))

        def train(trainer, first, last):
            """(loss, gradient norm) of each step: the loss of an on-policy step barely depends on the
            parameters, the gradient norm does."""
            metrics = [
                trainer.train_step(resume_batch(trainer, vocab, step), cases.loss_fn, with_entropy=True)
                for step in range(first, last)
            ]
            return [(m["loss"], m["grad_norm"]) for m in metrics]

        for layout in args.layouts:
            trainer = trainer_for(layout)
            manager = CheckpointManager(out / f"{model_type}-{layout}", keep_last=1)
            train(trainer, 0, 2)
            trainer.save_checkpoint(manager, 2, data_state={"next_step": 2})
            results[(model_type, layout)] = train(trainer, 2, 4)
        for saved, resumed in zip(args.layouts, reversed(args.layouts)):
            trainer = trainer_for(resumed)
            trainer.load_checkpoint(CheckpointManager(out / f"{model_type}-{saved}", keep_last=1))
            results[(model_type, saved, resumed)] = train(trainer, 2, 4)
    if dist.get_rank() == 0:
        torch.save(results, out / "reshard.pt")


def multi_task(args) -> None:
    """A two-task model under each layout (cases.run_multi_task_case); layouts with expert
    parallelism run on the families with routed experts only."""
    results = {}
    for model_type, path in (item.split("=", 1) for item in args.ckpt):
        vocab = HFCheckpoint(path).shape("model.embed_tokens.weight")[0]
        for layout in args.layouts:
            world, kwargs = cases.MULTI_TASK_LAYOUTS[layout]
            assert world == int(os.environ["WORLD_SIZE"]), (layout, world)
            if kwargs.get("ep", 1) > 1 and model_type == "qwen3":
                continue
            export_dir = Path(args.out).parent / f"multi-task-peft-{model_type}-{layout}"
            result = cases.run_multi_task_case(
                path, vocab, ParallelConfig(**kwargs), export_dir=export_dir, dtype=torch.float64
            )
            result["export_dir"] = str(export_dir)
            results[(model_type, layout)] = result
    if dist.get_rank() == 0:
        torch.save(results, args.out)


def resume_batch(trainer: Trainer, vocab: int, step: int):
    """Step-dependent data (the data-loader position is the step), on-policy old log-probs."""
    full = cases.make_batch(vocab, seed=100 + step)
    batch = full.shard(trainer.dims.dp_rank, trainer.dims.dp)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    return batch


def main() -> None:
    """One scenario, or several run one after the other (their arguments separated by
    cases.JOB_SEPARATOR) in the same processes, which then start and import once."""
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["parity", "resume", "skip", "reshard", "multi_task", "quantized"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", nargs="+", required=True)
    parser.add_argument("--layouts", nargs="*", default=[])
    parser.add_argument("--phase", choices=["first", "second"], default="first")
    jobs = [[]]
    for arg in sys.argv[1:]:
        if arg == cases.JOB_SEPARATOR:
            jobs.append([])
        else:
            jobs[-1].append(arg)
    jobs = [parser.parse_args(job) for job in jobs]
    if len(jobs) > 1 and any(job.scenario == "resume" for job in jobs):
        parser.error("resume ends its processes (a kill) and runs alone, not among other scenarios")
    torch.set_num_threads(1)
    scenarios = {
        "parity": parity,
        "skip": skip,
        "reshard": reshard,
        "multi_task": multi_task,
        "quantized": quantized,
        "resume": resume,
    }
    for args in jobs:
        with fp32_islands_in_fp64():
            scenarios[args.scenario](args)
    exit_when_every_rank_is_done()


if __name__ == "__main__":
    main()
