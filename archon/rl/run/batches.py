"""Training batches of rollouts: samples packed for the trainer with their behaviour log-probs,
version lags and routed experts, batches joined into one, and the filler batch of a rank with
nothing to train in a step its peers train.
"""

from __future__ import annotations

import torch

from archon.batch import PER_TOKEN_FIELDS, PackedBatch
from archon.rollout.base import Sample
from archon.rollout.native import ROUTED_EXPERTS
from archon.trainer import ROUTED_EXPERTS_EXTRA, TASK_EXTRA


def rollout_batch(
    samples: list[Sample], advantages: torch.Tensor, trainer_version: int, routed_experts: bool = False
) -> PackedBatch:
    """The samples packed for training (loss on their completion tokens, but for those a
    completion_mask leaves out), with every completion token's behaviour (rollout) log-prob
    and its version lag (`extras["version_lag"]`: trainer_version minus the version that sampled it).
    routed_experts: also the expert ids the engine routed every token to (`extras["routed_experts"]`,
    [T, L_moe, k] from each sample's `extra["routed_experts"]`), for the trainer to replay.
    The advantages' dtype is the batch's: fp32, or fp64 in a float64 run (an equality test's), whose
    rollout log-probs then keep the engine's fp64 values."""
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        advantages=advantages,
    )
    rollout_lp = torch.zeros(batch.num_tokens, dtype=batch.advantages.dtype)
    version_lag = torch.zeros(batch.num_tokens, dtype=torch.long)
    for i, s in enumerate(samples):
        start = int(batch.cu_seqlens[i]) + len(s.prompt_ids) - 1
        span = slice(start, start + len(s.completion_ids))
        rollout_lp[span] = torch.tensor(s.logprobs, dtype=rollout_lp.dtype)
        version_lag[span] = trainer_version - torch.tensor(s.token_versions, dtype=torch.long)
        if s.completion_mask is not None:  # a multi-turn trajectory: the environment's ids take no loss
            batch.loss_mask[span] &= torch.tensor(s.completion_mask, dtype=torch.bool)
    batch.rollout_logprobs = rollout_lp
    batch.extras["version_lag"] = version_lag
    if routed_experts:
        batch.extras[ROUTED_EXPERTS_EXTRA] = packed_routed_experts(samples, batch)
    return batch


def packed_routed_experts(samples: list[Sample], batch: PackedBatch) -> torch.Tensor:
    """[T, L_moe, k] int16: each sample's recorded expert ids at its tokens' rows of `batch`."""
    missing = [i for i, s in enumerate(samples) if ROUTED_EXPERTS not in s.extra]
    if missing:
        raise ValueError(
            f"algorithm.routing_replay='rollout' needs every sample's routed experts, and sample {missing[0]} "
            f"(of {len(samples)}) has none in Sample.extra[{ROUTED_EXPERTS!r}]; the built-in engine records them "
            "for single-turn rollouts"
        )
    first = samples[0].extra[ROUTED_EXPERTS]
    experts = torch.full((batch.num_tokens, *first.shape[1:]), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        recorded = s.extra[ROUTED_EXPERTS]
        length = len(s.prompt_ids) + len(s.completion_ids)
        if recorded.shape != (length, *first.shape[1:]):
            raise ValueError(
                f"sample {i} has routed experts of shape {tuple(recorded.shape)}, expected "
                f"({length}, {', '.join(map(str, first.shape[1:]))}) for its {length} tokens"
            )
        start = int(batch.cu_seqlens[i])
        experts[start : start + length] = recorded
    return experts


def concat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """The sequences of `batches` in one packed batch, in order (extras kept where all have them)."""
    values = {}
    for name in PER_TOKEN_FIELDS:
        parts = [getattr(b, name) for b in batches]
        values[name] = None if any(p is None for p in parts) else torch.cat(parts)
    offsets = torch.tensor([0, *[b.num_tokens for b in batches]]).cumsum(0)
    cu_seqlens = torch.cat([offsets[:1]] + [b.cu_seqlens[1:] + offsets[i] for i, b in enumerate(batches)])
    keys = set.intersection(*(set(b.extras) for b in batches))
    extras = {key: torch.cat([b.extras[key] for b in batches]) for key in sorted(keys)}
    return PackedBatch(cu_seqlens=cu_seqlens, extras=extras, **values)


def filler_batch(multi_task: bool, task_index: int) -> PackedBatch:
    """A batch of one token and no loss token, for a rank with nothing to score or train in a step
    or minibatch that the other data-parallel ranks run: its forward and backward keep this rank's
    collectives in step with theirs and add nothing to any loss or gradient. In a multi-task run its
    token is `task_index`'s."""
    batch = PackedBatch.from_sequences([[0]], prompt_lens=[1], advantages=[0.0])
    batch.old_logprobs, batch.rollout_logprobs, batch.ref_logprobs = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    batch.extras["version_lag"] = torch.zeros(1, dtype=torch.long)
    if multi_task:
        batch.extras[TASK_EXTRA] = torch.full((1,), task_index, dtype=torch.long)
    return batch
