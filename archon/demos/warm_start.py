"""The built-in demos' warm start: a small Qwen3 model taught the demo's task by a short SFT.

Everything is made locally (tokenizer, random-init model, task data), trained with the same Engine
the RL loop uses (full fine-tuning, FSDP over the ranks), and cached by its settings so later runs
skip it. The arithmetic demo (demo.kind "arithmetic") has a character tokenizer and learns the
answers; the code-tool demo (archon.demos.code_tool) has a BPE tokenizer learnt from its
conversations, shipped beside its weights, and learns to call the python tool on some problems; the
reasoning-gym demo (demo.kind "reasoning_gym", archon.demos.reasoning_gym) has the character
tokenizer and learns a reasoning-gym task's answers in its <answer> </answer> format.

The SFT is chaotic: its float arithmetic (vector width, thread count, kernels) differs between
machines, the runs part within a few dozen steps, and the accuracy rises in a sudden jump whose step
differs from run to run, so models stopped at the same target learn at very different speeds under
RL. For the settings the demo and the tests use, archon therefore ships the warm start's weights
(`warm_starts/<settings digest>.safetensors`, written by `python -m archon.demos.warm_start`), and
every machine starts RL from the same model. Other settings are warm-started here.

    python -m archon.demos.warm_start                          # write the demo's warm start
    python -m archon.demos.warm_start --demo.task.operations + - --demo.task.num-held-out 600 --seed 0
    python -m archon.demos.warm_start --config recipes/configs/code_tool_demo.yaml   # the code-tool demo's
    python -m archon.demos.warm_start --config recipes/configs/reasoning_gym_demo.yaml   # the reasoning-gym demo's
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from archon.batch import PackedBatch
from archon.build import build_model
from archon.checkpoint.atomic import atomic_file, replace_directory
from archon.checkpoint.hf_weights import save_merged_hf
from archon.demos import DEMO_CONFIG, code_tool, reasoning_gym
from archon.rl.config import DemoConfig, load_config_file
from archon.rl.data.tasks import arithmetic_splits, build_char_tokenizer, write_jsonl
from archon.rl.run.batches import rollout_batch
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.trainer import LossContext, OptimConfig, Trainer, TrainerConfig

PACKAGED_WARM_STARTS = Path(__file__).resolve().parent / "warm_starts"
SFT_MODEL = "sft"
TRAIN_FILE = "train.jsonl"
HELD_OUT_FILE = "held_out.jsonl"
SFT_CONVERSATIONS_FILE = "sft_conversations.jsonl"
"""The code-tool warm start's conversations, with the sandbox's outputs (made once, on rank 0)."""
CODE_TOOL_CONTEXT = 256
CONTEXT = {"arithmetic": 128, "code_tool": CODE_TOOL_CONTEXT, "reasoning_gym": 256}
"""The demo model's max_position_embeddings, by kind."""


@dataclasses.dataclass
class DemoFiles:
    model_dir: Path
    train_path: Path
    held_out_path: Path


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _cache_key(demo, parallel_seed: int) -> str:
    """A digest of the settings that make the warm start (where it is stored is not one of them, nor
    are the other kinds'). The arithmetic demo's is what it was before there were kinds, and the
    code-tool demo's what it was before the reasoning-gym kind, so their shipped warm starts keep
    their names."""
    settings = {k: v for k, v in dataclasses.asdict(demo).items() if k != "cache_dir"}
    other_kinds = {
        "arithmetic": ("kind", "code_tool", "reasoning_gym"),
        "code_tool": ("task", "sft_target_accuracy", "sft_checks_at_target", "sft_dev_examples", "reasoning_gym"),
        "reasoning_gym": ("task", "code_tool"),
    }
    for name in other_kinds[demo.kind]:
        del settings[name]
    settings = json.dumps({"demo": settings, "seed": parallel_seed}, sort_keys=True, default=str)
    return hashlib.sha256(settings.encode()).hexdigest()[:12]


def packaged_warm_start(demo, seed: int) -> Path:
    """Where archon ships the warm start of these settings (the file may not exist)."""
    return PACKAGED_WARM_STARTS / f"{_cache_key(demo, seed)}.safetensors"


def packaged_tokenizer(demo, seed: int) -> Path:
    """Where archon ships the code-tool warm start's tokenizer (tokenizer.json), beside its weights:
    BPE training may not merge alike everywhere, and the weights are tied to its ids."""
    return PACKAGED_WARM_STARTS / f"{_cache_key(demo, seed)}.tokenizer.json"


