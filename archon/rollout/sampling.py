"""Drawing tokens from logits on the device, and the log-probs that go with them.

Each token's log-prob is that of the distribution it was actually drawn from, the behaviour
policy: temperature-scaled logits, truncated by top-k then top-p, renormalised (the same as vLLM's
`processed_logprobs`, which the vLLM servers are launched with). Without truncation that is
log_softmax(logits / temperature), which the trainer recomputes (`Trainer.logprobs`); with
truncation the trainer's untruncated log-probs differ from it, by exactly what the importance
weight pi_old / mu of the loss corrects for when importance sampling is on
(archon/rl/algorithms.py; on by default only for asynchronous rollouts). Greedy decoding reports
log_softmax(logits).

A draw is an exponential race: the argmax of log p - log E over the vocabulary, E ~ Exp(1) per
token, which is exactly a draw from p, and needs no host sync.
"""

from __future__ import annotations

import torch

from archon.rollout.base import SamplingParams


def truncated_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [B, V] -> log-probs [B, V] of the distribution sampled from: softmax of logits /
    temperature, cut to the top_k largest, then to the smallest set of largest tokens whose mass
    reaches top_p, renormalised (-inf outside the kept set)."""
    scaled = logits.float() / sampling.temperature
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
    race: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], logprobs [B]), on the logits' device, without a host sync.

    Sampled: the log-prob under the truncated, renormalised distribution (`truncated_logprobs`),
    drawn by an exponential race (argmax of log p - log E, E ~ Exp(1) per token: exactly a draw
    from p). Greedy: the argmax, with its log_softmax(logits) log-prob.
    race: the Exp(1) draws [B, V] to use instead of drawing them from `generator`.
    """
    if sampling.temperature == 0:
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        tokens = logprobs.argmax(dim=-1)
    else:
        logprobs = truncated_logprobs(logits, sampling)
        if race is None:
            race = torch.empty_like(logprobs).exponential_(generator=generator)
        tokens = (logprobs - race.log()).argmax(dim=-1)
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


def processed_logprobs(logits: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """logits [..., V] -> log-probs [..., V] of the distribution a token is drawn from: the
    temperature-scaled, top-k / top-p truncated and renormalised one (`truncated_logprobs`), or at
    temperature 0 log_softmax(logits) (whose argmax greedy decoding takes)."""
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    if sampling.temperature == 0:
        return torch.log_softmax(flat.float(), dim=-1).view(shape)
    return truncated_logprobs(flat, sampling).view(shape)


def draw_from(logprobs: torch.Tensor, noise: torch.Tensor | None, greedy: bool) -> torch.Tensor:
    """logprobs [R, V] -> tokens [R]: the argmax (greedy), else a draw by an exponential race with
    the Exp(1) draws `noise` [R, V]."""
    if greedy:
        return logprobs.argmax(dim=-1)
    return (logprobs - noise.log()).argmax(dim=-1)
