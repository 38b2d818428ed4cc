"""A producer that overlaps steps (rollout.max_staleness >= 1): step k+1's generation starts while
step k's longest samples still generate, every token stays within the staleness bound, and the
built-in engine generates on lanes of its own beside the trainer, where a publish under 'continue'
lands in a generation with each token's log-prob the trainer's under the token's version."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import pytest
import torch
from test_grpo_recipe import _args, write_tiny_setup
from test_partial_rollouts import _assert_logprobs_of_each_tokens_version, _versions

from archon.lora import LoRAConfig, lora_parameters
from archon.rl.config import RLConfig, parse_config
from archon.rl.run import collect as collect_module
from archon.rl.run.engines import RolloutLanes
from archon.rl.run.loop import RLRun
from archon.rl.run.producer import RolloutProducer, Rollouts
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, _Generation


def test_the_producer_starts_the_next_step_while_a_step_still_generates():
    """Step 0's generation holds until step 1's has begun (possible only if they overlap); at
    staleness 1 step 2 waits for version 1, however far step 1 has got."""
    began = {k: threading.Event() for k in range(3)}
    release = threading.Event()

    def begin(step: int):
        def generate() -> Rollouts:
            began[step].set()
            if step == 0:
                assert began[1].wait(10), "step 1 did not start while step 0 generated"
            if step == 1:
                assert release.wait(10)
            return Rollouts(step, [], [], {"step": step}, 0.0)

        return generate

    producer = RolloutProducer(begin, first=0, last=3, max_staleness=1, version=0)
    try:
        assert producer.take(0).step == 0
        assert not began[2].wait(0.2)  # version 1 is not published yet
        producer.published(1)
        assert began[2].wait(10)  # starts while step 1 still generates
        release.set()
        assert [producer.take(1).step, producer.take(2).step] == [1, 2]
    finally:
        release.set()
        producer.close()


def test_an_overlapping_step_that_fails_reaches_the_trainer_naming_its_step():
    def begin(step: int):
        def generate() -> Rollouts:
            if step == 1:
                raise ConnectionError("server gone")
            return Rollouts(step, [], [], {}, 0.0)

        return generate

    producer = RolloutProducer(begin, first=0, last=2, max_staleness=1, version=0)
    assert producer.take(0).step == 0
    with pytest.raises(RuntimeError, match="rollouts of RL step 2 failed") as error:
        producer.take(1)
    assert isinstance(error.value.__cause__, ConnectionError)
    producer.close()


def _held_overlapping_generations(monkeypatch, run: RLRun, timeline: dict) -> None:
    """Each step's generation, at its first decode step, holds until the next step's generation has
    begun (so steps overlap on any machine) and, if it began behind its step (version < step),
    until its lane holds the next version, which the trainer publishes only once the generation
    holds (so the publish lands in it). `timeline`: step -> [begin, end] times of its generation."""
    begin_rollouts, hold = collect_module.begin_rollouts, threading.local()
    drawn, holding = {}, {}

    def event(events: dict, step: int) -> threading.Event:
        return events.setdefault(step, threading.Event())

    publish = RolloutLanes.publish

    def publish_once_held(self, version):
        if 0 < version < run.config.steps:  # step `version` began a version behind
            assert event(holding, version).wait(60)
        publish(self, version)

    def begin(ctx, task, task_step, engine=None):
        behind = task.version < task_step
        generate = begin_rollouts(ctx, task, task_step, engine)

        def held() -> Rollouts:
            timeline[task_step] = [time.perf_counter(), None]
            # released here, not when the prompts are drawn: the previous step holds until this
            # generation has begun, whatever the scheduler does with this thread
            event(drawn, task_step).set()
            hold.step, hold.behind, hold.engine = task_step, behind, engine
            try:
                return generate()
            finally:
                timeline[task_step][1] = time.perf_counter()

        return held

    decode = _Generation._decode

    def held_decode(self, busy):
        step = getattr(hold, "step", None)
        if step is not None and self.engine is hold.engine:
            hold.step = None
            if hold.behind:
                event(holding, step).set()
            if step + 1 < run.config.steps:  # begins once the version this one began behind is published
                assert event(drawn, step + 1).wait(60)
            if hold.behind:
                deadline = time.monotonic() + 60
                while hold.engine._pending_update is None and time.monotonic() < deadline:
                    time.sleep(0.002)
        decode(self, busy)

    monkeypatch.setattr(collect_module, "begin_rollouts", begin)
    monkeypatch.setattr(_Generation, "_decode", held_decode)
    monkeypatch.setattr(RolloutLanes, "publish", publish_once_held)


@pytest.mark.parametrize("update_policy", ["finish", "continue"])
def test_native_async_run_overlaps_steps_and_keeps_every_token_within_the_bound(tmp_path, monkeypatch, update_policy):
    steps, staleness = 4, 1
    root = write_tiny_setup(tmp_path / "setup")
    args = _args(root, tmp_path / "run", steps) + ["--eval.every", "0", "--rollout.max-new-tokens", "8"]
    args += ["--rollout.max-staleness", str(staleness), "--rollout.update-policy", update_policy]
    run = RLRun(parse_config(args))
    trained, timeline = [], {}
    collect = run.collect

    def recorded(step):
        collected = collect(step)
        (rollouts,) = collected.values()
        trained.append((step, run.tasks[0].version, [s.token_versions for s in rollouts.samples]))
        return collected

    run.collect = recorded
    _held_overlapping_generations(monkeypatch, run, timeline)
    run.run()
    assert [step for step, *_ in trained] == list(range(steps))
    for step, trainer_version, token_versions in trained:
        assert trainer_version == step
        assert all(step - staleness <= v <= step for versions in token_versions for v in versions), (step, trained)
    # the next step began before this one's generation ended
    assert all(timeline[k + 1][0] < timeline[k][1] for k in range(steps - 1)), timeline
    mixed = [sum(len(set(v)) > 1 for v in versions) for _, _, versions in trained]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["mixed_version_samples"] for r in records if "step_s" in r] == mixed
    if update_policy == "finish":
        assert mixed == [0] * steps
        assert any(v < step for step, _, versions in trained for vs in versions for v in vs)  # it ran ahead
    else:  # the publishes landed in the generations of steps 1 on, which began a version behind
        assert mixed[0] == 0 and min(mixed[1:]) > 0, mixed


@pytest.mark.usefixtures("float64_math")
def test_a_publish_lands_in_a_lanes_generation_with_each_tokens_trainer_logprob(qwen3_path, monkeypatch):
    """A lane generates on a copy of the training model's adapter (the base weights shared): the
    trainer's in-place changes of every LoRA factor of every layer reach it only when published,
    and then at a step boundary, with its cached context computed again; each token's log-prob is
    the trainer's under the version that sampled it (float64, 1e-10)."""
    from archon.trainer import Trainer, TrainerConfig

    trainer = Trainer(
        TrainerConfig(model_path=str(qwen3_path), lora=LoRAConfig(rank=4, alpha=8.0), device="cpu", dtype="float64")
    )
    versions = _versions(trainer.model)
    trainer_lora = lora_parameters(trainer.model)

    def train_to(version: int) -> None:  # the optimizer's in-place update, as far as the lanes can tell
        with torch.no_grad():
            for name, tensor in versions[version].items():
                trainer_lora[name].copy_(tensor)

    train_to(0)
    config = RLConfig()
    config = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, max_staleness=1, update_policy="continue")
    )
    lanes = RolloutLanes(config, trainer, record_routing=False, version=0)
    lane, idle = lanes.engine(1), lanes.engine(0)
    shared = [(n, p) for n, p in trainer.model.named_parameters() if n not in trainer_lora]
    lane_params = dict(lane.model.named_parameters())
    assert all(lane_params[n] is p for n, p in shared), "the base weights are copied, not shared"
    assert not lane.cuda_graphs  # no capture beside the trainer's work on the device

    publish_after, reached, published = (30, 65), [threading.Event(), threading.Event()], []
    decode, steps = _Generation._decode, [0]

    def decode_then_hold(self, busy):
        decode(self, busy)
        steps[0] += 1
        if steps[0] in publish_after:
            k = publish_after.index(steps[0])
            reached[k].set()
            while len(published) <= k:
                time.sleep(0.002)

    monkeypatch.setattr(_Generation, "_decode", decode_then_hold)
    result = {}
    sampling = SamplingParams(max_new_tokens=100, temperature=1.0, n=2, seed=3)
    thread = threading.Thread(
        target=lambda: result.setdefault("samples", lane.generate([[3, 17, 42, 9], [7]], sampling))
    )
    thread.start()
    for k, version in enumerate((1, 2)):
        assert reached[k].wait(120)
        train_to(version)
        lane_factors = lora_parameters(lane.model)
        assert all(torch.equal(lane_factors[n], versions[version - 1][n]) for n in lane_factors)
        lanes.publish(version)
        assert lane.policy.version == version - 1 and idle.policy.version == version  # the idle lane at once
        published.append(version)
    thread.join(120)
    samples = result["samples"]
    a, b = 1 + publish_after[0], publish_after[1] - publish_after[0]  # the first token comes from the prefill
    assert all(s.token_versions == [0] * a + [1] * b + [2] * (100 - a - b) for s in samples)
    _assert_logprobs_of_each_tokens_version(NativeRolloutEngine(trainer.model), trainer, samples, versions)