def _install_packaged_warm_start(init_dir: Path, weights: Path, model_dir: Path) -> None:
    """model_dir: the initial model's config and tokenizer with the packaged weights, in one rename."""
    staging = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(init_dir, staging)
    shutil.copyfile(weights, staging / "model.safetensors")
    replace_directory(staging, model_dir)


def _write_init_model(demo, out_dir: Path, seed: int, tokenizer) -> None:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=demo.hidden_size,
        intermediate_size=demo.intermediate_size,
        num_hidden_layers=demo.num_hidden_layers,
        num_attention_heads=demo.num_attention_heads,
        num_key_value_heads=demo.num_key_value_heads,
        head_dim=demo.hidden_size // demo.num_attention_heads,
        max_position_embeddings=CONTEXT[demo.kind],
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
    packaged = packaged_warm_start(demo, seed)
    if rank == 0:
        if demo.kind == "reasoning_gym":
            tokenizer = build_char_tokenizer()
            train_rows, held_out_rows, left_out = reasoning_gym.sft_rows(demo.reasoning_gym, tokenizer)
            log(f"demo: {len(train_rows)} warm-start problems ({left_out} left out for asking a held-out question)")
        else:
            task = demo.task if demo.kind == "arithmetic" else demo.code_tool.task
            train_rows, held_out_rows = arithmetic_splits(task)
        write_jsonl(train_rows, files.train_path)
        write_jsonl(held_out_rows, files.held_out_path)
        if demo.kind == "arithmetic":
            tokenizer = build_char_tokenizer()
        elif demo.kind == "code_tool":
            tokenizer = _code_tool_tokenizer(demo, seed, train_rows, root / SFT_CONVERSATIONS_FILE, log)
        _write_init_model(demo, root / "init", seed, tokenizer)
    _barrier()
    if packaged.exists():
        if rank == 0:
            _install_packaged_warm_start(root / "init", packaged, files.model_dir)
        _share_with_other_nodes(made)
        log(f"demo: using the warm start shipped with archon ({packaged.name}), in {files.model_dir}")
        return files
    sft_inputs = [root / "init", files.train_path, files.held_out_path]
    if demo.kind == "code_tool":
        sft_inputs.append(root / SFT_CONVERSATIONS_FILE)
    _share_with_other_nodes(sft_inputs)  # every rank trains from them
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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the float arithmetic of the warm start then does not depend on the core count
    try:
        if demo.kind in ("arithmetic", "reasoning_gym"):
            rows = [json.loads(line) for line in files.train_path.read_text().splitlines()]
            _arithmetic_sft(demo, trainer, tokenizer, rows, seed, log)
        else:
            plans = [json.loads(line) for line in (root / SFT_CONVERSATIONS_FILE).read_text().splitlines()]
            _code_tool_sft(demo, trainer, tokenizer, plans, seed, log)
    finally:
        torch.set_num_threads(threads)
    save_merged_hf(
        trainer.model,
        trainer.converter,
        files.model_dir,
        trainer.loaded.hf_config.to_dict(),
        root / "init",
        write=rank == 0,
    )
    _share_with_other_nodes(made)
    del trainer
    return files


def _arithmetic_sft(demo, trainer: Trainer, tokenizer, rows: list[dict], seed: int, log) -> None:
    """Train on (prompt, answer) pairs until every operation's development accuracy has been at the
    target for the checks in a row (the reasoning-gym demo's rows: the task is their one operation)."""

    def encode(row: dict) -> tuple[list[int], list[int]]:
        answer = tokenizer.encode(row["answer"], add_special_tokens=False) + [tokenizer.eos_token_id]
        return tokenizer.encode(row["prompt"], add_special_tokens=False), answer

    development, sft_rows = _split_development(rows, demo.sft_dev_examples)
    dev = {op: [encode(r) for r in op_rows] for op, op_rows in development.items()}
    examples = [encode(r) for r in sft_rows]
    rng = random.Random(seed)
    dp_rank, dp = trainer.dims.dp_rank, trainer.dims.dp
    checks_at_target = 0
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


