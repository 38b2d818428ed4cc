"""benchmarks/arms.py, the benchmarks' alternating-arms harness, on deterministic fake arms: the
order the arms run in, the per-round ratios and their median, min and max, the verdict held back
when the rounds disagree, and the refusal of too few rounds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "arms.py"


@pytest.fixture(scope="module")
def arms():
    spec = importlib.util.spec_from_file_location("benchmark_arms", PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def _recording_arms(values: dict[str, list], calls: list[str]) -> dict:
    """Arms that return their next value from `values` and record each call in `calls`."""

    def arm(name):
        queue = list(values[name])

        def measure():
            calls.append(name)
            return queue.pop(0)

        return measure

    return {name: arm(name) for name in values}


def test_two_arms_alternate_and_reverse_every_other_round(arms):
    calls = []
    fake = _recording_arms({"a": [9.0] + [1.0] * 5, "b": [9.0] + [2.0] * 5}, calls)
    result = arms.run_arms(fake, [arms.Ratio("b_over_a", "b", "a")], repeats=5, warmup=1, progress=False)
    assert calls == ["a", "b", "b", "a", "a", "b", "b", "a", "a", "b", "b", "a"]
    assert result.order[0] == ["a", "b"] and result.order[1] == ["b", "a"]
    assert result.samples == {"a": [1.0] * 5, "b": [2.0] * 5}  # the warm-up round is left out
    assert result.to_json()["order"] == ["AB", "BA", "AB", "BA", "AB", "BA"]


def test_three_arms_run_round_robin_in_alternating_order(arms):
    assert arms.interleaved_order(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    calls = []
    fake = _recording_arms({name: [1.0] * 5 for name in "abc"}, calls)
    arms.run_arms(fake, [], repeats=5, warmup=0, progress=False)
    assert calls == list("abccbaabccbaabc")


def test_ratios_are_taken_round_by_round(arms):
    numerators = [2.0, 3.0, 4.0, 10.0, 2.5]
    denominators = [1.0, 1.0, 2.0, 4.0, 1.0]
    fake = _recording_arms({"slow": numerators, "fast": denominators}, [])
    result = arms.run_arms(fake, [arms.Ratio("speedup", "slow", "fast")], repeats=5, warmup=0, progress=False)
    summary = result.ratios["speedup"]
    assert summary.pairs == [2.0, 3.0, 2.0, 2.5, 2.5]
    assert (summary.median, summary.min, summary.max) == (2.5, 2.0, 3.0)
    assert summary.spread == pytest.approx((3.0 - 2.0) / 2.5)
    assert result.median("slow") == 3.0
    assert summary.verdict_allowed and result.verdict_allowed


def test_a_ratio_of_named_figures(arms):
    archon = [{"tok_s": 300.0, "peak_mb": 100.0}] * 5
    hf = [{"tok_s": 100.0 * (1 + i), "peak_mb": 400.0} for i in range(5)]
    fake = _recording_arms({"archon": archon, "hf": hf}, [])
    ratios = [
        arms.Ratio("tok_s", "archon", "hf", figure="tok_s"),
        arms.Ratio("memory", "archon", "hf", figure="peak_mb"),
    ]
    result = arms.run_arms(fake, ratios, repeats=5, warmup=0, progress=False)
    assert result.ratios["tok_s"].pairs == pytest.approx([3.0, 1.5, 1.0, 0.75, 0.6])
    assert result.ratios["memory"].pairs == [0.25] * 5
    assert result.median("hf", "tok_s") == 300.0
    with pytest.raises(ValueError, match="must name one"):
        arms.summarize(arms.Ratio("no_figure", "archon", "hf"), archon, hf)


def test_a_wide_spread_holds_the_verdict_back(arms):
    # the four kept-cache / re-prefill ratios, had they been rounds of one run (and one more)
    wide = arms.summarize(arms.Ratio("speedup", "b", "a"), [1.22, 0.15, 6.92, 13.5, 2.0], [1.0] * 5)
    assert wide.spread > arms.SPREAD_BOUND and not wide.verdict_allowed
    line = arms.verdict_line(wide, arms.speed_verdict(wide))
    assert "spread too wide for a verdict" in line and "faster" not in line and "2" in line
    narrow = arms.summarize(arms.Ratio("speedup", "b", "a"), [2.0, 2.1, 2.2, 1.9, 2.05], [1.0] * 5)
    assert narrow.verdict_allowed
    assert arms.verdict_line(narrow, arms.speed_verdict(narrow)) == "speedup: faster"


def test_the_spread_bound_is_inclusive(arms):
    at_bound = arms.summarize(arms.Ratio("r", "b", "a"), [0.75, 1.0, 1.25, 1.0, 1.0], [1.0] * 5)
    assert at_bound.spread == pytest.approx(arms.SPREAD_BOUND) and at_bound.verdict_allowed
    beyond = arms.summarize(arms.Ratio("r", "b", "a"), [0.74, 1.0, 1.25, 1.0, 1.0], [1.0] * 5)
    assert not beyond.verdict_allowed


def test_speed_and_goal_verdicts_need_every_round_on_one_side(arms):
    ratio = arms.Ratio("r", "b", "a")
    mixed = arms.summarize(ratio, [0.95, 1.05, 1.1, 1.0, 1.02], [1.0] * 5)
    assert mixed.verdict_allowed and arms.speed_verdict(mixed).startswith("no clear difference")
    slower = arms.summarize(ratio, [0.8, 0.9, 0.85, 0.82, 0.88], [1.0] * 5)
    assert arms.speed_verdict(slower) == "slower"
    assert arms.goal_verdict(slower, 0.95) == "goal <= 0.95 met in every round"
    assert arms.goal_verdict(slower, 0.5) == "goal <= 0.5 not met in any round"
    assert "3 of 5 rounds only" in arms.goal_verdict(slower, 0.86)
    assert arms.goal_verdict(slower, 0.7, at_most=False) == "goal >= 0.7 met in every round"


def test_fewer_than_five_rounds_are_refused_unless_quick(arms):
    fake = _recording_arms({"a": [1.0] * 4, "b": [1.0] * 4}, [])
    with pytest.raises(ValueError, match="at least 5 rounds"):
        arms.run_arms(fake, [arms.Ratio("r", "a", "b")], repeats=4, warmup=0, progress=False)
    quick = arms.run_arms(fake, [arms.Ratio("r", "a", "b")], repeats=2, warmup=0, quick=True, progress=False)
    summary = quick.ratios["r"]
    assert summary.quick and not summary.verdict_allowed and not quick.verdict_allowed
    assert "not a measurement" in arms.describe(summary)
    assert "no verdict" in arms.verdict_line(summary, "faster")
    with pytest.raises(ValueError, match="at least one round"):
        arms.check_repeats(0, quick=True)


def test_bad_arguments_are_refused(arms):
    one = {"a": lambda: 1.0}
    with pytest.raises(ValueError, match="at least two"):
        arms.run_arms(one, [], progress=False)
    two = {"a": lambda: 1.0, "b": lambda: 1.0}
    with pytest.raises(ValueError, match="names arms"):
        arms.run_arms(two, [arms.Ratio("r", "a", "c")], progress=False)
    with pytest.raises(ValueError, match="warmup"):
        arms.run_arms(two, [], warmup=-1, progress=False)


def test_the_environment_record(arms):
    fake = _recording_arms({"a": [1.0] * 5, "b": [1.0] * 5}, [])
    env = arms.run_arms(fake, [], repeats=5, warmup=0, threads=3, progress=False).environment
    assert env["threads"] == 3
    assert len(env["load_average_before"]) == 3 and len(env["load_average_after"]) == 3
    assert env["cpu_model"] and env["cpu_capability"] and env["started"] <= env["ended"]


def test_a_summary_survives_json(arms):
    """A comparison made in a measurement's own process comes back through its JSON."""
    summary = arms.summarize(
        arms.Ratio("r", "b", "a", "tok_s"), [{"tok_s": x} for x in (2.0, 3.0, 2.5, 2.2, 2.4)], [{"tok_s": 1.0}] * 5
    )
    again = arms.RatioSummary.from_json("r", summary.to_json())
    assert again == summary and again.verdict_allowed == summary.verdict_allowed


