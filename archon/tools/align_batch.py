"""The gate's packed batch (archon.tools.align) and how it reads logits: each sequence's next-token
log-probs, the distance of two sets of logits, HF's logits one sequence at a time."""

from __future__ import annotations

import torch


def packed_batch(seq_lens, vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in seq_lens]
    tokens = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    return seqs, tokens, positions, cu_seqlens


def label_logprobs(logits: torch.Tensor, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Log-prob of each next token within each sequence, packed: [sum(len-1)]."""
    out, start = [], 0
    for seq in seqs:
        n = len(seq)
        lp = torch.log_softmax(logits[start : start + n - 1].double(), dim=-1)
        out.append(lp.gather(-1, seq[1:, None])[:, 0])
        start += n
    return torch.cat(out)


def _compare_logits(a: torch.Tensor, h: torch.Tensor) -> tuple[float, float]:
    log_p_hf = torch.log_softmax(h.double(), -1)
    log_p_archon = torch.log_softmax(a.double(), -1)
    kl = (log_p_hf.exp() * (log_p_hf - log_p_archon)).sum(-1).mean().item()
    return (a - h).abs().max().item(), max(kl, 0.0)


def _hf_forward(hf_model, seqs):
    return torch.cat([hf_model(seq[None]).logits[0] for seq in seqs])


def label_positions(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M], labels [M]) of the packed batch: each position but a sequence's last, and the next
    token, in the order of `label_logprobs`."""
    rows, labels, start = [], [], 0
    for seq in seqs:
        n = len(seq)
        rows.append(torch.arange(start, start + n - 1))
        labels.append(seq[1:])
        start += n
    return torch.cat(rows), torch.cat(labels)
