"""One `generate` call of the embedded engine (archon/rollout/native.py): its cache, the state of
every row on the device, and the round loop that admits prompts, starts samples and collects them.

A round collects the samples that ended, starts samples on the free rows (of prompts already
prefilled, else of the next waiting prompts, admitted into free slots), prefills the admitted
prompts (archon/rollout/prefill.py), then runs up to `stop_check_interval` decode steps
(archon/rollout/decode.py). Under a sync group the ranks agree on each round's numbers of forwards
first (see the engine's docstring, Lockstep).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from archon.lora import adapter_routing
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.decode import DecodeSteps
from archon.rollout.kv_cache import KeptState, KVCache
from archon.rollout.prefill import PrefillSteps
from archon.rollout.sampling import sample_next_tokens
from archon.rollout.sessions import KeptSession
from archon.routing_replay import moe_routers, take_recorded


@dataclass
class PromptGroup:
    """One prompt and its samples, which share its prefix slot."""

    prompt_index: int
    prompt: list[int]
    samples: int
    adapter: int = 0
    """The task whose adapter the group samples with (multi-task models)."""
    generator: torch.Generator | None = None
    """The group's own generator, which seeds its samples' (multi-task generation with a seed)."""
    session_keys: list[Hashable] | None = None
    """The keys its samples' states are kept under (one per sample), or None."""
    kept: KeptState | None = None
    """A kept state for a prefix of the prompt, which the prefill continues."""


ROUTED_EXPERTS = "routed_experts"
"""Sample.extra key of the recorded routing (NativeRolloutEngine(record_routing=True)): int16
[len(prompt_ids) + len(completion_ids), L_moe, k], the expert ids MoE layer l routed each token to
(prompt tokens: in the prefill; completion tokens: in the decode step that fed them). Rows of -1:
tokens the engine did not run (a prompt prefix read from a kept session, the last completion token)."""


