"""Scoring token sequences with a model on packed input: the log-probs training differentiates, and
the prompt log-probs (and top-k) a sample request asks for."""

from __future__ import annotations

import torch
from torch import nn

from archon.head import full_vocab_logits, model_label_logprobs


def _packed(sequences: list[torch.Tensor], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    lengths = [int(s.numel()) for s in sequences]
    tokens = torch.cat(sequences).to(device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return tokens, positions, cu_seqlens, max(lengths)


def packed_logprobs(
    model: nn.Module, inputs: list[torch.Tensor], targets: list[torch.Tensor], device
) -> list[torch.Tensor]:
    """Per sequence i: log p(targets[i][t] | inputs[i][: t + 1]) for every t, [N_i] (with gradient
    when grad is enabled). The sequences run in one packed forward."""
    tokens, positions, cu_seqlens, max_seqlen = _packed(inputs, device)
    rows = torch.arange(tokens.shape[0], device=device)
    labels = torch.cat(targets).to(device)
    logprobs, _ = model_label_logprobs(model, tokens, positions, cu_seqlens, max_seqlen, rows, labels)
    return list(torch.split(logprobs, [int(s.numel()) for s in inputs]))


@torch.no_grad()
def prompt_scores(
    model: nn.Module, prompt: list[int], device, top_k: int = 0
) -> tuple[list[float], list[list[tuple[int, float]]] | None]:
    """(log p(prompt[t] | prompt[:t]) per prompt token, NaN for the first; with top_k, each position's
    top_k (token, log-prob) of that distribution, empty for the first position)."""
    was_training = model.training
    model.eval()
    try:
        tokens, positions, cu_seqlens, max_seqlen = _packed([torch.tensor(prompt)], device)
        hidden = model(tokens, positions, cu_seqlens, max_seqlen, return_hidden=True)[:-1]
        logits = full_vocab_logits(hidden, model.output_weight).float()
        log_softmax = torch.log_softmax(logits, dim=-1)
        scored = log_softmax.gather(-1, tokens[1:, None])[:, 0]
        values = [float("nan"), *scored.tolist()]
        top = None
        if top_k > 0:
            best = log_softmax.topk(min(top_k, log_softmax.shape[-1]), dim=-1)
            top = [[]] + [list(zip(i.tolist(), v.tolist())) for i, v in zip(best.indices, best.values)]
        return values, top
    finally:
        model.train(was_training)


@torch.no_grad()
def completion_topk(
    model: nn.Module, prompt: list[int], completion: list[int], top_k: int, device
) -> list[list[tuple[int, float]]]:
    """The top_k (token, log-prob) of the model's next-token distribution at each completion position."""
    if not completion:
        return []
    _, top = prompt_scores(model, prompt + completion, device, top_k)
    return top[len(prompt) : len(prompt) + len(completion)]
