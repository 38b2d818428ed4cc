"""The fidelity guard (archon.rl.run.fidelity): the engine's log-prob of every sampled token against
the trainer's under the token's own adapter version. The guard's own arithmetic on a hand-made
case, clean runs of the built-in engine that never trip it, and faults injected into the built-in
engine (a wrong adapter id, a stale factor cache) that stop the run within one step."""

from __future__ import annotations

import contextlib
import dataclasses
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
from archon.rl.run.fidelity import FidelityError, FidelityGuard, gap_grows_unexplained, trainer_move, unexplained_rise
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
    return SimpleNamespace(dp=1, dp_sum=lambda *values: list(values), dp_max=lambda value: value)


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


def test_the_growth_rule_on_hand_built_sequences():
    floor, kl_flat = 1e-4, [2e-5] * 3  # trainer_move(2e-5) = 0.0063 nats per update
    assert trainer_move(2e-5) == pytest.approx((2 * 2e-5) ** 0.5)
    grows = [1e-4, 2e-4, 3.5e-4, 5e-4]  # under the bound of 10 floors, 4 floors up in all
    assert unexplained_rise(grows, kl_flat) == pytest.approx(4e-4)
    assert gap_grows_unexplained(grows, kl_flat, floor, min_rise=3.0)
    # the trainer's moves grow with it: from 0.0063 to 0.0068 nats, more than the gap's rise of 0.0004
    assert not gap_grows_unexplained(grows, [2e-5, 2.1e-5, 2.3e-5], floor, min_rise=3.0)
    # the moves grow, but by less than the gap: 0.00035 of the 0.0004 explained
    moves = [0.02, 0.021, 0.02035]
    assert unexplained_rise(grows, [m * m / 2 for m in moves]) == pytest.approx(5e-5)
    assert not gap_grows_unexplained(grows, [m * m / 2 for m in moves], floor, min_rise=3.0)
    # shrinking moves explain nothing
    assert gap_grows_unexplained(grows, [2e-5, 1e-5, 0.0], floor, min_rise=3.0)
    # not at every version, or by too little
    assert not gap_grows_unexplained([1e-4, 3e-4, 2.9e-4, 5e-4], kl_flat, floor, min_rise=3.0)
    assert not gap_grows_unexplained([1e-4, 1e-4, 3e-4, 5e-4], kl_flat, floor, min_rise=3.0)
    assert not gap_grows_unexplained([1e-4, 2e-4, 3e-4, 3.9e-4], kl_flat, floor, min_rise=3.0)
    with pytest.raises(ValueError, match="4 gaps and 4 KLs"):
        unexplained_rise(grows, kl_flat + [0.0])


def _published(kl: float):
    return SimpleNamespace(task=None, updates=[{"approx_kl": kl, "skipped": 0.0}, {"approx_kl": 9.0, "skipped": 1.0}])


def test_the_guard_stops_a_gap_that_grows_each_version_while_the_trainers_kl_does_not():
    config = FidelityConfig(floor_factor=10, min_floor=1e-4, growth_window=4, growth_factor=3)
    guard, ctx = FidelityGuard(config, "built-in engine", False, "", ""), _one_rank_ctx()
    gaps = [1e-6, 1e-4, 2.5e-4, 4.5e-4]
    for version, gap in enumerate(gaps[:3]):
        metrics = guard.check_step(ctx, _step(version, [gap], [0]))
        assert metrics["fidelity_rise"] == 0.0  # the window is not full yet
        guard.after_publish(ctx, _published(1e-6))  # skipped updates do not count
    with pytest.raises(FidelityError) as caught:
        guard.check_step(ctx, _step(3, [gaps[3]], [0]))
    message = str(caught.value)
    for named in ("last 4 adapter versions", "from 1e-06 nats at version 0 to 0.00045 at version 3", "0.001414",
                  "4.49 x the noise floor 0.0001", "built-in engine", "Likely causes"):  # fmt: skip
        assert named in message, (named, message)
    # the same gaps while the trainer's KL per update grows from 1e-6 to 1e-5 (moves 0.0014 to 0.0045)
    guard = FidelityGuard(config, "built-in engine", False, "", "")
    for version, (gap, kl) in enumerate(zip(gaps, [1e-6, 3e-6, 1e-5, 0.0])):
        metrics = guard.check_step(ctx, _step(version, [gap], [0]))
        guard.after_publish(ctx, _published(kl))
    assert metrics["fidelity_rise"] < 3.0
    # growth_window=0: no growth rule
    guard = FidelityGuard(dataclasses.replace(config, growth_window=0), "built-in engine", False, "", "")
    for version, gap in enumerate(gaps):
        guard.check_step(ctx, _step(version, [gap], [0]))
        guard.after_publish(ctx, _published(0.0))