class Generation(PrefillSteps, DecodeSteps):
    """One `generate` call: the cache, the per-row state on the device, the round loop.

    engine: the NativeRolloutEngine (archon/rollout/native.py) generating, whose model, settings,
    stats, kept sessions and adapter updates the generation uses."""

    def __init__(
        self,
        engine,
        groups: list[PromptGroup],
        sampling: SamplingParams,
        generator,
        multi_task: bool = False,
        version: int = 0,
    ):
        self.engine, self.model, self.device = engine, engine.model, engine.device
        self.version = version
        """The adapter version the model holds now: of the tokens sampled next, and of kept states."""
        self.updates_in_flight = engine.sync_group is None
        """Whether an update_adapter applies between steps (not with ranks in lockstep)."""
        self.sampling, self.generator = sampling, generator
        self.groups = groups
        G = groups[0].samples if groups else 1
        self.G = G
        rows = max(1, min(len(groups) * G, engine.max_batch_sequences))
        # enough prefix slots for the rows' groups and as many again, which rows freed while a
        # group's longest sample runs start the samples of
        num_slots = max(1, min(len(groups), 2 * -(-rows // G)))
        max_prompt = max((len(g.prompt) for g in groups), default=1)
        limit = engine.speculative_max_rows
        self.drafter = engine.drafter if limit is None or rows <= limit else None
        # speculative decoding verifies up to k tokens past a row's last one: k more suffix places
        draft_tokens = 0 if self.drafter is None else self.drafter.num_tokens
        self.cache = KVCache(
            len(self.model.layers), num_slots, rows, G, max_prompt, sampling.max_new_tokens + draft_tokens, self.device
        )
        self.max_new = sampling.max_new_tokens
        self.multi_task = multi_task
        self._init_row_tables(rows, num_slots, version)
        # on the host
        self.slot_group: list[int | None] = [None] * num_slots
        self.slot_unfinished = [0] * num_slots
        """Samples of the slot's group not yet ended (the slot is freed when none are left)."""
        self.row_sample: list[tuple[int, int] | None] = [None] * rows
        """(slot, sample place) of the sample each row holds, or None for a free row."""
        self.row_steps = [0] * rows
        """Tokens generated so far by the row's sample (an upper bound once samples can stop; with
        speculative decoding, a lower bound: a round emits 1 to k + 1 tokens)."""
        self.row_span = [0] * rows
        """Speculative decoding: an upper bound of the row's generated tokens."""
        self.speculative_counts = torch.zeros(2, dtype=torch.long, device=self.device)
        """Speculative decoding: draft tokens proposed and accepted in this generation."""
        self.waiting_samples: deque[tuple[int, int]] = deque()
        """(slot, place) of the samples of prefilled prompts that wait for a free row."""
        self._init_decode_mode(rows, num_slots, max_prompt)
        self.samples: dict[int, list[Sample | None]] = {}
        """Each group's samples, by group index."""

    def _init_row_tables(self, rows: int, num_slots: int, version: int) -> None:
        """The per-row state on the device (and each slot's last prompt logits and version)."""
        dev, sampling = self.device, self.sampling
        # per row, on the device; column ngen of `tokens` takes the next token (one spare column for
        # rows that are done and keep writing there until they start another sample)
        self.tokens = torch.zeros(rows, self.max_new + 1, dtype=torch.long, device=dev)
        # fp32, or fp64 for an fp64 model (whose log-probs an equality test compares in fp64)
        logprob_dtype = torch.promote_types(self.model.embed_tokens.weight.dtype, torch.float32)
        self.logprobs = torch.zeros(rows, self.max_new + 1, dtype=logprob_dtype, device=dev)
        self.token_versions = torch.zeros(rows, self.max_new + 1, dtype=torch.long, device=dev)
        self.version_now = torch.tensor(version, dtype=torch.long, device=dev)
        """self.version on the device (written in place: a captured decode step reads it)."""
        self.ngen = torch.zeros(rows, dtype=torch.long, device=dev)
        self.done = torch.ones(rows, dtype=torch.bool, device=dev)
        self.prompt_lens = torch.zeros(rows, dtype=torch.long, device=dev)
        self.row_adapter = torch.zeros(rows, dtype=torch.long, device=dev)
        """Each row's task (multi-task models); free rows keep their last one."""
        self.sample_noise = self.multi_task and sampling.seed is not None and sampling.temperature > 0
        """Whether each sample draws its sampling noise from its own generator."""
        self.sample_generators: dict[tuple[int, int], torch.Generator] = {}
        """(group, sample) -> the sample's generator, while the sample's group is in a slot."""
        self.stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        self.slot_logits: torch.Tensor | None = None
        """[num_slots, V]: the logits at each slot's last prompt token, which its samples start from."""
        self.slot_version = [version] * num_slots
        """The adapter version of each slot's prefill (of its samples' first tokens)."""

    def _init_decode_mode(self, rows: int, num_slots: int, max_prompt: int) -> None:
        """Whether decode steps replay a CUDA graph, and the tables of the recorded routing (MoE)."""
        engine, dev = self.engine, self.device
        # not under a sync group: the step's collectives (FSDP gathers, TP reductions) stay eager
        # nor with several tasks: the routing of tokens to adapters changes as rows start samples
        self.static_decode = (
            engine.cuda_graphs
            and self.drafter is None
            and not self.multi_task
            and engine.sync_group is None
            and self.device.type == "cuda"
            and torch.cuda.is_available()
        )
        self.graph = None
        self.moe = moe_routers(self.model) if engine.record_routing else None
        if self.moe:
            # recording reads each step's expert ids on the host side of the step: no CUDA graph
            self.static_decode = False
            shape = (len(self.moe), self.moe[0].top_k)
            self.prompt_experts = torch.full((num_slots, max_prompt, *shape), -1, dtype=torch.int16, device=dev)
            self.completion_experts = torch.full((rows, self.max_new + 1, *shape), -1, dtype=torch.int16, device=dev)

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> list[Sample]:
        if self.drafter is not None:
            self.drafter.begin(self.cache)
        try:
            return self._run()
        finally:
            if self.drafter is not None:
                self.drafter.end()
                proposed, accepted = self.speculative_counts.tolist()
                self.engine.stats.speculative_proposed += proposed
                self.engine.stats.speculative_accepted += accepted

    def _run(self) -> list[Sample]:
        waiting = deque(range(len(self.groups)))
        interval = self.engine.stop_check_interval if self.sampling.stop_token_ids else self.max_new
        if self.drafter is not None:  # a round emits 1 to k + 1 tokens: read the done flags after each
            interval = 1
        while True:
            self._collect_finished()
            free_rows = deque(r for r, sample in enumerate(self.row_sample) if sample is None)
            starts = []  # (row, slot, place) of the samples that start this round
            while free_rows and self.waiting_samples:
                starts.append((free_rows.popleft(), *self.waiting_samples.popleft()))
            admitted = []
            for slot, group in enumerate(self.slot_group):
                if not (free_rows and waiting):
                    break
                if group is None:
                    admitted.append(slot)
                    self._admit(slot, waiting.popleft())
                    for place in range(self.G):
                        if free_rows:
                            starts.append((free_rows.popleft(), slot, place))
                        else:
                            self.waiting_samples.append((slot, place))
            for row, slot, place in starts:
                self.row_sample[row] = (slot, place)
                self.row_steps[row] = self.row_span[row] = 1  # the prompt's last logits give the first token
            busy = [r for r, sample in enumerate(self.row_sample) if sample is not None]
            needed = min(interval, max((self.max_new - self.row_steps[r] for r in busy), default=0))
            chunks = self._prefill_chunks(admitted)
            more = bool(busy or self.waiting_samples or waiting)
            prefill_forwards, steps, more = self.engine._agree(len(chunks), needed, int(more))
            if not more:  # every rank is done
                break
            if admitted:
                self._take_update(fresh_slots=admitted, fresh_rows=[row for row, _, _ in starts])
                self._prefill(admitted, chunks)
            for _ in range(prefill_forwards - len(chunks)):
                self._idle_forward()
            if starts:
                self._start(starts)
            for _ in range(steps):
                if busy:
                    self._take_update()
                    self._decode(busy)
                else:
                    self._idle_forward()
        return [s for i in range(len(self.groups)) for s in self.samples[i]]

    def _take_update(self, fresh_slots: list[int] = (), fresh_rows: list[int] = ()) -> None:
        """At a step boundary: apply an adapter update published meanwhile (update_adapter), then
        compute the cached context again under it. `fresh_slots` / `fresh_rows`: admitted or
        assigned this round, not yet prefilled or started (nothing cached to recompute)."""
        if not self.updates_in_flight:
            return
        version = self.engine._apply_pending_update()
        if version is not None:
            self.version = version
            self.version_now.fill_(version)
            self._recompute_context(fresh_slots, fresh_rows)

    def _recompute_context(self, fresh_slots, fresh_rows) -> None:
        """What the cache holds was computed by the previous adapter. Prefill every prompt in a slot
        again (its samples not yet started then draw their first token from the new version's
        logits), and feed every started sample's tokens so far again, one position per forward, each
        row from its slot's new state: the next tokens are then drawn from the new version's full
        forward over the whole context, which the trainer reproduces. Costs one prefill of the
        prompts and as many one-token-per-row forwards as the longest sample has tokens."""
        slots = [slot for slot, group in enumerate(self.slot_group) if group is not None and slot not in fresh_slots]
        if not slots:
            return
        self._prefill(slots, self._prefill_chunks(slots))
        rows = [row for row, sample in enumerate(self.row_sample) if sample is not None and row not in fresh_rows]
        if not rows:
            return
        dev = self.device
        self.cache.start_rows(rows, [self.row_sample[r][0] for r in rows], [self.row_sample[r][1] for r in rows])
        R = max(rows) + 1
        S = max(self.row_sample[r][0] for r in rows) + 1
        prefix_span = max(len(self.groups[self.slot_group[self.row_sample[r][0]]].prompt) for r in rows)
        cached = torch.zeros(R, dtype=torch.long, device=dev)  # tokens through the model: all but the last
        rows_t = torch.tensor(rows, device=dev)
        cached[rows_t] = (self.ngen[rows_t] - 1).clamp(min=0)
        last_cached = (cached - 1).clamp(min=0)
        for j in range(int(cached.max())):
            position = last_cached.clamp(max=j)  # a row past its tokens writes its last one again
            live = j < cached  # the others keep their recurrent state
            self.cache.begin_decode(R, S, position, self.prompt_lens[:R], prefix_span, j + 1, live_rows=live)
            self._forward(
                self.row_adapter[:R] if self.multi_task else None,
                self.tokens[:R].gather(1, position[:, None])[:, 0],
                self.prompt_lens[:R] + position,
                torch.arange(R + 1, device=dev),
                1,
                cache=self.cache,
                logits_rows=torch.zeros(0, dtype=torch.long, device=dev),
            )
            if self.moe:  # the routing of the tokens fed again, under the new version
                chosen, all_rows = take_recorded(self.moe).to(torch.int16), torch.arange(R, device=dev)
                kept = self.completion_experts[all_rows, position]
                self.completion_experts[all_rows, position] = torch.where(live[:, None, None], chosen, kept)

    def _admit(self, slot: int, group_index: int) -> None:
        group = self.groups[group_index]
        self.slot_group[slot] = group_index
        self.slot_unfinished[slot] = self.G
        self.samples[group_index] = [None] * self.G
        if self.sample_noise:  # each sample's noise from its own generator, seeded by the group's
            seeds = torch.randint(2**62, (self.G,), generator=group.generator, device=self.device).tolist()
            for place, seed in enumerate(seeds):
                self.sample_generators[group_index, place] = torch.Generator(device=self.device).manual_seed(seed)

    def _idle_forward(self) -> None:
        """A one-token forward that keeps this rank's collectives in step with busier ranks (on a
        multi-task model, with the first task's adapter: its forward needs each token's task)."""
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        self._forward(one if self.multi_task else None, one, one, torch.tensor([0, 1], device=self.device), 1)
        if self.moe:
            take_recorded(self.moe)

    def _start(self, starts: list[tuple[int, int, int]]) -> None:
        """Rows start samples: each (row, slot, place) samples its first token from the slot's
        prompt logits and points at the slot's prefix (a recurrent layer's row takes the slot's state)."""
        dev = self.device
        rows, slots, places = (list(x) for x in zip(*starts))
        self.cache.start_rows(rows, slots, places)
        rows_t = torch.tensor(rows, device=dev)
        if self.moe:
            self.completion_experts[rows_t] = -1
        groups = [self.groups[self.slot_group[slot]] for slot in slots]
        if self.multi_task:
            self.row_adapter[rows_t] = torch.tensor([g.adapter for g in groups], device=dev)
        logits = self.slot_logits[torch.tensor(slots, device=dev)]
        uniforms = None
        if self.sample_noise:
            uniforms = torch.stack(
                [
                    torch.empty(2, dtype=torch.float64, device=dev).uniform_(
                        generator=self.sample_generators[self.slot_group[slot], place]
                    )
                    for slot, place in zip(slots, places)
                ]
            )
        first, first_lp = sample_next_tokens(logits, self.sampling, self.generator, uniforms)
        if self.drafter is not None:
            self.drafter.start_rows(rows, slots, places, first)
        self.tokens[rows_t, 0], self.logprobs[rows_t, 0] = first, first_lp
        self.token_versions[rows_t, 0] = torch.tensor([self.slot_version[slot] for slot in slots], device=dev)
        self.ngen[rows_t] = 1
        self.done[rows_t] = torch.isin(first, self.stop_ids) | (self.max_new <= 1)
        self.prompt_lens[rows_t] = torch.tensor([len(g.prompt) for g in groups], device=dev)

    def _forward(self, task_of_token: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
        """The model's forward; on a multi-task model each token with its task's adapter."""
        if task_of_token is None:
            return self.model(*args, **kwargs)
        with adapter_routing(self.model, task_of_token):
            return self.model(*args, **kwargs)

    def _collect_finished(self) -> None:
        """Turn the rows whose samples ended into samples and free them (one host read); a slot is
        freed with its group's last sample."""
        busy = [r for r, sample in enumerate(self.row_sample) if sample is not None]
        if not busy:
            return
        if self.sampling.stop_token_ids or self.drafter is not None:
            done = self.done.cpu().tolist()
            finished = [r for r in busy if done[r] or self.row_steps[r] >= self.max_new]
        else:
            finished = [r for r in busy if self.row_steps[r] >= self.max_new]
        if not finished:
            return
        rows = torch.tensor(finished, device=self.device)
        tokens, logprobs, ngen = self.tokens[rows].cpu(), self.logprobs[rows].cpu(), self.ngen[rows].cpu()
        token_versions = self.token_versions[rows].cpu()
        stop_ids = set(self.sampling.stop_token_ids)
        released = [self.row_sample[row] for row in finished]
        if self.moe:
            completion_experts = self.completion_experts[rows].cpu()
            prompt_experts = self.prompt_experts[[slot for slot, _ in released]].cpu()
        for i, row in enumerate(finished):
            slot, place = released[i]
            group_index = self.slot_group[slot]
            group = self.groups[group_index]
            n = int(ngen[i])
            completion = tokens[i, :n].tolist()
            self.engine.stats.decode_tokens += n - 1
            if group.session_keys is not None:  # the last token has not been through the model
                kept = KeptState(
                    group.prompt + completion[:-1], self.cache.row_state(row, slot, len(group.prompt), n - 1)
                )
                self.engine.kept_sessions.keep(
                    group.session_keys[place], KeptSession(kept, self.version, group.adapter)
                )
            sample = Sample(
                prompt_index=group.prompt_index,
                prompt_ids=group.prompt,
                completion_ids=completion,
                logprobs=logprobs[i, :n].tolist(),
                finish_reason="stop" if completion[-1] in stop_ids else "length",
                version=int(token_versions[i, 0]),
                token_versions=token_versions[i, :n].tolist(),
            )
            if self.moe:
                sample.extra[ROUTED_EXPERTS] = torch.cat(
                    [prompt_experts[i, : len(group.prompt)], completion_experts[i, :n]]
                )
            self.samples[group_index][place] = sample
            self.sample_generators.pop((group_index, place), None)
            self.row_sample[row] = None
            self.row_steps[row] = 0
            self.slot_unfinished[slot] -= 1
            if self.slot_unfinished[slot] == 0:
                self.slot_group[slot] = None
        self.cache.release_rows(finished, [slot for slot, _ in released], [place for _, place in released])
        if self.drafter is not None:
            self.drafter.release_rows(finished, [slot for slot, _ in released], [place for _, place in released])
