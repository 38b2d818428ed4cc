"""Drawing tokens from logits on the device, and the log-probs that go with them.

Each token's log-prob is that of the distribution it was actually drawn from, the behaviour
policy: temperature-scaled logits, truncated by top-k then top-p, renormalised (the same as vLLM's
`processed_logprobs`, which the vLLM servers are launched with). Without truncation that is
log_softmax(logits / temperature), which the trainer recomputes (`Trainer.logprobs`); with
truncation the trainer's untruncated log-probs differ from it, by exactly what the importance
weight pi_old / mu of the loss corrects for when importance sampling is on
(archon/rl/algorithms.py; on by default only for asynchronous rollouts). Greedy decoding reports
log_softmax(logits).

A decode step draws by inverting the cumulative distribution, in two stages (`draw_tokens`): a
block of about sqrt(V) consecutive tokens with the probability of its mass, then a token of the
block with the probability of its share of that mass: two uniform draws per row, and sums formed in
float64, instead of one Exp(1) draw and two logarithms per vocabulary entry (an exponential race,
which speculative decoding still uses: `draw_from`). No host sync either way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from archon.rollout.base import SamplingParams


def at_least_float32(t: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 logits up to float32; float32 and float64 (a float64 run's) as they are."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def truncated_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> log-probs [B, V] of the distribution sampled from: softmax of logits /
    temperature, cut to the top_k largest, then to the smallest set of largest tokens whose mass
    reaches top_p, renormalised (-inf outside the kept set)."""
    scaled = at_least_float32(logits)
    if sampling.temperature != 1:
        scaled = scaled / sampling.temperature
    if sampling.top_k and sampling.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scaled, dim=-1)


def sample_next_tokens(
    logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
    uniforms: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], logprobs [B]), on the logits' device, without a host sync.

    Sampled: the log-prob under the truncated, renormalised distribution (`truncated_logprobs`),
    drawn from it by `draw_tokens`. Greedy: the argmax, with its log_softmax(logits) log-prob.
    uniforms: the U[0, 1) draws [B, 2] to use (float64) instead of drawing them from `generator`.
    """
    if sampling.temperature == 0:
        logprobs = torch.log_softmax(at_least_float32(logits), dim=-1)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = truncated_logprobs(logits, sampling)
        if uniforms is None:
            uniforms = torch.rand(logits.shape[0], 2, generator=generator, dtype=torch.float64, device=logits.device)
        tokens = draw_tokens(logprobs.exp(), uniforms)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def draw_tokens(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (each row's probabilities, up to a factor), uniforms [B, 2] U[0, 1) -> tokens [B],
    token v of row b with probability probs[b, v] / probs[b].sum(). The vocabulary is cut into blocks
    of about sqrt(V) tokens; uniforms[:, 0] picks a block by inverting the cumulative sum of the
    blocks' masses, uniforms[:, 1] a token within it by inverting the block's cumulative sum (both
    sums in float64): two small cumulative sums per row, so the draw costs about one pass over
    probs. A token of probability 0 is never drawn."""
    B, V = probs.shape
    block = math.isqrt(V - 1) + 1
    num_blocks = -(-V // block)
    if num_blocks * block != V:
        probs = F.pad(probs, (0, num_blocks * block - V))
    blocks = probs.view(B, num_blocks, block)
    chosen = _invert_cdf(blocks.sum(dim=-1, dtype=torch.float64).cumsum(dim=-1), uniforms[:, 0])  # [B]
    within = blocks[torch.arange(B, device=probs.device), chosen].to(torch.float64).cumsum(dim=-1)  # [B, block]
    return chosen * block + _invert_cdf(within, uniforms[:, 1])


def _invert_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """cdf [B, N] non-decreasing cumulative sums, u [B] in [0, 1) -> [B] the first index whose sum
    exceeds u times the row's total: an index of mass 0 is never returned (the upper cut keeps a
    rounding of u * total up to the total on the row's last index of positive mass)."""
    total = cdf[:, -1:]
    index = torch.searchsorted(cdf, u[:, None].to(cdf.dtype) * total, right=True)[:, 0]
    return torch.minimum(index, (cdf < total).sum(dim=-1))


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> log-probs [..., V] of the distribution a token is drawn from: the
    temperature-scaled, top-k / top-p truncated and renormalised one (`truncated_logprobs`), or at
    temperature 0 log_softmax(logits) (whose argmax greedy decoding takes)."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    if sampling.temperature == 0:
        return torch.log_softmax(at_least_float32(flat), dim=-1).view(shape)
    return truncated_logprobs(flat, sampling).view(shape)


def draw_from(logprobs: torch.Tensor, noise: torch.Tensor | None, greedy: bool) -> torch.Tensor:
    """logprobs [R, V] -> tokens [R]: the argmax (greedy), else a draw by an exponential race with
    the Exp(1) draws `noise` [R, V]."""
    if greedy:
        return logprobs.argmax(dim=-1)
    return (logprobs - noise.log()).argmax(dim=-1)