def test_the_guard_state_goes_through_json_and_goes_on_only_on_the_same_engine():
    """A checkpoint keeps the floor, the window (a version's KL not yet known: null) and the last
    update's KL; a guard that loads them stops at the version the saved one would. Checked again at
    the version it resumes (the canary of the version in service), that version's gap is replaced,
    not added. Another engine's state is not taken: its floor is measured again."""
    config = FidelityConfig(floor_factor=10, min_floor=1e-4, growth_window=4, growth_factor=3)
    ctx, gaps = _one_rank_ctx(), [1e-6, 1e-4, 2.5e-4, 4.5e-4]
    saved = FidelityGuard(config, "built-in engine", False, "", "")
    for version, gap in enumerate(gaps[:3]):
        saved.check_step(ctx, _step(version, [gap], [0]))
        saved.after_publish(ctx, _published(1e-6))
    state = json.loads(json.dumps(saved.state_dict(), allow_nan=False))
    assert state["history"][-1] == [2, pytest.approx(2.5e-4), None] and state["pending_kl"] == 1e-6
    resumed = FidelityGuard(config, "built-in engine", False, "", "")
    resumed.load_state_dict(state)
    resumed.check_step(ctx, _step(2, [gaps[2]], [0]))
    assert [version for version, _, _ in resumed.history] == [0, 1, 2]
    with pytest.raises(FidelityError, match=r"from 1e-06 nats at version 0 to 0\.00045 at version 3"):
        resumed.check_step(ctx, _step(3, [gaps[3]], [0]))
    other = FidelityGuard(config, "vLLM engine", False, "", "")
    other.load_state_dict(state)
    assert other.floor is None and other.history == []
    other.load_state_dict(None)  # a checkpoint saved without it
    assert other.floor is None


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


def _drifting_temperature(monkeypatch, rate: float):
    """The engine samples (and reports the log-probs of) logits / (T x (1 + rate x v^2)) at the version
    v it serves: a logit scale that drifts further with each version, independent of what the adapter
    learns, its gap under the bound on the mean for the first versions."""
    real = native_module.NativeRolloutEngine.generate

    def generate(engine, prompts, sampling, *args, **kwargs):
        drift = 1 + rate * engine.policy.version**2
        return real(
            engine, prompts, dataclasses.replace(sampling, temperature=sampling.temperature * drift), *args, **kwargs
        )

    monkeypatch.setattr(native_module.NativeRolloutEngine, "generate", generate)


class _Killed(Exception):
    pass


