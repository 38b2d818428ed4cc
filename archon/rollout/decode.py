"""The decode steps of a generation (archon/rollout/generation.py): each busy row takes one token.

- Sampling on the device. Tokens, log-probs and each row's done flag stay on the device; the host
  reads the done flags once every `stop_check_interval` decode steps (only when there are stop
  tokens: without them, when a row ends is known in advance) and the finished rows' tokens once.
  A step covers the rows up to the last busy one, and the head runs on each row's last position.
- On CUDA (one process, one task), the decode step is captured once per `generate` in a CUDA graph
  and replayed: one launch per step instead of one per op (`cuda_graphs`); the step then runs over
  the whole table and the whole cache, the same shapes at every step.
- Speculative decoding (archon/rollout/speculative.py): a round drafts k tokens per row, verifies
  the k + 1 positions of every row in one forward, and emits 1 to k + 1 tokens per row.
"""

from __future__ import annotations

import logging
import warnings

import torch

from archon.head import full_vocab_logits
from archon.rollout.recurrent_cache import RecurrentRollback
from archon.rollout.sampling import processed_logprobs, sample_next_tokens
from archon.rollout.speculative import accept_greedy, accept_sampled
from archon.routing_replay import take_recorded

logger = logging.getLogger(__name__)


def _syncs_with_host(fn) -> bool:
    """Run fn (on a CUDA device) and say whether it synchronised with the host (.item(), .tolist(),
    a data-dependent shape): such a step cannot be captured in a CUDA graph."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    return any("synchronizing CUDA operation" in str(w.message) for w in caught)


class DecodeSteps:
    """The decode steps of Generation (archon/rollout/generation.py), on its state: the per-row
    tables on the device, the rows' samples and steps, the cache, the drafter and the CUDA graph."""

    def _decode(self, busy: list[int]) -> None:
        """One decode step: feed each row its last token. Eager: over the rows up to the last busy
        one and the slots up to the last one they read, with the keys the busy rows have so far.
        Static (CUDA graphs): over the whole table and the whole cache, the same shapes at every step."""
        if self.drafter is not None:
            self._speculative_round(busy)
            k = self.drafter.num_tokens
            for r in busy:
                self.row_span[r] = min(self.row_span[r] + k + 1, self.max_new)
        elif self.static_decode:
            self._decode_static()
        else:
            slots = [self.row_sample[r][0] for r in busy]
            prefix_span = max(len(self.groups[self.slot_group[slot]].prompt) for slot in slots)
            suffix_span = min(self.max_new, max(self.row_steps[r] for r in busy))
            self._decode_step(max(busy) + 1, max(slots) + 1, prefix_span, suffix_span)
        self.engine.stats.decode_steps += 1
        for r in busy:
            self.row_steps[r] = min(self.row_steps[r] + 1, self.max_new)

    def _speculative_round(self, busy: list[int]) -> None:
        """One speculative decode round over the rows up to the last busy one: the drafter proposes k
        tokens per row, one forward feeds each row its last token and the k drafts (positions
        ngen - 1 .. ngen - 1 + k of its suffix), and each row emits its accepted drafts and one
        token of the target's (archon/rollout/speculative.py), cut at a stop token and at
        max_new_tokens. The keys of rejected drafts stay in the cache past the row's length, unread."""
        drafter, sampling, dev = self.drafter, self.sampling, self.device
        k = drafter.num_tokens
        R = max(busy) + 1
        slots = [self.row_sample[r][0] for r in busy]
        S = max(slots) + 1
        prefix_span = max(len(self.groups[self.slot_group[slot]].prompt) for slot in slots)
        suffix_span = min(self.cache.max_new_tokens, max(self.row_span[r] for r in busy) + k)
        ngen, done = self.ngen[:R], self.done[:R]
        live = ~done
        rows = torch.arange(R, device=dev)
        V = self.slot_logits.shape[-1]
        greedy = sampling.temperature == 0
        draft_noise = accept_noise = correction_noise = None
        if not greedy:  # every Exp(1) draw of the round at once, each sample's from its own generator
            noise = self._round_noise(R, (2 * k + 1) * V + k)
            draft_noise = noise[:, : k * V].view(R, k, V)
            accept_noise = noise[:, k * V : k * V + k]
            correction_noise = noise[:, k * V + k :].view(R, k + 1, V)
        row_tasks = self.row_adapter[:R] if self.multi_task else None
        prompt_lens = self.prompt_lens[:R]
        drafts, draft_probs = drafter.propose(
            self.tokens[:R], ngen, prompt_lens, live, row_tasks, S, prefix_span, suffix_span, sampling, V, draft_noise
        )
        last = (ngen - 1).clamp(min=0)
        index = torch.arange(k + 1, device=dev)
        positions = last[:, None] + index  # [R, k + 1]
        fed = torch.cat([self.tokens[rows, last][:, None], drafts], dim=1)
        self.cache.begin_decode(R, S, positions, prompt_lens, prefix_span, suffix_span, live_rows=live)
        wants_hidden = drafter.needs_target_hidden
        rollback = RecurrentRollback(self.model)  # recurrent states back to each row's kept tokens
        with rollback.capture():
            verified = self._forward(
                None if row_tasks is None else row_tasks.repeat_interleave(k + 1),
                fed.reshape(-1),
                (prompt_lens[:, None] + positions).reshape(-1),
                torch.arange(0, R * (k + 1) + 1, k + 1, device=dev),
                k + 1,
                cache=self.cache,
                return_hidden=wants_hidden,
            )  # [R * (k + 1), V] logits, or [R * (k + 1), D] final hidden states for the drafter
        logits = full_vocab_logits(verified, self.model.output_weight) if wants_hidden else verified
        target_logprobs = processed_logprobs(logits.view(R, k + 1, -1), sampling)
        if greedy:
            out, out_logprobs, accepted = accept_greedy(target_logprobs, drafts)
        else:
            out, out_logprobs, accepted = accept_sampled(
                target_logprobs, drafts, draft_probs, accept_noise, correction_noise
            )
        emit = (index <= accepted[:, None]) & (index < (self.max_new - ngen)[:, None]) & live[:, None]
        stops = torch.isin(out, self.stop_ids) & emit
        emit &= (stops.long().cumsum(dim=1) - stops.long()) == 0  # nothing after a stop token
        # a row emits nothing at or past max_new_tokens: the other places write their own value back,
        # those past the table into its spare last column
        columns = (ngen[:, None] + index).clamp(max=self.max_new)
        row_index = rows[:, None].expand(R, k + 1)
        self.tokens[row_index, columns] = torch.where(emit, out, self.tokens[row_index, columns])
        self.logprobs[row_index, columns] = torch.where(emit, out_logprobs, self.logprobs[row_index, columns])
        self.token_versions[row_index, columns] = torch.where(
            emit, self.version_now, self.token_versions[row_index, columns]
        )
        rollback.rewind(emit.sum(dim=1))
        if wants_hidden:
            drafter.verified(verified.view(R, k + 1, -1), out, ngen.clone(), emit.sum(dim=1), live)
        ngen += emit.sum(dim=1)  # in place: views of the engine's per-row state
        done |= live & ((stops & emit).any(dim=1) | (ngen >= self.max_new))
        self.speculative_counts += torch.stack([live.sum() * k, (accepted * live).sum()])

    def _round_noise(self, R: int, size: int) -> torch.Tensor:
        """Exp(1) draws [R, size] for a speculative round: each busy row's from its sample's own
        generator when samples draw on their own (free rows: ones), else from the call's."""
        if not self.sample_noise:
            return torch.empty(R, size, device=self.device).exponential_(generator=self.generator)
        noise = torch.ones(R, size, device=self.device)
        for row, sample in enumerate(self.row_sample[:R]):
            if sample is not None:
                slot, place = sample
                noise[row].exponential_(generator=self.sample_generators[self.slot_group[slot], place])
        return noise

    def _decode_static(self) -> None:
        c = self.cache
        step = lambda: self._decode_step(c.num_rows_total, c.num_slots, c.max_prompt_len, c.max_new_tokens)  # noqa: E731
        if self.device.type != "cuda":  # the same shapes, run eagerly (how the CPU tests check them)
            step()
        elif self.graph is not None:
            self.graph.replay()
        else:
            # a real step, which also warms up the kernels before the capture; a step that syncs with
            # the host (MoE routing, recurrent layers) cannot be captured, and is found out here rather
            # than by a capture that fails halfway
            if _syncs_with_host(step):
                logger.info("the decode step synchronises with the host; decoding eagerly, without a CUDA graph")
                self.static_decode = False
                return
            self.graph = self._capture(step)
            self.static_decode = self.graph is not None

    def _capture(self, step) -> torch.cuda.CUDAGraph | None:
        """`step` recorded (not run) in a CUDA graph, or None (logged) when it cannot be."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(self.device)
        try:
            if self.generator is not None:  # a seeded generator's offsets must advance per replay
                graph.register_generator_state(self.generator)
            with torch.cuda.graph(graph):
                step()
        # RuntimeError: the capture failed; AttributeError: a torch without register_generator_state
        except (RuntimeError, AttributeError) as e:
            # a capture that fails on exit leaves its capture stream current: restore this thread's
            torch.cuda.set_stream(stream)
            logger.info("the decode step cannot be captured in a CUDA graph (%s); decoding eagerly", e)
            return None
        return graph

    def _decode_step(self, R: int, S: int, prefix_span: int, suffix_span: int) -> None:
        """Rows 0..R-1 (reading slots 0..S-1) take one token; all state stays on the device (no host sync)."""
        ngen, done = self.ngen[:R], self.done[:R]
        suffix_pos = (ngen - 1).clamp(min=0)
        last = self.tokens[:R].gather(1, suffix_pos[:, None])[:, 0]
        self.cache.begin_decode(R, S, suffix_pos, self.prompt_lens[:R], prefix_span, suffix_span, live_rows=~done)
        logits = self._forward(
            self.row_adapter[:R] if self.multi_task else None,
            last,
            self.prompt_lens[:R] + suffix_pos,
            torch.arange(R + 1, device=self.device),
            1,
            cache=self.cache,
        )
        token, logprob = sample_next_tokens(logits, self.sampling, self.generator, self._sample_uniforms(R))
        rows = torch.arange(R, device=self.device)
        if self.moe:  # the fed token is completion token suffix_pos of each live row
            chosen = take_recorded(self.moe).to(torch.int16)  # [R, L, k]
            kept = self.completion_experts[rows, suffix_pos]
            self.completion_experts[rows, suffix_pos] = torch.where((~done)[:, None, None], chosen, kept)
        self.tokens[rows, ngen], self.logprobs[rows, ngen] = token, logprob
        self.token_versions[rows, ngen] = self.version_now
        live = ~done
        ngen += live  # in place: views of the engine's per-row state
        done |= live & (torch.isin(token, self.stop_ids) | (ngen >= self.max_new))

    def _sample_uniforms(self, rows: int) -> torch.Tensor | None:
        """The U[0, 1) draws [rows, 2] of a decode step's sampling (sampling.draw_tokens), each busy
        row's drawn from its sample's own generator (free rows: zeros), or None when samples do not
        draw on their own."""
        if not self.sample_noise:
            return None
        uniforms = torch.zeros(rows, 2, dtype=torch.float64, device=self.device)
        for row, sample in enumerate(self.row_sample[:rows]):
            if sample is not None:
                slot, place = sample
                uniforms[row].uniform_(generator=self.sample_generators[self.slot_group[slot], place])
        return uniforms
