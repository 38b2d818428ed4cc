"""The fidelity guard (archon.rl.run.fidelity): the engine's log-prob of every sampled token against
the trainer's under the token's own adapter version. The guard's own arithmetic on a hand-made
case, clean runs of the built-in engine that never trip it, and faults injected into the built-in
engine (a wrong adapter id, a stale factor cache) that stop the run within one step."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_grpo_recipe import _args, write_tiny_setup
from test_multi_lora_run import _config, _task_yaml

import archon.rl.run.collect as collect_module
import archon.rollout.native as native_module
from archon.lora.multi_task import FactorCache
from archon.lora.utils import multi_task_layers
from archon.rl.config import parse_config
from archon.rl.config.schema import FidelityConfig
from archon.rl.loop import RLRun
from archon.rl.run.fidelity import FidelityError, FidelityGuard
from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = write_tiny_setup(tmp_path_factory.mktemp("fidelity"))
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("-",), num_train=64, num_held_out=8))
    write_jsonl(train, root / "sub_train.jsonl")
    write_jsonl(held_out, root / "sub_held_out.jsonl")
    return root


def varying_reward(prompt, completion, reference):
    """Differs between almost any two completions of a group, so that every adapter moves each step."""
    return sum(map(ord, completion)) % 17 / 16


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- the guard's arithmetic -------------------------------------------------------------------


def _one_rank_ctx():
    return SimpleNamespace(dp_sum=lambda *values: list(values), dp_max=lambda value: value)


def _step(version: int, gaps: list[float], lags: list[int]):
    prepared = SimpleNamespace(gaps={"numerics": torch.tensor(gaps)}, lag=torch.tensor(lags, dtype=torch.float64))
    task = SimpleNamespace(version=version, adapter_history=object(), config=SimpleNamespace(max_staleness=1))
    return SimpleNamespace(task=task, prepared=prepared)


def test_the_floor_comes_from_the_first_step_and_a_version_over_k_floors_stops_the_run():
    guard = FidelityGuard(FidelityConfig(floor_factor=10, min_floor=1e-3), "built-in engine", False, "", "")
    first = guard.check_step(_one_rank_ctx(), _step(0, [0.002, 0.004], [0, 0]))
    assert guard.floor == pytest.approx(0.003) and first["fidelity_floor"] == pytest.approx(0.003)
    # bound 0.03: version 1's mean 0.02 passes though one token is over it (counted), version 0's lag too
    fine = guard.check_step(_one_rank_ctx(), _step(2, [0.005, 0.035, 0.02, 0.0], [0, 0, 1, 1]))
    assert fine["fidelity_over_bound"] == pytest.approx(0.25) and fine["fidelity_gap_max"] == pytest.approx(0.035)
    with pytest.raises(FidelityError) as caught:
        guard.check_step(_one_rank_ctx(), _step(3, [0.001, 0.001, 0.05, 0.04], [0, 0, 1, 1]))
    message = str(caught.value)
    for named in ("adapter version 2", "0.045 nats", "noise floor 0.003", "built-in engine", "Likely causes"):
        assert named in message


def test_a_floor_under_the_minimum_is_raised_to_it_and_one_over_the_maximum_is_a_fault():
    guard = FidelityGuard(FidelityConfig(min_floor=1e-3, max_floor=0.1), "vLLM engine", False, "", "")
    guard.check_step(_one_rank_ctx(), _step(0, [1e-7], [0]))
    assert guard.floor == 1e-3
    other_base = FidelityGuard(FidelityConfig(max_floor=0.1), "vLLM engine", False, "", "")
    with pytest.raises(FidelityError, match=r"already at adapter version 0.*0\.163 nats.*max_floor=0\.1"):
        other_base.check_step(_one_rank_ctx(), _step(0, [0.163], [0]))


def test_warn_mode_logs_the_fault_and_goes_on(caplog):
    guard = FidelityGuard(FidelityConfig(mode="warn"), "built-in engine", False, "", "")
    guard.check_step(_one_rank_ctx(), _step(0, [0.0], [0]))
    metrics = guard.check_step(_one_rank_ctx(), _step(1, [0.5], [0]))
    assert metrics["fidelity_gap_mean"] == 0.5 and "does not serve the policy" in caplog.text
    assert FidelityGuard(FidelityConfig(mode="off"), "", False, "", "").check_step(None, None) == {}


# ---- clean runs ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bypass", [False, True], ids=["per-token", "canary"])
def test_a_clean_native_run_logs_the_gaps_and_never_trips(setup, tmp_path, bypass):
    extra = ["--algorithm.no-recompute-old-logprobs"] if bypass else []
    args = _args(setup, tmp_path / "run", steps=3) + ["--eval.every", "0", "--optim.lr", "5e-2", *extra]
    RLRun(parse_config(args)).run()
    records = _records(tmp_path / "run")
    assert len(records) == 3
    for record in records:
        # float32 on the CPU: the engine's and the trainer's log-probs differ by ~1e-6 (batch shapes)
        assert record["fidelity_floor"] == 1e-4 and record["fidelity_gap_mean"] < 1e-4
        assert record["fidelity_gap_max"] < 1e-3 and record["fidelity_over_bound"] == 0.0


# ---- faults injected into the built-in engine -------------------------------------------------


REWARD = "test_fidelity:varying_reward"


def _two_tasks(setup, tmp_path, recompute: bool):
    algorithm = "" if recompute else "    algorithm: {name: grpo, minibatches: 2, recompute_old_logprobs: false}\n"
    tasks = [
        _task_yaml("add", setup / "train.jsonl", setup / "held_out.jsonl", reward=REWARD, lr=5e-2),
        _task_yaml("sub", setup / "sub_train.jsonl", setup / "sub_held_out.jsonl", reward=REWARD, lr=5e-2),
    ]
    if algorithm:
        tasks = [text.replace("    algorithm: {name: grpo, minibatches: 2}\n", algorithm) for text in tasks]
    return _config(setup, tmp_path / "run", 3, "".join(tasks), "--eval.every", "0")


def _swap_adapter_ids(monkeypatch):
    """The engine samples each task's prompts with the other task's adapter."""
    real = collect_module.mixed_rollouts

    def mixed_rollouts(native, *args):
        class Swapped:
            def generate(self, prompts, sampling, adapters, adapter_seeds):
                return native.generate(
                    prompts, sampling, adapters=[1 - a for a in adapters], adapter_seeds=adapter_seeds
                )

        return real(Swapped(), *args)

    monkeypatch.setattr(collect_module, "mixed_rollouts", mixed_rollouts)


def _stale_factor_cache(monkeypatch):
    """The engine's stacked task factors kept from its first generation and never stacked again."""
    kept: dict[int, FactorCache] = {}

    class Stale(FactorCache):
        def get(self, factors):
            return self.stacked

    @contextlib.contextmanager
    def cached_task_factors(model):
        modules = multi_task_layers(model)
        for module in modules:
            module.factor_cache = kept.setdefault(id(module), Stale())
        try:
            yield model
        finally:
            for module in modules:
                module.factor_cache = None

    monkeypatch.setattr(native_module, "cached_task_factors", cached_task_factors)


@pytest.mark.parametrize(
    "fault, recompute",
    [(_swap_adapter_ids, True), (_stale_factor_cache, True), (_stale_factor_cache, False)],
    ids=["wrong-adapter-id", "stale-cache", "stale-cache-canary"],
)
def test_a_native_engine_fault_stops_the_run_at_the_first_version_it_serves_wrong(
    setup, tmp_path, monkeypatch, fault, recompute
):
    """Per token (the trainer scores the rollouts), or with the canary after each publish where it
    does not (recompute_old_logprobs=false)."""
    fault(monkeypatch)
    run = RLRun(_two_tasks(setup, tmp_path, recompute))
    with pytest.raises(FidelityError) as caught:
        run.run()
    message = str(caught.value)
    assert re.search(r"adapter version 1 .* by [0-9.e-]+ nats on average", message), message
    assert "noise floor 0.0001" in message and "built-in engine" in message and "Likely causes" in message
    # caught within one step: version 1 serves from step 2 on (canary: right after its publish, in step 1)
    steps_logged = _records(tmp_path / "run") if (tmp_path / "run" / "metrics.jsonl").exists() else []
    assert len(steps_logged) == (1 if recompute else 0)
