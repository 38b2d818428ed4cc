"""Context parallelism (Ulysses): one packed batch split along its tokens over the `cp` ranks.

Every rank of a context-parallel group is given the same packed batch, pads it to a multiple of
`cp` tokens (the padding is one extra sequence) and keeps the contiguous slice
tokens[rank * T/cp : (rank + 1) * T/cp]. Sequences may straddle slices. Everything that works on one
token at a time (embeddings, norms, MLPs, experts, the log-prob head) runs on the slice. A token
mixer needs whole sequences, so it trades the token split for a head split (all-to-all):

    [T/cp, H, D] on each rank  ->  [T, H/cp, D]: every token, this rank's H/cp heads

runs the mixer on whole sequences (causal attention within cu_seqlens, or the gated delta rule with
its short convolution), then trades back. The trainer passes the group to the model's forward
(`context_parallel=`), which hands it to every mixer; a forward without it (generation) runs whole.
Heads are independent in every mixer, so the result is the one-rank result. Key/value heads fewer
than `cp` (GQA) are repeated up to `cp` first.

The per-token log-probs (and entropies) of the slices are then gathered on every rank, so the loss
function sees the whole micro-batch exactly as without context parallelism; the backward hands each
rank the gradient of its own slice only. Parameters are replicated over `cp` (FSDP2 shards them over
dp_shard x cp), and each rank's gradient covers its own tokens: the reduce-scatter's sum over the
`cp` ranks is the whole gradient.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from archon.parallel.dims import ParallelDims
from archon.parallel.expert_parallel import all_to_all


@dataclass(frozen=True)
class ContextParallelGroup:
    """The ranks one packed batch is split over; this rank holds slice `rank` of `size`."""

    group: dist.ProcessGroup
    size: int
    rank: int


def tokens_to_heads(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """Differentiable [T/cp, H, ...] (this rank's tokens, all heads) -> [T, H/cp, ...] (all tokens,
    this rank's heads); H must be a multiple of cp. The backward is the reverse exchange."""
    local_tokens, heads, rest = x.shape[0], x.shape[1], x.shape[2:]
    if heads % cp.size:
        raise ValueError(f"context parallelism: {heads} heads cannot be split over cp={cp.size} ranks")
    # [T/cp, cp, H/cp, ...] -> [cp, T/cp, H/cp, ...]: chunk j of the heads goes to rank j, and slice i
    # of the tokens comes back from rank i, in token order
    send = x.reshape(local_tokens, cp.size, heads // cp.size, *rest).transpose(0, 1)
    splits = [local_tokens] * cp.size
    return all_to_all(send.reshape(cp.size * local_tokens, heads // cp.size, *rest), splits, splits, cp.group)


def heads_to_tokens(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """Differentiable [T, H/cp, ...] -> [T/cp, H, ...], the inverse of tokens_to_heads."""
    tokens, local_heads, rest = x.shape[0], x.shape[1], x.shape[2:]
    splits = [tokens // cp.size] * cp.size
    received = all_to_all(x, splits, splits, cp.group)  # [cp x T/cp, H/cp, ...]: head chunk j from rank j
    received = received.reshape(cp.size, tokens // cp.size, local_heads, *rest).transpose(0, 1)
    return received.reshape(tokens // cp.size, cp.size * local_heads, *rest)


def heads_of_rank(x: torch.Tensor, cp: ContextParallelGroup, dim: int = 0) -> torch.Tensor:
    """This rank's chunk of a per-head tensor (attention sinks, DeltaNet's A_log and dt_bias, conv
    channels grouped by head) along `dim`."""
    return x.chunk(cp.size, dim=dim)[cp.rank]


def kv_heads_for(k: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    """k or v [T/cp, Hkv, D] with at least cp heads: fewer are repeated (each kv head serves a
    contiguous run of query heads, so after the repeat rank j's query chunk still reads its own)."""
    heads = k.shape[1]
    if heads % cp.size == 0:
        return k
    return k.repeat_interleave(cp.size // heads, dim=1)


class _GatherTokens(torch.autograd.Function):
    """[T/cp, ...] per rank -> [T, ...] on every rank. Every rank computes the same loss from the
    result, so the backward keeps this rank's slice of the gradient (no sum)."""

    @staticmethod
    def forward(ctx, x, cp: ContextParallelGroup):
        ctx.cp, ctx.rows = cp, x.shape[0]
        out = x.new_empty(cp.size * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=cp.group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.cp.rank * ctx.rows : (ctx.cp.rank + 1) * ctx.rows], None


def gather_tokens(x: torch.Tensor, cp: ContextParallelGroup) -> torch.Tensor:
    return _GatherTokens.apply(x, cp)


@dataclass
class TokenSlice:
    """One rank's slice of a packed batch padded to a multiple of cp tokens.

    cu_seqlens [N+1 or N+2] and max_seqlen describe the padded batch (the padding, if any, is one
    more sequence); `local(x)` takes this rank's rows of a [T, ...] tensor (padded with `fill`).
    """

    cp: ContextParallelGroup
    num_tokens: int
    padded_tokens: int
    cu_seqlens: torch.Tensor
    max_seqlen: int

    @classmethod
    def of(cls, cu_seqlens: torch.Tensor, cp: ContextParallelGroup) -> TokenSlice:
        num_tokens = int(cu_seqlens[-1])
        padded = -(-num_tokens // cp.size) * cp.size
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        if padded > num_tokens:
            cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([padded])])
            lengths.append(padded - num_tokens)
        return cls(cp, num_tokens, padded, cu_seqlens, max(lengths))

    @property
    def local_tokens(self) -> int:
        return self.padded_tokens // self.cp.size

    def local(self, x: torch.Tensor, fill: int | float = 0) -> torch.Tensor:
        """[T, ...] -> [T_padded / cp, ...], this rank's rows."""
        if self.padded_tokens > self.num_tokens:
            pad = x.new_full((self.padded_tokens - self.num_tokens, *x.shape[1:]), fill)
            x = torch.cat([x, pad])
        start = self.cp.rank * self.local_tokens
        return x[start : start + self.local_tokens]

    def local_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Positions of this rank's rows; the padding sequence counts from 0."""
        if self.padded_tokens > self.num_tokens:
            positions = torch.cat(
                [positions, torch.arange(self.padded_tokens - self.num_tokens, device=positions.device)]
            )
        start = self.cp.rank * self.local_tokens
        return positions[start : start + self.local_tokens]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[T_padded / cp, ...] per rank -> [T, ...] (the padding dropped), differentiable."""
        return gather_tokens(x, self.cp)[: self.num_tokens]


def require_context_parallel_heads(
    dims: ParallelDims, family: str, heads: Mapping[str, int], kv_heads: Mapping[str, int] | None = None
) -> None:
    """Fail naming each head count (a config field) that context parallelism cannot split. Each
    rank's heads (count / tp) are split over cp: `heads` must divide; `kv_heads` may instead be
    repeated up to cp when their per-rank count divides cp."""
    bad = []
    for name, count in heads.items():
        if count % (dims.tp * dims.cp):
            bad.append(f"{name}={count} (needs a multiple of tp x cp = {dims.tp * dims.cp})")
    for name, count in (kv_heads or {}).items():
        local = count // dims.tp
        if local % dims.cp and dims.cp % local:
            bad.append(f"{name}={count} ({local} per tensor-parallel rank must divide cp or be a multiple of it)")
    if bad:
        raise ValueError(
            f"parallel.cp={dims.cp} cannot split the heads of this {family} model: {', '.join(bad)}; context "
            "parallelism gives each of its ranks whole heads, so choose a cp that divides them"
        )


def context_parallel_group(dims: ParallelDims) -> ContextParallelGroup | None:
    """This rank's context-parallel group, or None without context parallelism."""
    if dims.cp == 1:
        return None
    mesh = dims.cp_mesh
    return ContextParallelGroup(mesh.get_group(), dims.cp, mesh.get_local_rank())
