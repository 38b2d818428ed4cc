"""Advantage estimators for the GRPO family: pure functions on tensors.

Layout: a rollout batch holds `num_groups` prompts with `group_size` (G) samples each, stored
group by group, so sample `i` belongs to group `i // G`. Per-sample tensors have shape [B] with
B = num_groups * G. Per-token tensors are packed: shape [T], with sequence boundaries given by
`cu_seqlens` [N+1] (the layout of the model forward, see docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

BatchSum = Callable[[torch.Tensor], torch.Tensor]
"""Sums a float64 tensor of per-rank totals over the data-parallel ranks (identity on one rank)."""


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards has {rewards.numel()} samples, not a multiple of group_size={group_size}")
    return rewards.reshape(-1, group_size)


def group_mean_std(rewards: torch.Tensor, group_size: int, unbiased: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample group mean and standard deviation of the rewards, each of shape [B], in float64.

    unbiased=True divides by G-1 (Bessel's correction), as verl (`torch.std`) and TRL (`nanstd`) do;
    unbiased=False divides by G. A group of one sample has std 0. float64, so that rewards up to
    the float32 limit (about 3.4e38) square and sum without overflowing.
    """
    grouped = _grouped(rewards.double(), group_size)
    mean = grouped.mean(dim=1, keepdim=True)
    if group_size == 1:
        std = torch.zeros_like(mean)
    else:
        std = grouped.std(dim=1, keepdim=True, correction=1 if unbiased else 0)
    return mean.expand_as(grouped).reshape(-1), std.expand_as(grouped).reshape(-1)


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, eps: float = 1e-6, unbiased_std: bool = True
) -> torch.Tensor:
    """GRPO: A_i = (R_i - mean_g R) / (std_g R + eps).  rewards [B] -> advantages [B] (fp32).

    A group whose rewards are all equal gets advantage 0 for every sample. The std is unbiased
    (divide by G-1) by default, matching verl and TRL; see `group_mean_std`. Computed in float64,
    so any finite float32 rewards give finite advantages (at most sqrt(G-1) in magnitude).
    """
    mean, std = group_mean_std(rewards, group_size, unbiased=unbiased_std)
    return ((rewards.double() - mean) / (std + eps)).float()


def drgrpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr.GRPO: A_i = R_i - mean_g R, with no std normalisation.  rewards [B] -> advantages [B] (fp32).

    Computed in float64; a difference beyond the float32 range (rewards of opposite sign near it)
    is clamped to the largest finite float32, so the advantages are always finite.
    """
    mean, _ = group_mean_std(rewards, group_size)
    limit = torch.finfo(torch.float32).max
    return (rewards.double() - mean).clamp(-limit, limit).float()


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO: A_i = R_i - mean_{j != i, j in g} R_j, the leave-one-out baseline.  rewards [B] -> [B] (fp32).

    Equal to G / (G - 1) * (R_i - mean_g R), so it is Dr.GRPO's advantage scaled by G / (G - 1) and
    unbiased (the baseline does not depend on the sample). Needs G >= 2. Computed in float64 and
    clamped to the float32 range, like `drgrpo_advantages`.
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per group for a leave-one-out baseline, got {group_size}")
    grouped = _grouped(rewards.double(), group_size)
    others_mean = (grouped.sum(dim=1, keepdim=True) - grouped) / (group_size - 1)
    limit = torch.finfo(torch.float32).max
    return (grouped - others_mean).reshape(-1).clamp(-limit, limit).float()


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    group_size: int,
    group_baseline: bool,
    *,
    weights: torch.Tensor,
    batch_sum: BatchSum | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """REINFORCE++: advantages whitened over the whole batch.  rewards [B], weights [B] -> [B] (fp32).

    group_baseline=False (REINFORCE++): x_i = R_i. group_baseline=True (REINFORCE++-baseline, the
    variant for several samples per prompt): x_i = R_i - mean_g R, or x_i = R_i for groups of one
    sample, which have no other sample to take a mean over. Then
        A_i = (x_i - m) / (s + eps)
    where m and s are the weighted mean and unbiased standard deviation of x over the batch, each
    sample counted weights_i times: with W = sum_i w_i,
        m = sum_i w_i x_i / W,    s^2 = sum_i w_i (x_i - m)^2 / (W - 1).
    weights_i = the number of loss tokens of response i gives the statistics over every token of the
    batch (the REINFORCE++ paper and verl whiten the per-token returns, and with one outcome reward
    and no discount every token's return is its response's x_i); weights_i = 1 counts each response
    once. A sample of weight 0 (no loss token, or left out of the batch) does not count and gets 0.
    The sums run over every sample of the batch on all data-parallel ranks: `batch_sum` sums the
    per-rank totals (W, sum w x, sum w x^2) over the ranks; None means this rank holds the whole
    batch. Computed in float64; a batch whose counted values are all equal gets 0.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if weights.shape != rewards.shape:
        raise ValueError(f"weights has shape {tuple(weights.shape)}, expected {tuple(rewards.shape)} like rewards")
    x = rewards.double()
    if group_baseline:
        mean, _ = group_mean_std(rewards, group_size)
        if group_size > 1:
            x = x - mean
    w = weights.double()
    totals = torch.stack([w.sum(), (w * x).sum(), (w * x.square()).sum()])
    if batch_sum is not None:
        totals = batch_sum(totals).to(torch.float64)
    count, total, squares = totals.tolist()
    if count <= 0:
        return torch.zeros_like(rewards, dtype=torch.float32)
    mean = total / count
    variance = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    limit = torch.finfo(torch.float32).max
    advantages = ((x - mean) / (variance**0.5 + eps)).clamp(-limit, limit)
    return torch.where(w > 0, advantages, torch.zeros_like(advantages)).float()


