"""The prefill steps of a generation (archon/rollout/generation.py): the prompts of newly admitted
groups, packed into forwards that store their keys/values in the cache's slots.

Chunked prefill: with `prefill_chunk_tokens`, a prefill of more prompt tokens than that runs as
successive forwards of at most that many tokens: a long prompt is split across forwards, short ones
share one, and each forward continues its prompts from what the cache holds after the previous one
(as a kept session is continued). The activations of a prefill are then bounded by the budget
rather than by the prompts' length; the results are the one-shot prefill's. Only the forward that
ends a prompt computes its logits and samples its first token.
"""

from __future__ import annotations

import torch

from archon.head import full_vocab_logits
from archon.routing_replay import take_recorded


def prompt_chunks(pieces: list[tuple[int, int, int]], budget: int | None) -> list[list[tuple[int, int, int]]]:
    """(slot, start, end) prompt slices -> the forwards that prefill them: each a list of
    (slot, start, end), at most `budget` tokens per forward (None: one forward), a slice that does
    not fit continuing in the next."""
    forwards: list[list[tuple[int, int, int]]] = []
    current: list[tuple[int, int, int]] = []
    room = budget
    for slot, start, end in pieces:
        if budget is None:
            current.append((slot, start, end))
            continue
        while start < end:
            take = min(end - start, room)
            current.append((slot, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                forwards.append(current)
                current, room = [], budget
    if current:
        forwards.append(current)
    return forwards


class PrefillSteps:
    """The prefill steps of Generation (archon/rollout/generation.py), on its state: its groups and
    slots, its cache, the slots' last prompt logits and versions, and the recorded routing."""

    def _prefill_chunks(self, slots: list[int]) -> list[list[tuple[int, int, int]]]:
        """The forwards that prefill the prompts of `slots`: each a list of (slot, start, end), the
        slice prompt[start:end] of the slot's prompt it packs, in slot order. A prompt starts after
        the kept state it continues; with `prefill_chunk_tokens` no forward packs more tokens than
        that, a prompt that does not fit continues in the next forward, and a slot appears at most
        once per forward. No slots: no forwards."""
        pieces = []
        for slot in slots:
            group = self.groups[self.slot_group[slot]]
            pieces.append((slot, 0 if group.kept is None else len(group.kept.tokens), len(group.prompt)))
        return prompt_chunks(pieces, self.engine.prefill_chunk_tokens)

    def _prefill(self, slots: list[int], chunks: list[list[tuple[int, int, int]]]) -> None:
        """Prefill the prompts of `slots` (after the kept state a group continues, only the rest of
        its prompt) in the forwards `chunks` (`_prefill_chunks`), and keep each one's last logits."""
        dev = self.device
        kept_lens = []
        for slot in slots:
            group = self.groups[self.slot_group[slot]]
            kept_lens.append(0 if group.kept is None else len(group.kept.tokens))
            if group.kept is not None:
                self.cache.load_kept(slot, group.kept)
                group.kept = None  # released once in the cache
        prompt_of = {slot: self.groups[self.slot_group[slot]].prompt for slot in slots}
        self.engine.stats.reused_tokens += sum(kept_lens)
        if self.moe:
            self.prompt_experts[slots] = -1
        adapter_of = {slot: self.groups[self.slot_group[slot]].adapter for slot in slots}
        # [prompts ending in the forward, V] per forward, in slot order
        last_logits = [self._prefill_forward(pieces, prompt_of, adapter_of) for pieces in chunks]
        for slot in slots:
            self.slot_version[slot] = self.version
        logits = torch.cat(last_logits)  # [len(slots), V]
        if self.slot_logits is None:
            self.slot_logits = logits.new_zeros(len(self.slot_group), logits.shape[-1])
        self.slot_logits[torch.tensor(slots, device=dev)] = logits
        if self.drafter is not None:  # the drafter prefills the whole prompt (a kept state is the target's)
            self.drafter.prefill(prompt_of, adapter_of, self.engine.prefill_chunk_tokens)

    def _prefill_forward(
        self, pieces: list[tuple[int, int, int]], prompt_of: dict[int, list[int]], adapter_of: dict[int, int]
    ) -> torch.Tensor:
        """One forward of a prefill: the (slot, start, end) slices `pieces` of the slots' prompts
        (slot -> prompt ids; slot -> task), packed in order -> the logits [prompts it ends, V] at the
        last token of each prompt that ends in it, in order."""
        dev = self.device
        stats = self.engine.stats
        lens = torch.tensor([end - start for _, start, end in pieces])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        tokens = torch.tensor([t for slot, start, end in pieces for t in prompt_of[slot][start:end]], device=dev)
        positions = torch.cat([torch.arange(start, end) for _, start, end in pieces]).to(dev)
        starts = torch.tensor([start for _, start, _ in pieces])
        self.cache.begin_prefill(torch.tensor([slot for slot, _, _ in pieces]), lens, starts)
        ends_prompt = torch.tensor([end == len(prompt_of[slot]) for slot, _, end in pieces])
        token_adapters = None
        if self.multi_task:
            token_adapters = torch.tensor([adapter_of[slot] for slot, _, _ in pieces], device=dev).repeat_interleave(
                lens.to(dev)
            )
        logits_rows = (cu_seqlens[1:] - 1)[ends_prompt].to(dev)
        if self.drafter is not None and self.drafter.needs_target_hidden:
            hidden = self._forward(
                token_adapters,
                tokens,
                positions,
                cu_seqlens.to(dev),
                int(lens.max()),
                cache=self.cache,
                return_hidden=True,
            )
            logits = full_vocab_logits(hidden[logits_rows], self.model.output_weight)
            self.drafter.prefill_hidden(pieces, prompt_of, hidden)
        else:
            logits = self._forward(
                token_adapters,
                tokens,
                positions,
                cu_seqlens.to(dev),
                int(lens.max()),
                cache=self.cache,
                logits_rows=logits_rows,
            )
        if self.moe:
            chosen = take_recorded(self.moe)  # [tokens of the forward, L, k]
            for i, (slot, start, end) in enumerate(pieces):
                self.prompt_experts[slot, start:end] = chosen[int(cu_seqlens[i]) : int(cu_seqlens[i + 1])].to(
                    torch.int16
                )
        stats.prefill_tokens += int(lens.sum())
        stats.prefill_forwards += 1
        stats.max_prefill_forward_tokens = max(stats.max_prefill_forward_tokens, int(lens.sum()))
        return logits