def test_median_figures(arms):
    samples = [
        {"tok_s": 3.0, "ok": True, "losses": [1.0]},
        {"tok_s": 1.0, "ok": True, "losses": [2.0]},
        {"tok_s": 2.0, "ok": False, "losses": [3.0]},
    ]
    assert arms.median_figures(samples) == {"tok_s": 2.0, "ok": False, "losses": [3.0]}


def test_settle_runs_before_every_measurement(arms):
    calls: list[str] = []
    run = _recording_arms({"a": [1.0] * 6, "b": [2.0] * 6}, calls)
    arms.run_arms(
        run, [arms.Ratio("r", "a", "b")], repeats=5, warmup=1, progress=False, settle=lambda: calls.append("settle")
    )
    assert calls == [x for name in calls if name != "settle" for x in ("settle", name)]


def test_waiting_for_a_busy_child_to_go_idle(arms):
    """A child that computes for a second is waited for; with none busy the wait is one window."""
    import subprocess
    import time

    assert arms.children_cpu_seconds() is not None, "this test needs Linux /proc"
    busy = "import time\nend = time.perf_counter() + 1.0\nwhile time.perf_counter() < end: pass\ntime.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", busy])
    try:
        time.sleep(0.3)  # its interpreter has started and is computing
        waited = arms.wait_for_idle_children(window_s=0.2, limit_s=10.0)
        assert 0.4 <= waited < 10.0, waited  # waited for the rest of its second, not the limit
        assert arms.wait_for_idle_children(window_s=0.2) < 0.6  # it sleeps now: one window
    finally:
        child.kill()
        child.wait()
