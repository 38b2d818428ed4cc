"""The Tinker API's overhead: the same work through the server and the SDK, and called in process.

    python benchmarks/tinker_api.py [--base-model DIR] [--repeats 5] [--batch 8] [--seq-len 128] [--quick]

Training: forward_backward + optim_step (cross_entropy on `batch` random sequences of `seq-len`
tokens) through `tinker.ServiceClient` against `archon.serve` on loopback, against the server's own
backend methods on the same batch with no HTTP, protobuf or futures (the same model, adapter and
AdamW step). Sampling: `sample` of `batch` sequences of `seq-len // 2` new tokens from a prompt
through the SDK, against the built-in engine's `generate` with the same settings.
Without --base-model a tiny random Qwen3 is made in a temporary directory (its figures say little
about a real model). The four arms alternate (benchmarks/arms.py: one measurement of each per round,
the order reversed every other round), `repeats` rounds after one warm-up. Each ratio (SDK seconds /
in-process seconds) is taken within a round and reported as the median with its min and max; the
training ratio's verdict against the goal (at most 1.1, an API overhead of at most 10 %) is printed
only where the rounds agree. `--quick` (one round) checks the script and measures nothing. The last
line is JSON.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

import torch  # noqa: E402
import tyro  # noqa: E402
from arms import Ratio, describe, goal_verdict, run_arms, verdict_line  # noqa: E402

TRAIN_GOAL = 1.1
"""SDK seconds / in-process seconds of forward_backward + optim_step: an API overhead of at most 10 %."""

API_KEY = "tml-benchmark"


@dataclass
class Args:
    base_model: str | None = None
    """An HF checkpoint directory (default: a tiny random Qwen3)."""
    repeats: int = 5
    """Measured rounds (at least 5, benchmarks/arms.MIN_REPEATS, unless --quick)."""
    quick: bool = False
    """One round: checks the script, measures nothing."""
    batch: int = 8
    seq_len: int = 128
    device: str = "cpu"
    rank: int = 16


def _timed(run):
    def arm() -> float:
        start = time.perf_counter()
        run()
        return time.perf_counter() - start

    return arm


def main(argv: list[str] | None = None) -> dict:
    import tinker

    from archon.rollout.base import SamplingParams
    from archon.serve.config import ServeConfig
    from archon.serve.server import start_server
    from archon.serve.wire import ForwardBackwardCall, WireDatum, WireTensor
    from archon.tools.align import make_tiny_hf_checkpoint

    args = tyro.cli(Args, args=argv)
    with tempfile.TemporaryDirectory(prefix="tinker_api_") as tmp:
        base = args.base_model or str(make_tiny_hf_checkpoint("qwen3", Path(tmp) / "hf", max_position_embeddings=4096))
        config = ServeConfig(base_model=base, port=0, api_key=API_KEY, device=args.device, max_lora_rank=args.rank)
        config.checkpoint_dir = str(Path(tmp) / "checkpoints")
        server = start_server(config)
        backend = server.backend
        service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
        client = service.create_lora_training_client(base_model=base, rank=args.rank).result()
        generator = torch.Generator().manual_seed(0)
        sequences = torch.randint(backend.vocab_size, (args.batch, args.seq_len + 1), generator=generator).tolist()
        data = [
            tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * args.seq_len},
            )
            for s in sequences
        ]
        adam = tinker.types.AdamParams(learning_rate=1e-4)
        call = ForwardBackwardCall(
            client.model_id,
            0,
            "cross_entropy",
            {},
            False,
            [
                WireDatum(
                    s[:-1],
                    {
                        "target_tokens": WireTensor(torch.tensor(s[1:]).numpy(), "int64"),
                        "weights": WireTensor(torch.ones(args.seq_len).numpy(), "float32"),
                    },
                )
                for s in sequences
            ],
        )

        def through_sdk() -> None:
            step = client.forward_backward(data, "cross_entropy")
            client.optim_step(adam).result()
            step.result()

        def in_process() -> None:
            server.futures.run_now(lambda: (backend.forward_backward(call), backend.optim_step(client.model_id, {})))

        sampler = client.save_weights_and_get_sampling_client().result()
        prompt, new_tokens = sequences[0][: args.seq_len // 2], args.seq_len // 2
        params = tinker.types.SamplingParams(max_tokens=new_tokens, seed=0, stop=[])

        def sample_sdk() -> None:
            sampler.sample(tinker.types.ModelInput.from_ints(prompt), args.batch, params).result()

        engine_params = SamplingParams(max_new_tokens=new_tokens, n=args.batch, seed=0)
        sampler_state = backend.samplers[sampler._sampling_session_id]

        def sample_engine() -> None:
            def run():
                engine = backend.engine_for(sampler_state)
                engine.max_batch_sequences = args.batch
                engine.generate([prompt], engine_params)

            server.futures.run_now(run)

        arms = {
            "train_sdk": _timed(through_sdk),
            "train_in_process": _timed(in_process),
            "sample_sdk": _timed(sample_sdk),
            "sample_engine": _timed(sample_engine),
        }
        ratios = [Ratio("train", "train_sdk", "train_in_process"), Ratio("sample", "sample_sdk", "sample_engine")]
        threads = int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads()))
        repeats = 1 if args.quick else args.repeats
        result = run_arms(arms, ratios, repeats=repeats, warmup=1, quick=args.quick, threads=threads)
        service.close("success").result()
        server.shutdown()
        server.server_close()
    tokens = {"train": args.batch * args.seq_len, "sample": args.batch * new_tokens}
    rates = {
        f"{arm}_tokens_per_s": tokens[arm.split("_")[0]] / statistics.median(samples)
        for arm, samples in result.samples.items()
    }
    train, sample = result.ratios["train"], result.ratios["sample"]
    print(describe(train, "train: SDK seconds / in-process seconds"), flush=True)
    print(verdict_line(train, goal_verdict(train, TRAIN_GOAL), "train overhead"), flush=True)
    print(describe(sample, "sample: SDK seconds / engine seconds"), flush=True)
    report = {"args": vars(args), "device": args.device, **rates, "comparison": result.to_json()}
    print(json.dumps(report), flush=True)
    return report


if __name__ == "__main__":
    main()
