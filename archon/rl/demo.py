"""The built-in demo's warm start: a small Qwen3 model taught the arithmetic task by a short SFT.

Everything is made locally (character tokenizer, random-init model, task data), trained with the
same Engine the RL loop uses (full fine-tuning, FSDP over the ranks), and cached by its settings so
later runs skip it.

The SFT is chaotic: its float arithmetic (vector width, thread count, kernels) differs between
machines, the runs part within a few dozen steps, and the accuracy rises in a sudden jump whose step
differs from run to run, so models stopped at the same target learn at very different speeds under
RL. For the settings the demo and the tests use, archon therefore ships the warm start's weights
(`warm_starts/<settings digest>.safetensors`, written by `python -m archon.rl.demo`), and every
machine starts RL from the same model. Other settings are warm-started here.

    python -m archon.rl.demo                                   # write the demo's warm start
    python -m archon.rl.demo --demo.task.operations + - --demo.task.num-held-out 600 --seed 0
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from archon.batch import PackedBatch
from archon.checkpoint.atomic import atomic_file, replace_directory
from archon.lora.peft import save_merged_hf
from archon.recipes.grpo_lora import DEMO_CONFIG
from archon.rl.config import DemoConfig, load_config_file
from archon.rl.tasks import arithmetic_splits, build_char_tokenizer, write_jsonl
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.trainer import LossContext, OptimConfig, Trainer, TrainerConfig

PACKAGED_WARM_STARTS = Path(__file__).resolve().parent / "warm_starts"
SFT_MODEL = "sft"
TRAIN_FILE = "train.jsonl"
HELD_OUT_FILE = "held_out.jsonl"


@dataclasses.dataclass
class DemoFiles:
    model_dir: Path
    train_path: Path
    held_out_path: Path


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _cache_key(demo, parallel_seed: int) -> str:
    """A digest of the settings that make the warm start (where it is stored is not one of them)."""
    settings = {k: v for k, v in dataclasses.asdict(demo).items() if k != "cache_dir"}
    settings = json.dumps({"demo": settings, "seed": parallel_seed}, sort_keys=True, default=str)
    return hashlib.sha256(settings.encode()).hexdigest()[:12]


def packaged_warm_start(demo, seed: int) -> Path:
    """Where archon ships the warm start of these settings (the file may not exist)."""
    return PACKAGED_WARM_STARTS / f"{_cache_key(demo, seed)}.safetensors"


def _install_packaged_warm_start(init_dir: Path, weights: Path, model_dir: Path) -> None:
    """model_dir: the initial model's config and tokenizer with the packaged weights, in one rename."""
    staging = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(init_dir, staging)
    shutil.copyfile(weights, staging / "model.safetensors")
    replace_directory(staging, model_dir)


def _write_init_model(demo, out_dir: Path, seed: int) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tokenizer = build_char_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=demo.hidden_size,
        intermediate_size=demo.intermediate_size,
        num_hidden_layers=demo.num_hidden_layers,
        num_attention_heads=demo.num_attention_heads,
        num_key_value_heads=demo.num_key_value_heads,
        head_dim=demo.hidden_size // demo.num_attention_heads,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    Qwen3ForCausalLM(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _sft_loss(batch: PackedBatch, logprobs: torch.Tensor, ctx: LossContext):
    nll = -(logprobs * batch.loss_mask).sum() / ctx.global_tokens
    return nll, {"nll": nll.detach() * ctx.global_tokens / batch.loss_mask.sum().clamp(min=1)}


def _greedy_accuracy_by_operation(trainer: Trainer, examples: dict[str, list], eos: int) -> dict[str, float]:
    """Greedy exact-match accuracy of each operation's (prompt ids, answer ids + eos) pairs, over
    all ranks."""
    operations = sorted(examples)
    tagged = [(op, pair) for op in operations for pair in examples[op]]
    mine = tagged[trainer.dims.dp_rank :: trainer.dims.dp]
    longest = max(len(answer) for _, (_, answer) in tagged)
    sampling = SamplingParams(max_new_tokens=longest, temperature=0, stop_token_ids=(eos,))
    samples = NativeRolloutEngine(trainer.model, trainer.device).generate([p for _, (p, _) in mine], sampling)
    counts = torch.zeros(2, len(operations))  # [correct, total] per operation
    for sample, (op, (_, answer)) in zip(samples, mine):
        counts[0, operations.index(op)] += float(sample.completion_ids == answer)
        counts[1, operations.index(op)] += 1
    if dist.is_initialized():
        dist.all_reduce(counts)
    return {op: (counts[0, i] / counts[1, i].clamp(min=1)).item() for i, op in enumerate(operations)}


def _split_development(rows: list[dict], per_operation: int) -> tuple[dict[str, list[dict]], list[dict]]:
    """({operation: its first `per_operation` rows}, the other rows): the development problems that
    decide when the warm start stops are kept out of its training."""
    development: dict[str, list[dict]] = {}
    rest = []
    for row in rows:
        chosen = development.setdefault(row["operation"], [])
        (chosen if len(chosen) < per_operation else rest).append(row)
    return development, rest


def _rank0_sees(path: Path) -> bool:
    """Whether `path` exists on rank 0's file system, told to every rank (so all take one branch)."""
    seen = [path.exists()]
    if dist.is_initialized():
        dist.broadcast_object_list(seen, src=0)
    return seen[0]


def _files_under(paths: list[Path]) -> list[Path]:
    return [f for p in paths for f in (sorted(q for q in p.rglob("*") if q.is_file()) if p.is_dir() else [p])]