def groups_with_reward_variance(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: which groups to keep.  rewards [B] -> keep [num_groups] (bool).

    A group is kept when its rewards are not all equal; for 0/1 rewards that is 0 < #correct < G.
    Such groups are the only ones with a non-zero GRPO advantage. To get a per-sample mask, use
    `keep.repeat_interleave(group_size)`.
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) > grouped.amin(dim=1)


def overlong_penalty(
    response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong punishment, to be added to the rewards.  response_lengths [B] -> penalty [B] (fp32).

    With L = max_response_length and C = buffer_length:
        0                         if |y| <= L - C
        ((L - C) - |y|) / C       if L - C < |y| <= L     (falls linearly from 0 to -1)
        -1                        if |y| > L
    all multiplied by penalty_factor.
    """
    if not 0 < buffer_length <= max_response_length:
        raise ValueError(f"need 0 < buffer_length <= max_response_length, got {buffer_length}, {max_response_length}")
    lengths = response_lengths.float()
    expected = max_response_length - buffer_length
    penalty = ((expected - lengths) / buffer_length).clamp(min=-1.0, max=0.0)
    return penalty * penalty_factor


def distillation_advantages(student_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor) -> torch.Tensor:
    """On-policy distillation: per-token advantage -(log pi_student - log pi_teacher), detached.

    student_logprobs [T], teacher_logprobs [T] -> advantages [T] (fp32). Both are log-probs of the
    tokens the student sampled; the student's are the ones it sampled with (rollout or old log-probs).
    Maximising the advantage-weighted log-likelihood then minimises the per-token reverse KL.
    """
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(
            f"shape mismatch: student {tuple(student_logprobs.shape)} vs teacher {tuple(teacher_logprobs.shape)}"
        )
    return (teacher_logprobs.float() - student_logprobs.float()).detach()


def mixed_distillation_advantages(
    task_advantages: torch.Tensor,
    student_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    weight: float,
) -> torch.Tensor:
    """On-policy distillation mixed with task rewards: A_t = A_task,t + weight * (log pi_teacher - log pi_student).

    task_advantages [T] (a sequence's reward advantage on each of its tokens), student_logprobs [T],
    teacher_logprobs [T] -> advantages [T] (fp32, detached).

    The negative reverse KL is a per-token reward, so it adds to the task advantage and the policy
    objective sees one advantage per token: PPO clips one surrogate of the sum, min(r A_t, clip(r) A_t),
    not a surrogate per term (verl clips the two terms separately and adds them). Then the clip range
    stops a token's update once its ratio has left the range in the direction its total advantage
    favours, exactly as for any other reward, and every objective (dual clip, GSPO, CISPO) applies
    unchanged.
    """
    if task_advantages.shape != student_logprobs.shape:
        raise ValueError(
            f"shape mismatch: task advantages {tuple(task_advantages.shape)} vs student {tuple(student_logprobs.shape)}"
        )
    distill = distillation_advantages(student_logprobs, teacher_logprobs)
    return task_advantages.float().detach() + weight * distill


def sequence_lengths(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """cu_seqlens [N+1] -> per-sequence token counts [N]."""
    return cu_seqlens[1:] - cu_seqlens[:-1]


def expand_to_tokens(per_sequence: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-sequence value to every token of its packed sequence.  [N], cu_seqlens [N+1] -> [T]."""
    lengths = sequence_lengths(cu_seqlens).to(per_sequence.device)
    if lengths.numel() != per_sequence.numel():
        raise ValueError(f"{per_sequence.numel()} values for {lengths.numel()} sequences")
    return per_sequence.repeat_interleave(lengths)
