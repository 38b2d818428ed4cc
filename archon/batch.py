"""Packed batches: several sequences laid end to end, with no padding.

For a batch of N sequences and T tokens in all:

    tokens[T], positions[T]   token ids, and positions restarting at 0 in each sequence
    cu_seqlens[N+1]           sequence boundaries: sequence i is tokens[cu_seqlens[i]:cu_seqlens[i+1]]
    labels[T]                 the token each position predicts (tokens[t+1] in the same sequence)
    loss_mask[T]              positions whose label counts (e.g. completion tokens); the last
                              position of a sequence has no label and is never in the mask
    advantages, old_logprobs, rollout_logprobs, ref_logprobs [T]   optional per-position fields,
                              aligned with labels (old_logprobs[t] = log pi_old(labels[t]))
    extras                    any other per-position tensors [T], sliced along with the rest
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

import torch

PER_TOKEN_FIELDS = (
    "tokens",
    "positions",
    "labels",
    "loss_mask",
    "advantages",
    "old_logprobs",
    "rollout_logprobs",
    "ref_logprobs",
)


@dataclass
class PackedBatch:
    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None
    rollout_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokens.ndim != 1:
            raise ValueError(f"PackedBatch.tokens must be 1-D [T], got shape {tuple(self.tokens.shape)}")
        T = self.tokens.shape[0]
        cu = self.cu_seqlens
        if cu.ndim != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != T:
            raise ValueError(f"PackedBatch.cu_seqlens must be [N+1] from 0 to the token count {T}, got {cu.tolist()}")
        if bool((cu[1:] <= cu[:-1]).any()):
            raise ValueError(
                f"PackedBatch.cu_seqlens must be strictly increasing (no empty sequences), got {cu.tolist()}"
            )
        for name in PER_TOKEN_FIELDS:
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (T,):
                raise ValueError(f"PackedBatch.{name} has shape {tuple(value.shape)}, expected ({T},)")
        for name, value in self.extras.items():
            if value.shape[:1] != (T,):
                raise ValueError(f"PackedBatch.extras[{name!r}] has shape {tuple(value.shape)}, expected ({T}, ...)")
        self.loss_mask = self.loss_mask.bool()

    # ---- sizes --------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return self.tokens.shape[0]

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    @property
    def seq_lens(self) -> list[int]:
        return (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist()

    @property
    def max_seqlen(self) -> int:
        return max(self.seq_lens)

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def sequence_index(self) -> torch.Tensor:
        """[T]: which sequence each position belongs to."""
        lengths = self.cu_seqlens[1:] - self.cu_seqlens[:-1]
        return torch.repeat_interleave(torch.arange(self.num_sequences, device=lengths.device), lengths)

    # ---- construction and slicing -------------------------------------------------------------
    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        prompt_lens: Sequence[int] | None = None,
        advantages: Sequence[float] | torch.Tensor | None = None,
        device: torch.device | str = "cpu",
    ) -> "PackedBatch":
        """Pack token sequences. With `prompt_lens`, only completion tokens (after the prompt) are
        labels in the loss; otherwise every next token is. `advantages` (one per sequence) are
        broadcast to that sequence's positions, in fp32 (fp64 when given as an fp64 tensor)."""
        if not sequences:
            raise ValueError("PackedBatch.from_sequences needs at least one sequence")
        seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
        lengths = [len(s) for s in seqs]
        if min(lengths) < 1:
            raise ValueError("PackedBatch.from_sequences: empty sequence")
        if prompt_lens is not None and len(prompt_lens) != len(seqs):
            raise ValueError(f"prompt_lens has {len(prompt_lens)} entries for {len(seqs)} sequences")
        if advantages is not None and len(advantages) != len(seqs):
            raise ValueError(f"advantages has {len(advantages)} entries for {len(seqs)} sequences")
        tokens = torch.cat(seqs)
        positions = torch.cat([torch.arange(n) for n in lengths])
        cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
        labels = torch.zeros_like(tokens)
        loss_mask = torch.zeros(tokens.shape, dtype=torch.bool)
        for i, seq in enumerate(seqs):
            start, n = int(cu_seqlens[i]), lengths[i]
            labels[start : start + n - 1] = seq[1:]
            first = 0 if prompt_lens is None else max(prompt_lens[i] - 1, 0)
            loss_mask[start + first : start + n - 1] = True
        adv = None
        if advantages is not None:
            adv = torch.as_tensor(advantages)
            adv = adv.to(torch.promote_types(adv.dtype, torch.float32))
            adv = torch.repeat_interleave(adv, torch.tensor(lengths))
        batch = cls(tokens, positions, cu_seqlens, labels, loss_mask, advantages=adv)
        return batch.to(device)

    def to(self, device: torch.device | str) -> "PackedBatch":
        def move(t):
            return None if t is None else t.to(device)

        return replace(
            self,
            **{name: move(getattr(self, name)) for name in (*PER_TOKEN_FIELDS, "cu_seqlens")},
            extras={k: v.to(device) for k, v in self.extras.items()},
        )

    def select(self, seq_indices: Sequence[int]) -> "PackedBatch":
        """A new batch with the given sequences, in that order."""
        if len(seq_indices) == 0:
            raise ValueError("PackedBatch.select needs at least one sequence")
        bounds = self.cu_seqlens.tolist()
        spans = [(bounds[i], bounds[i + 1]) for i in seq_indices]
        index = torch.cat([torch.arange(a, b) for a, b in spans]).to(self.tokens.device)
        lengths = [b - a for a, b in spans]
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=self.cu_seqlens.device)

        def take(t):
            return None if t is None else t[index]

        values = {f.name: take(getattr(self, f.name)) for f in fields(self) if f.name in PER_TOKEN_FIELDS}
        return PackedBatch(cu_seqlens=cu, extras={k: v[index] for k, v in self.extras.items()}, **values)

    def split_by_tokens(self, token_budget: int) -> list["PackedBatch"]:
        """Consecutive whole sequences grouped so each group has at most `token_budget` tokens (a
        longer sequence forms a group of its own)."""
        if token_budget < 1:
            raise ValueError(f"token_budget must be positive, got {token_budget}")
        groups: list[list[int]] = [[]]
        size = 0
        for i, n in enumerate(self.seq_lens):
            if groups[-1] and size + n > token_budget:
                groups.append([])
                size = 0
            groups[-1].append(i)
            size += n
        if len(groups) == 1:
            return [self]
        return [self.select(g) for g in groups]

    def shard(self, rank: int, world: int) -> "PackedBatch":
        """Sequences rank, rank+world, ... (a simple data-parallel split for tests and tools)."""
        indices = list(range(rank, self.num_sequences, world))
        if not indices:
            raise ValueError(f"batch of {self.num_sequences} sequences has none for rank {rank} of {world}")
        return self.select(indices)