def _share_with_other_nodes(paths: list[Path]) -> None:
    """Give the files rank 0 has under `paths` to the ranks that do not see them: those on another
    machine, when the cache directory is not on a file system all the nodes share (the default
    cache is relative to each node's working directory). Every rank calls it; it ends in a barrier."""
    if not dist.is_initialized():
        return
    missing = [None] * dist.get_world_size()
    dist.all_gather_object(missing, not all(p.exists() for p in paths))
    if any(missing):
        contents = [{str(f): f.read_bytes() for f in _files_under(paths)} if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(contents, src=0)
        if missing[dist.get_rank()]:
            # config.json last: a model directory with one is complete. Ranks of one node write the
            # same bytes, each through a file of its own renamed into place.
            for name, data in sorted(contents[0].items(), key=lambda item: item[0].endswith("config.json")):
                with atomic_file(name) as f:
                    f.write(data)
    _barrier()


def prepare_demo(demo, parallel, seed: int, rank: int, log=print) -> DemoFiles:
    """Make (or reuse from the cache) the warm-started demo model and its task data. Rank 0 makes
    them; ranks on machines that do not see its cache directory get a copy."""
    root = Path(demo.cache_dir) / _cache_key(demo, seed)
    files = DemoFiles(root / SFT_MODEL, root / TRAIN_FILE, root / HELD_OUT_FILE)
    made = [files.model_dir, files.train_path, files.held_out_path]
    if _rank0_sees(files.model_dir / "config.json"):
        _share_with_other_nodes(made)
        log(f"demo: using the cached warm start in {files.model_dir}")
        return files
    if rank == 0:
        train_rows, held_out_rows = arithmetic_splits(demo.task)
        write_jsonl(train_rows, files.train_path)
        write_jsonl(held_out_rows, files.held_out_path)
        _write_init_model(demo, root / "init", seed)
    _barrier()
    packaged = packaged_warm_start(demo, seed)
    if packaged.exists():
        if rank == 0:
            _install_packaged_warm_start(root / "init", packaged, files.model_dir)
        _share_with_other_nodes(made)
        log(f"demo: using the warm start shipped with archon ({packaged.name}), in {files.model_dir}")
        return files
    _share_with_other_nodes([root / "init", files.train_path, files.held_out_path])  # every rank trains from them
    log(f"demo: warm-starting a {demo.num_hidden_layers}-layer Qwen3 by SFT (at most {demo.sft_steps} steps)")
    trainer = Trainer(
        TrainerConfig(
            model_path=str(root / "init"),
            lora=None,
            parallel=parallel,
            optim=OptimConfig(lr=demo.sft_lr, weight_decay=0.0, max_grad_norm=1.0),
            seed=seed,
        )
    )
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(root / "init")

    def encode(row: dict) -> tuple[list[int], list[int]]:
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return tokenizer.encode(row["prompt"], add_special_tokens=False), answer

    rows = [json.loads(line) for line in files.train_path.read_text().splitlines()]
    development, sft_rows = _split_development(rows, demo.sft_dev_examples)
    dev = {op: [encode(r) for r in op_rows] for op, op_rows in development.items()}
    examples = [encode(r) for r in sft_rows]
    rng = random.Random(seed)
    dp_rank, dp = trainer.dims.dp_rank, trainer.dims.dp
    checks_at_target = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the float arithmetic of the warm start then does not depend on the core count
    try:
        for step in range(demo.sft_steps):
            chosen = rng.sample(examples, demo.sft_batch_size)[dp_rank::dp]
            batch = PackedBatch.from_sequences([p + a for p, a in chosen], prompt_lens=[len(p) for p, _ in chosen])
            metrics = trainer.train_step(batch, _sft_loss)
            if (step + 1) % demo.sft_check_every == 0 or step + 1 == demo.sft_steps:
                accuracy = _greedy_accuracy_by_operation(trainer, dev, tokenizer.eos_token_id)
                shown = ", ".join(f"{op} {value:.2f}" for op, value in accuracy.items())
                log(f"demo SFT step {step + 1}/{demo.sft_steps}: nll {metrics['loss']:.3f}, greedy accuracy {shown}")
                checks_at_target = checks_at_target + 1 if min(accuracy.values()) >= demo.sft_target_accuracy else 0
                if checks_at_target == demo.sft_checks_at_target:
                    break
    finally:
        torch.set_num_threads(threads)
    save_merged_hf(
        trainer.model, trainer.converter, files.model_dir, trainer.loaded.hf_config.to_dict(), root / "init",
        write=rank == 0,
    )  # fmt: skip
    _share_with_other_nodes(made)
    del trainer
    return files


@dataclasses.dataclass
class WarmStartSettings:
    """What `python -m archon.rl.demo` warm-starts: the demo settings and the seed (the run's)."""

    demo: DemoConfig
    seed: int


def main(argv: list[str] | None = None) -> None:
    """Warm-start the demo model of the given settings (recipes/configs/demo.yaml's by default) on one
    process and write its weights where archon ships them."""
    import tempfile

    import tyro

    config = load_config_file(DEMO_CONFIG)
    settings = tyro.cli(WarmStartSettings, default=WarmStartSettings(config.demo, config.seed), args=argv)
    with tempfile.TemporaryDirectory() as cache_dir:
        demo = dataclasses.replace(settings.demo, cache_dir=cache_dir)
        target = packaged_warm_start(demo, settings.seed)
        target.unlink(missing_ok=True)  # warm-start anew rather than reuse it
        files = prepare_demo(demo, config.parallel, settings.seed, rank=0)
        shutil.copyfile(files.model_dir / "model.safetensors", target)
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
