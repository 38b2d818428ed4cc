"""Asynchronous RL: the staleness bound, the producer's gating, the adapter history, and the
synchronous limit (the producer at staleness 0 trains on exactly what the synchronous loop does)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from archon.lora import lora_parameters
from archon.rl.config import parse_config, validate
from archon.rl.producer import RolloutProducer, Rollouts
from archon.rl.versions import AdapterHistory, stale_groups


def test_stale_groups_are_those_with_a_sample_older_than_the_bound():
    # groups of 2; trainer at version 5; bound 2: versions 3, 4, 5 are trainable, 2 is not
    versions = [5, 5, 4, 3, 3, 2, 2, 2]
    assert stale_groups(versions, 2, trainer_version=5, max_staleness=2) == [2, 3]
    assert stale_groups(versions, 2, trainer_version=5, max_staleness=3) == []
    assert stale_groups(versions, 2, trainer_version=5, max_staleness=0) == [1, 2, 3]


@pytest.mark.parametrize("max_staleness", [1, 2])
def test_producer_starts_step_k_only_with_version_k_minus_n_and_runs_ahead(max_staleness):
    started: dict[int, int] = {}  # step -> version published when its generation began
    version = {"now": 0}
    began = {k: threading.Event() for k in range(6)}

    def generate(step: int) -> Rollouts:
        started[step] = version["now"]
        began[step].set()
        return Rollouts(step, [], [], {"step": step}, 0.0)

    producer = RolloutProducer(generate, first=0, last=6, max_staleness=max_staleness, version=0)
    try:
        # before any update the producer makes steps 0..N and no more
        assert began[max_staleness].wait(10)
        assert not began[max_staleness + 1].wait(0.2)
        for step in range(6):
            assert producer.take(step).step == step
            # the trainer "trains" step `step`, then publishes version step + 1
            version["now"] = step + 1
            producer.published(step + 1)
        assert all(started[k] >= k - max_staleness for k in range(6)), started
        assert any(started[k] < k for k in range(6)), started  # it did run ahead
    finally:
        producer.close()


def test_producer_errors_reach_the_trainer_naming_the_step():
    def generate(step: int) -> Rollouts:
        raise ConnectionError("server gone")

    producer = RolloutProducer(generate, first=3, last=5, max_staleness=1, version=3)
    with pytest.raises(RuntimeError, match="rollouts of RL step 4 failed") as error:
        producer.take(3)
    assert isinstance(error.value.__cause__, ConnectionError)
    producer.close()


def test_adapter_history_swaps_a_recorded_version_in_and_back_out(tiny_checkpoint, lora_model):
    from archon.lora import LoRAConfig

    model = lora_model(tiny_checkpoint("qwen3"), LoRAConfig(rank=4, alpha=8.0)).model
    params = lora_parameters(model)
    history = AdapterHistory(keep=2)
    history.record(model, 1)
    at_1 = {k: p.detach().clone() for k, p in params.items()}
    with torch.no_grad():
        for p in params.values():
            p.add_(1.0)
    history.record(model, 2)
    now = {k: p.detach().clone() for k, p in params.items()}
    with history.swapped_in(model, 1):
        assert all(torch.equal(params[k], at_1[k]) for k in params)
    assert all(torch.equal(params[k], now[k]) for k in params)
    history.record(model, 3)
    assert 1 not in history and 2 in history and 3 in history


def test_async_mode_on_the_built_in_engine_needs_one_process_and_the_proximal_policy(tmp_path):
    parse_config(["--rollout.max-staleness", "1", "--logging.run-dir", str(tmp_path / "r")])  # one process
    with pytest.raises(ValueError, match=r"rollout.max_staleness=1: with rollout.engine='native' .* on 2 process"):
        validate(parse_config(["--logging.run-dir", str(tmp_path / "r"), "--rollout.max-staleness", "1"]), 2)
    with pytest.raises(ValueError, match=r"rollout.max_staleness=-1: must be 0 or more"):
        parse_config(["--rollout.max-staleness", "-1", "--logging.run-dir", str(tmp_path / "r")])
    with pytest.raises(ValueError, match=r"algorithm.recompute_old_logprobs=False:.*proximal policy"):
        parse_config(
            [
                "--rollout.max-staleness",
                "2",
                "--rollout.engine",
                "vllm",
                "--algorithm.no-recompute-old-logprobs",
                "--logging.run-dir",
                str(tmp_path / "r"),
            ]
        )


def test_the_producer_at_staleness_0_trains_on_what_the_synchronous_loop_does(tmp_path):
    """The same run through the background producer with max_staleness 0 and through the
    synchronous loop: the metrics (all but timings) and the final adapter are bit-identical."""
    from test_grpo_recipe import _args, write_tiny_setup

    from archon.rl.loop import RLRun
    from archon.rl.run import collect, loop

    def producers_at_staleness_0(ctx, tasks, steps):
        for task in tasks:
            task.producer = RolloutProducer(
                lambda step, task=task: collect.begin_rollouts(ctx, task, step),
                task.version,
                task.version + steps,
                0,
                version=task.version,
            )

    class ProducerRun(RLRun):
        def run(self):
            start = loop.start_producers
            loop.start_producers = producers_at_staleness_0
            try:
                return super().run()
            finally:
                loop.start_producers = start

    root = write_tiny_setup(tmp_path / "setup")
    results = []
    for run_cls, name in ((RLRun, "sync"), (ProducerRun, "producer")):
        args = _args(root, tmp_path / name, steps=3) + ["--eval.every", "0", "--algorithm.minibatches", "2"]
        run = run_cls(parse_config(args))
        run.run()
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        untimed = [
            {k: v for k, v in r.items() if not (k.endswith("_s") or "idle" in k or k == "tokens_per_s")}
            for r in records
        ]
        results.append((untimed, {k: p.detach().clone() for k, p in lora_parameters(run.trainer.model).items()}))
        assert (run.tasks[0].producer is not None) == (name == "producer")
    (sync_metrics, sync_lora), (producer_metrics, producer_lora) = results
    assert producer_metrics == sync_metrics
    assert all(torch.equal(sync_lora[k], producer_lora[k]) for k in sync_lora)
    assert all(r["version_lag_max"] == 0 and r["stale_samples_dropped"] == 0 for r in producer_metrics)


@pytest.mark.parametrize(
    "model_type, flags, culprit",
    [
        (
            "qwen3_moe",
            [],
            "rollout.vllm.transport='disk': the model is served merged (rollout.vllm.mode is unset: "
            "its family is served merged)",
        ),
        (
            "qwen3",
            ["--rollout.max-staleness", "2", "--rollout.vllm.max-loras", "1"],
            "rollout.vllm.max_loras=1: with rollout.max_staleness=2 the requests in flight keep their adapter",
        ),
    ],
)
def test_vllm_mode_and_transport_problems_are_found_before_any_server_starts(
    tiny_checkpoint, tmp_path, model_type, flags, culprit
):
    path = tiny_checkpoint(model_type)
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    args = [
        "--model.path",
        str(path),
        "--data.path",
        str(tmp_path / "train.jsonl"),
        "--rollout.engine",
        "vllm",
        "--logging.run-dir",
        str(tmp_path / "run"),
        *flags,
    ]
    with pytest.raises(ValueError, match="invalid configuration") as error:
        parse_config(args)
    assert culprit in str(error.value), str(error.value)
    assert not (tmp_path / "run").exists()


def test_collect_drops_and_samples_again_the_groups_older_than_the_bound(tmp_path):
    """Rollouts that arrive with a group older than trainer version - N (the producer's gating
    prevents it; this is the guard behind it): that group is sampled again under the current
    adapter, the others are kept as they are, and the drop is counted."""
    import dataclasses

    from test_grpo_recipe import _args, write_tiny_setup

    from archon.rl.loop import RLRun

    root = write_tiny_setup(tmp_path / "setup")
    run = RLRun(parse_config(_args(root, tmp_path / "run", steps=4) + ["--eval.every", "0"]))
    try:
        (task,) = run.tasks
        task.config = dataclasses.replace(task.config, max_staleness=1)
        run.publish(task, 3)  # the trainer holds version 3: samples of versions 2 and 3 are trainable
        made = run.generate_rollouts(task, 3)
        G = run.config.rollout.group_size
        kept_before = [list(s.completion_ids) for s in made.samples[G:]]
        for i, sample in enumerate(made.samples):
            version = 0 if i < G else 2  # group 0 too old, the others one version behind
            sample.version, sample.token_versions = version, [version] * len(sample.completion_ids)

        class Ahead:  # a producer that made this step's rollouts long ago
            def take(self, step):
                return made

        task.producer = Ahead()
        rollouts = run.collect(3)[task.name]
        assert rollouts.stale_dropped == G
        assert {s.version for s in rollouts.samples[:G]} == {3}
        assert all(s.prompt_index == 0 for s in rollouts.samples[:G])
        assert [s.version for s in rollouts.samples[G:]] == [2] * (len(made.samples) - G)
        assert [list(s.completion_ids) for s in rollouts.samples[G:]] == kept_before
    finally:
        task.producer = None
        run.close()
