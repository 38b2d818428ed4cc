"""What an RL step reports: the phases' results a task's metrics are made of, and the metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from archon.rl.run.producer import Rollouts
from archon.rl.rewards import NO_SOURCE, reward_breakdown

UPDATE_BOOKKEEPING = {
    "lr",
    "skipped",
    "tokens",
    "sequences",
    "total_tokens",
    "micro_batches",
    "optimizer_steps",
    "time_s",
    "num_tokens",
}
"""What Trainer.train_step reports about an update itself; the step logs its own counts and times."""


@dataclass
class Scores:
    """Per-sample rewards, whether each is correct (reward >= 1), response lengths, and the reward
    workers' error counts."""

    rewards: torch.Tensor
    correct: torch.Tensor
    lengths: torch.Tensor
    reward_metrics: dict[str, float]
    parts: dict[str, torch.Tensor] = field(default_factory=dict)
    """Each reward term's unweighted value per sample ([B] float32, by term name), when the reward
    has several terms; the rewards are their weighted sum."""
    episode_sums: dict[str, float] = field(default_factory=dict)
    """Multi-turn tasks: per-sample quantities summed over this rank's samples (turns, tool calls,
    environment tokens, one count per stop reason); logged as their means over all ranks."""
    reward_sums: dict[str, float] = field(default_factory=dict)
    """Per-term and per-source reward totals of this rank's samples (RewardBatch.sums: the same keys
    on every rank), summed over the ranks and logged through rewards.reward_breakdown."""


def _no_gaps() -> dict[str, torch.Tensor]:
    """The log-prob gaps of a task without trained tokens: none of each kind."""
    return dict.fromkeys(("total", "numerics", "lag"), torch.zeros(0))


@dataclass
class Prepared:
    """What the prepare phase decided for a task beside the batch: the shaped rewards, which samples
    the batch filters kept, whether the task trains this step, and the trainer-rollout log-prob gaps
    (RLRun._logprob_gaps) and version lags [its loss tokens] of its trained tokens."""

    rewards: torch.Tensor
    keep: torch.Tensor
    trains: bool = True
    gaps: dict[str, torch.Tensor] = field(default_factory=lambda: _no_gaps())
    lag: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.float64))
    tokens: float = 0.0
    distill_gaps: dict[str, tuple[float, float]] = field(default_factory=dict)
    """On-policy distillation: by data source, the summed log-prob gap log pi_student - log pi_teacher
    over the source's trained loss tokens on this rank, and their count."""


def every_reward_failed(failures: float, samples: float) -> bool:
    """The reward function failed (raised or timed out) on every one of a step's `samples`."""
    return samples > 0 and failures >= samples


def update_summary(updates: list[dict[str, float]]) -> dict[str, float]:
    """An RL step's training metrics: the loss, the gradient norm and every metric the loss reports,
    averaged over the applied updates (`*_max` / `*_min`: the extreme); with every update skipped,
    the last update's (non-finite) values. `lr` is the step's (the schedule moves once per RL step)."""
    applied = [u for u in updates if not u["skipped"]] or updates[-1:]
    summary = {"lr": updates[0]["lr"]}
    for key in applied[0]:
        if key in UPDATE_BOOKKEEPING:
            continue
        values = [u[key] for u in applied]
        if key.endswith("_max") or key.endswith("_min"):
            summary[key] = max(values) if key.endswith("_max") else min(values)
        else:
            summary[key] = sum(values) / len(values)
    return summary