def _code_tool_tokenizer(demo, seed: int, train_rows: list[dict], conversations_path: Path, log):
    """The code-tool demo's tokenizer, shipped or learnt; without shipped weights, also the warm
    start's conversations (with the sandbox's outputs) in `conversations_path`."""
    packaged = packaged_tokenizer(demo, seed)
    if packaged_warm_start(demo, seed).exists():
        if not packaged.exists():
            raise FileNotFoundError(
                f"{packaged_warm_start(demo, seed)} is shipped without its tokenizer {packaged}; write both again "
                "with python -m archon.demos.warm_start"
            )
        return code_tool.hf_tokenizer(packaged)
    plans = code_tool.plan_conversations(demo.code_tool, train_rows, seed)
    log(f"demo: running the warm start's {sum(p['code'] is not None for p in plans)} programs in the python sandbox")
    code_tool.run_tool_calls(plans)
    write_jsonl(plans, conversations_path)
    if packaged.exists():
        return code_tool.hf_tokenizer(packaged)
    log("demo: learning the BPE tokenizer's merges from the warm start's conversations")
    return code_tool.train_tokenizer(demo.code_tool, plans)


def _code_tool_sft(demo, trainer: Trainer, tokenizer, plans: list[dict], seed: int, log) -> None:
    """Train for sft_steps steps on the conversations, the loss on their assistant turns."""
    renderer = code_tool.demo_renderer(tokenizer)
    examples = [t.to_sample(0) for t in code_tool.sft_trajectories(renderer, plans)]
    rng = random.Random(seed)
    dp_rank, dp = trainer.dims.dp_rank, trainer.dims.dp
    for step in range(demo.sft_steps):
        chosen = rng.sample(examples, demo.sft_batch_size)[dp_rank::dp]
        metrics = trainer.train_step(rollout_batch(chosen, torch.zeros(len(chosen)), 0), _sft_loss)
        if (step + 1) % demo.sft_check_every == 0 or step + 1 == demo.sft_steps:
            log(f"demo SFT step {step + 1}/{demo.sft_steps}: nll {metrics['loss']:.3f}")


@dataclasses.dataclass
class WarmStartSettings:
    """What `python -m archon.demos.warm_start` warm-starts: the demo settings and the seed (the run's)."""

    demo: DemoConfig
    seed: int


def main(argv: list[str] | None = None) -> None:
    """Warm-start the demo model of the given settings (recipes/configs/demo.yaml's by default, or
    those of the file after a first `--config`) on one process and write its weights where archon
    ships them; a code-tool warm start also its tokenizer, and it reports the warm start's held-out
    success in the episode loop under the file's environment."""
    import tempfile

    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = DEMO_CONFIG
    if argv[:1] == ["--config"]:
        if len(argv) < 2:
            raise SystemExit("--config needs a file")
        config_path, argv = Path(argv[1]), argv[2:]
    config = load_config_file(config_path)
    settings = tyro.cli(WarmStartSettings, default=WarmStartSettings(config.demo, config.seed), args=argv)
    with tempfile.TemporaryDirectory() as cache_dir:
        demo = dataclasses.replace(settings.demo, cache_dir=cache_dir)
        target, tokenizer_target = packaged_warm_start(demo, settings.seed), packaged_tokenizer(demo, settings.seed)
        target.unlink(missing_ok=True)  # warm-start anew rather than reuse it
        tokenizer_target.unlink(missing_ok=True)
        files = prepare_demo(demo, config.parallel, settings.seed, rank=0)
        with atomic_file(target) as f:
            f.write((files.model_dir / "model.safetensors").read_bytes())
        print(f"wrote {target}")
        if demo.kind == "code_tool":
            with atomic_file(tokenizer_target) as f:
                f.write((files.model_dir / code_tool.TOKENIZER_FILE).read_bytes())
            print(f"wrote {tokenizer_target}")
            _report_code_tool_warm_start(files, config, demo)


def _report_code_tool_warm_start(files: DemoFiles, config, demo) -> None:
    if not config.environment.enabled:
        return
    loaded = build_model(str(files.model_dir), lora=None)
    tokenizer = code_tool.hf_tokenizer(files.model_dir / code_tool.TOKENIZER_FILE)
    rows = [json.loads(line) for line in files.held_out_path.read_text().splitlines()][: config.eval.max_prompts]
    figures = code_tool.episode_success(loaded.model, "cpu", tokenizer, rows, config.environment)
    shown = ", ".join(f"{name} {value:.3f}" for name, value in figures.items())
    print(
        f"held-out episodes of the warm start ({len(rows)} problems, tools {list(config.environment.tools)}): {shown}"
    )


if __name__ == "__main__":
    main()