def test_a_drift_whose_mean_stays_under_the_bound_is_stopped_by_the_growth_rule(setup, tmp_path, monkeypatch):
    """A logit scale drifting by 7e-4 x v^2: mean gaps of ~2e-7, 7e-5, 2.6e-4 and 5.9e-4 nats at versions
    0 to 3 (seeds 0 to 2 within 15 %), all under the bound of 1e-3 (10 x the floor 1e-4), rising at
    each version by ~6 floors in all while the trainer's KL per update (one minibatch: approx_kl 0)
    does not grow. Without the growth rule the run trains on until version 4's mean passes the bound.
    The same run killed after its checkpoint at step 2 and resumed goes on with the floor and the
    growth rule's window it saved, and stops at version 3 with the same error."""
    _drifting_temperature(monkeypatch, rate=7e-4)

    def args(run_dir, *extra):
        return parse_config(_args(setup, run_dir, steps=5) + ["--eval.every", "0", "--checkpoint.every", "2", *extra])

    with pytest.raises(FidelityError) as caught:
        RLRun(args(tmp_path / "run")).run()
    message = str(caught.value)
    real_step = RLRun.step

    def step_then_kill(run, step):
        if step == 2:
            raise _Killed()
        return real_step(run, step)

    with monkeypatch.context() as killing:
        killing.setattr(RLRun, "step", step_then_kill)
        with pytest.raises(_Killed):
            RLRun(args(tmp_path / "split")).run()
    saved = json.loads((tmp_path / "split" / "checkpoints" / "step-00000002" / "trainer_state.json").read_text())
    assert [version for version, _, _ in saved["data"]["fidelity"]["history"]] == [0, 1]
    with pytest.raises(FidelityError) as resumed:
        RLRun(args(tmp_path / "split", "--resume")).run()
    assert str(resumed.value) == message  # the same gaps, floor and window: bit for bit as uninterrupted
    whole, split = _records(tmp_path / "run"), _records(tmp_path / "split")
    assert [(r["step"], r["fidelity_gap_mean"], r["fidelity_floor"]) for r in split] == [
        (r["step"], r["fidelity_gap_mean"], r["fidelity_floor"]) for r in whole
    ]
    assert re.search(
        r"grew at each of the last 4 adapter versions, from \S+ nats at version 0 to \S+ at version 3", message
    )
    assert "noise floor 0.0001" in message and "built-in engine" in message and "Likely causes" in message
    records = _records(tmp_path / "run")
    assert len(records) == 3  # versions 0 to 2 trained on; version 3's step stopped before its update
    gaps = [record["fidelity_gap_mean"] for record in records]
    assert gaps == sorted(gaps) and gaps[-1] < 1e-3 and all(record["fidelity_rise"] == 0.0 for record in records)
    assert re.search(r"to 0\.000[3-9]\d* at version 3", message)  # version 3's mean: under the bound 1e-3


@pytest.mark.parametrize(
    "flags, culprit",
    [
        (["--rollout.fidelity.growth-window", "2"], r"rollout.fidelity.growth_window=2: must be 0 \(no growth rule\)"),
        (["--rollout.fidelity.growth-factor", "10"], r"rollout.fidelity.growth_factor=10.0: .*under .*floor_factor=10"),
    ],
)
def test_a_growth_rule_setting_out_of_range_is_refused(setup, tmp_path, flags, culprit):
    with pytest.raises(ValueError, match=culprit):
        parse_config(_args(setup, tmp_path / "run", steps=3) + flags)


def test_the_guard_adds_no_forward_pass_per_token(setup, tmp_path):
    """Per token (the default) the guard reads the gaps the trainer's scoring computed anyway: a run
    with it on makes exactly the module calls of the same run with it off (same seed, same samples)."""

    def module_calls(mode: str) -> int:
        calls = 0

        def count(module, args, output):
            nonlocal calls
            calls += 1

        args = _args(setup, tmp_path / mode, steps=2) + ["--eval.every", "0", "--rollout.fidelity.mode", mode]
        hook = torch.nn.modules.module.register_module_forward_hook(count)
        try:
            RLRun(parse_config(args)).run()
        finally:
            hook.remove()
        return calls

    on, off = module_calls("stop"), module_calls("off")
    assert on == off and on > 0
    assert "fidelity_gap_mean" in _records(tmp_path / "stop")[-1]
    assert "fidelity_gap_mean" not in _records(tmp_path / "off")[-1]