def task_step_metrics(
    task,
    rollouts: Rollouts,
    scores: Scores,
    prepared: Prepared,
    updates: list[dict[str, float]],
    sync: dict[str, float],
    step_s: float,
    group_size: int,
    dp_sum,
    dp_max,
) -> dict[str, float]:
    """The metrics of `task`'s RL step (without its prefix), summed (`dp_sum(*values)`) or maxed
    (`dp_max(value)`) over the data-parallel ranks, and `tokens`, its trained tokens on all ranks."""
    G = group_size
    rewards, lengths, gaps, lag = prepared.rewards, scores.lengths, prepared.gaps, prepared.lag
    (
        n,
        reward_sum,
        reward_sq,
        correct_sum,
        length_sum,
        gap_sum,
        gap_n,
        numerics_sum,
        lag_gap_sum,
        kept_groups,
        errors,
        timeouts,
        tokens,
        lag_sum,
        stale,
        mixed,
    ) = dp_sum(
        len(rollouts.samples),
        float(rewards.double().sum()),
        float((rewards.double() ** 2).sum()),
        float(scores.correct.sum()),
        float(lengths.sum()),
        float(gaps["total"].sum()),
        float(gaps["total"].numel()),
        float(gaps["numerics"].sum()),
        float(gaps["lag"].sum()),
        float(prepared.keep.sum()) / G,
        scores.reward_metrics["reward_errors"],
        scores.reward_metrics["reward_timeouts"],
        prepared.tokens,
        float(lag.sum()),
        float(rollouts.stale_dropped),
        float(sum(len(set(s.token_versions)) > 1 for s in rollouts.samples)),
    )
    reward_mean = reward_sum / max(n, 1.0)
    metrics = {
        "reward_mean": reward_mean,
        "reward_std": max(reward_sq / max(n, 1.0) - reward_mean**2, 0.0) ** 0.5,
        "accuracy": correct_sum / max(n, 1.0),
        "response_length": length_sum / max(n, 1.0),
        "logprob_abs_diff_mean": gap_sum / max(gap_n, 1.0),
        "logprob_abs_diff_max": dp_max(float(gaps["total"].max()) if gaps["total"].numel() else 0.0),
        "groups_kept": kept_groups,
        "reward_errors": errors,
        "reward_timeouts": timeouts,
        "reward_samples": n,
        "tokens": tokens,
        "adapter_version": float(task.version),
        "skipped_updates": sum(u["skipped"] for u in updates),
    }
    # version lag of the trained tokens, the log-prob gap split by cause, stale groups dropped and
    # sampled again, and how long each side waited for the other
    if task.producer is not None:  # over the time since the previous step's rollouts were taken
        idle, elapsed = task.producer.idle_since_last()
    else:  # synchronously the rollout side waits while the trainer scores, trains and publishes
        idle, elapsed = step_s - rollouts.generate_s, step_s
    metrics.update(
        {
            "version_lag_mean": lag_sum / max(gap_n, 1.0),
            "version_lag_max": dp_max(float(lag.max()) if lag.numel() else 0.0),
            "logprob_gap_numerics": numerics_sum / max(gap_n, 1.0),
            "logprob_gap_lag": lag_gap_sum / max(gap_n, 1.0),
            "stale_samples_dropped": stale,
            "mixed_version_samples": mixed,  # rollout.update_policy='continue': samples an update landed in
            "trainer_idle_s": rollouts.wait_s,
            "rollout_idle_s": idle,
            "trainer_idle_fraction": rollouts.wait_s / step_s,
            "rollout_idle_fraction": min(max(idle, 0.0) / elapsed, 1.0) if elapsed > 0 else 0.0,
        }
    )
    if scores.episode_sums:
        names = sorted(scores.episode_sums)
        for name, total in zip(names, dp_sum(*(scores.episode_sums[k] for k in names))):
            metrics[name] = total / max(n, 1.0)
    metrics.update(distill_metrics(task, prepared, dp_sum))
    if scores.reward_sums:
        names = list(scores.reward_sums)
        metrics.update(reward_breakdown(dict(zip(names, dp_sum(*(scores.reward_sums[k] for k in names))))))
    metrics.update({k: v for k, v in sync.items() if k != "sync_s"})
    if updates:
        metrics.update(update_summary(updates))
    return metrics


def distill_metrics(task, prepared: Prepared, dp_sum) -> dict[str, float]:
    """With distillation: the mean log-prob gap log pi_student - log pi_teacher (the per-token
    reverse KL to the teacher on the student's samples) over the task's trained loss tokens on all
    ranks, `distill_logprob_gap`, and per data source (`distill_logprob_gap/<source>`, of the sources
    with tokens this step). Every rank sums the same list, its task's sources (those of its data)."""
    if not task.teachers:
        return {}
    sources = sorted(task.teachers)
    totals = dp_sum(*[value for source in sources for value in prepared.distill_gaps.get(source, (0.0, 0.0))])
    metrics = {}
    for source, total, count in zip(sources, totals[0::2], totals[1::2]):
        if count > 0:
            metrics[f"distill_logprob_gap/{source or NO_SOURCE}"] = total / count
    metrics["distill_logprob_gap"] = sum(totals[0::2]) / max(sum(totals[1::2]), 1.0)
    return metrics
