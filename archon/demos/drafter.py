"""The arithmetic demo's draft head for speculative decoding (archon/rollout/drafter.py), distilled
on the demo base's own outputs.

The base is the demo's warm start (archon/demos/warm_start.py). Over the demo's training prompts it
generates one greedy completion and `sampled_per_prompt` sampled ones (temperature 1, the demo's
max_new_tokens); the head is then fitted to the base's distributions at those tokens
(`distill_draft_head`). The head is tied to the base's weights (it reads the base's embedding and
scores through its head), so archon ships it beside the warm start it was made for:
`drafters/<digest>.safetensors`, the digest of the warm start's settings and the head's.

    python -m archon.demos.drafter                     # write the demo's draft head
    python -m archon.demos.drafter --steps 500         # other settings: another file

A run uses it with rollout.speculative.method=draft_head and draft_head_path set to the file
(`packaged_drafter` says where it is).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

from archon.build import build_model
from archon.demos import DEMO_CONFIG
from archon.demos.warm_start import DemoFiles, _cache_key, prepare_demo
from archon.rl.config import DemoConfig, load_config_file
from archon.rollout.base import SamplingParams
from archon.rollout.drafter import DraftHead, DraftHeadDrafter, distill_draft_head, save_draft_head
from archon.rollout.native import NativeRolloutEngine

PACKAGED_DRAFTERS = Path(__file__).resolve().parent / "drafters"


@dataclasses.dataclass
class DraftHeadSettings:
    """What makes the draft head (besides the warm start's settings)."""

    hidden_dim: int = 512
    """The head's MLP width."""
    depth: int = 3
    """Draft depths the head is trained for (the draft tokens per round it serves best)."""
    sampled_per_prompt: int = 2
    """Sampled completions (temperature 1) per training prompt, beside the greedy one."""
    max_new_tokens: int = 5
    """Completion length limit of the base's outputs (the demo's rollout.max_new_tokens)."""
    num_prompts: int = 0
    """Training prompts used, the first ones of the demo's training split (0: all)."""
    steps: int = 4000
    """Adam steps of the first phase, the KL divergence to the base's distributions (constant lr)."""
    batch_size: int = 512
    lr: float = 3e-3
    tv_steps: int = 800
    """Adam steps of the second phase, the total variation distance to the base's distributions (what
    a sampled draft's rejection probability is), the lr decaying from tv_lr to 0."""
    tv_lr: float = 1e-3


@dataclasses.dataclass
class DrafterCommand:
    """What `python -m archon.demos.drafter` makes: the demo settings, the seed and the head's settings."""

    demo: DemoConfig
    seed: int
    head: DraftHeadSettings = dataclasses.field(default_factory=DraftHeadSettings)
    out_dir: str | None = None
    """Where to write the head (default: where archon ships it, archon/demos/drafters)."""
    held_out_samples: int = 8
    """Sampled completions (temperature 1) per held-out problem with which the written head's
    acceptance is measured (0: not measured)."""


def drafter_key(demo, seed: int, head: DraftHeadSettings) -> str:
    """The digest of the warm start's settings and the head's."""
    settings = json.dumps(
        {"warm_start": _cache_key(demo, seed), "head": dataclasses.asdict(head)}, sort_keys=True, default=str
    )
    return hashlib.sha256(settings.encode()).hexdigest()[:12]


def packaged_drafter(demo, seed: int, head: DraftHeadSettings | None = None) -> Path:
    """Where archon ships the draft head of these settings (the file may not exist)."""
    return PACKAGED_DRAFTERS / f"{drafter_key(demo, seed, head or DraftHeadSettings())}.safetensors"


def _demo_sampling(head: DraftHeadSettings, tokenizer, temperature: float, n: int, seed: int) -> SamplingParams:
    """The demo's completions as the head is distilled and scored on: up to the end token."""
    return SamplingParams(
        max_new_tokens=head.max_new_tokens,
        temperature=temperature,
        n=n,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=seed,
    )


def base_outputs(
    model, tokenizer, prompts: list[str], head: DraftHeadSettings, seed: int
) -> list[tuple[list[int], int]]:
    """The base's greedy and sampled completions of `prompts`: (prompt + completion ids, prompt length)."""
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    # The schedule the shipped head's completions were sampled with: with more samples than rows,
    # which sample takes which draw depends on when ended rows are seen (one generator per call).
    engine = NativeRolloutEngine(model, stop_check_interval=8)
    sequences = []
    for temperature, n in ((0.0, 1), (1.0, head.sampled_per_prompt)):
        if n == 0:
            continue
        sampling = _demo_sampling(head, tokenizer, temperature, n, seed)
        for sample in engine.generate(ids, sampling):
            sequences.append((sample.prompt_ids + sample.completion_ids, len(sample.prompt_ids)))
    return sequences


def make_draft_head(files: DemoFiles, head: DraftHeadSettings, seed: int, log=print) -> DraftHead:
    """Distil a draft head for the demo base in `files` on its training prompts (one thread: the
    float arithmetic then does not depend on the core count)."""
    from transformers import AutoTokenizer

    model = build_model(str(files.model_dir), lora=None).model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(files.model_dir)
    prompts = [json.loads(line)["prompt"] for line in files.train_path.read_text().splitlines()]
    prompts = prompts[: head.num_prompts or None]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        sequences = base_outputs(model, tokenizer, prompts, head, seed)
        log(f"drafter: {len(sequences)} base outputs over {len(prompts)} training prompts")
        draft = DraftHead(model.embed_tokens.weight.shape[-1], head.hidden_dim)
        distill_draft_head(
            model,
            sequences,
            draft,
            head.depth,
            head.steps,
            head.batch_size,
            head.lr,
            seed,
            head.tv_steps,
            head.tv_lr,
            log,
        )
    finally:
        torch.set_num_threads(threads)
    return draft


def held_out_acceptance(
    files: DemoFiles, draft: DraftHead, head: DraftHeadSettings, samples: int, seed: int
) -> dict[str, list[float | None]]:
    """The acceptance per draft position (`DraftHeadDrafter.acceptance_by_position`, `head.depth`
    drafts a round) of the demo base with `draft` on the demo's held-out problems, which the head
    was not distilled on: greedy (one completion each) and sampled (temperature 1, `samples` each)."""
    from transformers import AutoTokenizer

    model = build_model(str(files.model_dir), lora=None).model.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(files.model_dir)
    rows = [json.loads(line) for line in files.held_out_path.read_text().splitlines()]
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    acceptance = {}
    for name, temperature, n in (("greedy", 0.0, 1), ("sampled", 1.0, samples)):
        drafter = DraftHeadDrafter(model, draft, head.depth)
        engine = NativeRolloutEngine(model, max_batch_sequences=len(prompts) * n, drafter=drafter)
        sampling = _demo_sampling(head, tokenizer, temperature, n, seed)
        engine.generate(prompts, sampling)
        acceptance[name] = drafter.acceptance_by_position()
    return acceptance


def main(argv: list[str] | None = None) -> Path:
    """Make the draft head of the given settings (recipes/configs/demo.yaml's by default) and write
    it where archon ships it (or to --out-dir)."""
    import tyro

    config = load_config_file(DEMO_CONFIG)
    command = tyro.cli(
        DrafterCommand, default=DrafterCommand(config.demo, config.seed), args=sys.argv[1:] if argv is None else argv
    )
    key = drafter_key(command.demo, command.seed, command.head)
    target = (Path(command.out_dir) if command.out_dir else PACKAGED_DRAFTERS) / f"{key}.safetensors"
    settings = {"warm_start": _cache_key(command.demo, command.seed), "head": dataclasses.asdict(command.head)}
    with tempfile.TemporaryDirectory() as cache_dir:
        demo = dataclasses.replace(command.demo, cache_dir=cache_dir)
        files = prepare_demo(demo, config.parallel, command.seed, rank=0)
        draft = make_draft_head(files, command.head, command.seed)
        target.parent.mkdir(parents=True, exist_ok=True)
        save_draft_head(draft, target, settings)
        print(f"wrote {target}")
        if command.held_out_samples > 0:
            acceptance = held_out_acceptance(files, draft, command.head, command.held_out_samples, command.seed)
            print(f"held-out acceptance by draft position: {json.dumps(acceptance)}")
    return target


if __name__ == "__main__":
    main()
