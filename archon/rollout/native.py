"""The embedded rollout engine: generation with a KV cache on the archon model itself.

The engine shares the trainer's model, so an adapter update is in-process: the weight sync only
publishes the new version (archon.sync.weight_sync.InProcessSync), the next `generate` samples from
the weights as they are, and every sample is tagged with the version published when it started.

Updates during a generation (the update policy 'continue', partial rollouts): `update_adapter(version,
factors)` from another thread while `generate` runs is applied by the generation loop at its next
step boundary (before a prefill forward or a decode step): the LoRA factors are copied into the
model in place, and every token sampled after that carries the new version in its sample's
`token_versions`, with the log-prob of the distribution it was drawn from. What is cached stays as
it was computed: prompt prefixes, keys/values and recurrent states of the tokens before the update
are not computed again under the new adapter, so a token after the update is drawn from the new
adapter on top of a context the old one encoded (the per-token versions and the decoupled loss
account for that). A sample that starts from a prompt prefilled before the update draws its first
token from the prompt's logits as prefilled, under the version of the prefill. With a sync group
(FSDP/TP ranks in lockstep) the update waits for the end of the generation.

How it generates (archon/rollout/kv_cache.py holds the cache):
- Group-shared prefixes. The prompt of a group of `n` samples is prefilled once into a prefix slot
  of the cache, its keys/values are stored once and every sample of the group attends to them in
  place (a recurrent layer's state at the end of the prompt is copied to each sample's row).
- Continuous batching, per sample. Each row of the cache holds one sample. When a sample stops or
  reaches max_new_tokens, its row starts another sample at once: one of a prompt already prefilled
  whose samples wait for a row, or else of the next waiting prompt, which is prefilled into a free
  slot, while the other rows keep decoding. A slot keeps its prompt until the group's last sample
  ends; there are twice as many slots as rows / n (bounded by the prompts), so that rows freed early
  start the next prompts' samples while a group's longest sample still runs. A sample that starts
  after its prompt's prefill samples its first token from the prompt's last logits, kept per slot.
  A decode step covers the rows up to the last busy one.
- Sampling on the device. Tokens, log-probs and each row's done flag stay on the device; the host
  reads the done flags once every `stop_check_interval` decode steps (only when there are stop
  tokens: without them, when a row ends is known in advance) and the finished rows' tokens once.
- The head runs on the last position of each sequence only.
- Chunked prefill. With `prefill_chunk_tokens`, a prefill of more prompt tokens than that runs as
  successive forwards of at most that many tokens: a long prompt is split across forwards, short
  ones share one, and each forward continues its prompts from what the cache holds after the
  previous one (as a kept session is continued, below). The activations of a prefill are then
  bounded by the budget rather than by the prompts' length; the results are the one-shot
  prefill's. Only the forward that ends a prompt computes its logits and samples its first token.
- On CUDA (one process, one task), the decode step is captured once per `generate` in a CUDA
  graph and replayed: one launch per step instead of one per op (`cuda_graphs`).

Speculative decoding (`drafter=`, archon/rollout/speculative.py): each decode round a drafter (a
draft model, or the model's MTP layer) proposes k tokens per row, and one forward verifies the
k + 1 positions of every row (`KVCache.begin_decode` with several tokens per row); each row emits
its accepted drafts and one token of the model's, 1 to k + 1 tokens, with the tokens of plain
greedy decoding, or under sampling the model's distribution. The done flags are read after every
round. One process only; no recurrent layers, no routing record, no CUDA graph.

Kept sessions (multi-turn generation): with `generate(..., sessions=)`, each sample's cached state
(every layer's keys/values; a recurrent layer's conv window and state) for its prompt and all but
its last completion token (that one has not been through the model yet) is kept under the sample's
key. When a later prompt under that key starts with those tokens, with the same adapter version and
task, its slot is loaded with the kept state and only the remaining tokens are prefilled, at
their positions after it (archon/rollout/kv_cache.py); otherwise the prompt is prefilled in full
and the kept state dropped. A group of `n` samples extends the longest kept state any of its keys
holds. Kept state is bounded by `max_session_tokens` (least recently used first out); an evicted
session is prefilled in full next time. `stats` counts the tokens prefilled, reused and decoded.

Log-probs: each token's log-prob is that of the distribution it was actually drawn from, the
behaviour policy: temperature-scaled logits, truncated by top-k then top-p, renormalised (the same
as vLLM's `processed_logprobs`, which the vLLM servers are launched with). Without truncation that
is log_softmax(logits / temperature), which the trainer recomputes (`Trainer.logprobs`); with
truncation the trainer's untruncated log-probs differ from it, by exactly what the importance
weight pi_old / mu of the loss corrects for when importance sampling is on
(archon/rl/algorithms.py; on by default only for asynchronous rollouts). Greedy decoding reports
log_softmax(logits).

Lockstep: under FSDP/TP every rank of the sync group runs the same number of forwards. The engine
works in rounds (admit and prefill, then up to `stop_check_interval` decode steps); at the start
of each round the ranks agree, in one all-reduce, on how many prefill forwards and how many decode
steps the busiest rank needs, and a rank with less to do runs one-token forwards instead.
Data-parallel ranks generate their own share of the prompts.

Several tasks (a multi-task model, archon.lora.MultiLoRALinear): `generate(..., adapters=)` gives
each prompt its task; every forward routes each token to its task's adapter, so the tasks' prompts
decode in the same batches. With a seed, every group draws its sampling noise from its own
generator, seeded from its task's generator (seed + ADAPTER_SEED_STRIDE * task) in the order of the
task's prompts, and each of its samples from its own generator seeded from the group's: a sample
draws one noise vector per token, whichever row and step it runs in, so a task's samples depend on
its own prompts, not on the other tasks' nor on when rows free up. With one task and a seed, one
generator draws the noise of every step's rows: the samples are reproducible (the same call gives
the same samples) but depend on the schedule (which rows start which samples when).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from archon.head import full_vocab_logits
from archon.lora import adapter_routing, cached_task_factors, lora_parameters, task_names
from archon.parallel.tensor_parallel import local_tensor
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.kv_cache import KeptState, KVCache
from archon.rollout.policy import ServedPolicy
from archon.rollout.speculative import (
    DraftModelDrafter,
    MTPDrafter,
    accept_greedy,
    accept_sampled,
    processed_logprobs,
    prompt_chunks,
)
from archon.routing_replay import moe_routers, recorded_routing, take_recorded

logger = logging.getLogger(__name__)


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


@dataclass
class _Group:
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


@dataclass
class RolloutStats:
    """Token counts of the engine's generations (since it was built or `reset_stats`)."""

    prefill_tokens: int = 0
    """Prompt tokens that went through prefills (once per group of samples sharing a prompt)."""
    reused_tokens: int = 0
    """Prompt tokens read from kept sessions instead of being prefilled."""
    decode_tokens: int = 0
    """Tokens sampled by decode steps (each sample's tokens after the first, which its prefill samples)."""
    prefill_forwards: int = 0
    """Forwards that prefilled prompts (a prefill over `prefill_chunk_tokens` takes several)."""
    max_prefill_forward_tokens: int = 0
    """The most prompt tokens packed in one prefill forward."""
    decode_steps: int = 0
    """Decode steps run (each feeds one token to every row of the step; with speculative decoding,
    each verifies a draft of every row)."""
    speculative_proposed: int = 0
    """Draft tokens proposed to the target (speculative decoding)."""
    speculative_accepted: int = 0
    """Draft tokens the target accepted (speculative decoding); over speculative_proposed, the
    acceptance rate."""


@dataclass
class _Session:
    kept: KeptState
    version: int
    """The adapter version the state was computed with."""
    adapter: int


ROUTED_EXPERTS = "routed_experts"
"""Sample.extra key of the recorded routing (NativeRolloutEngine(record_routing=True)): int16
[len(prompt_ids) + len(completion_ids), L_moe, k], the expert ids MoE layer l routed each token to
(prompt tokens: in the prefill; completion tokens: in the decode step that fed them). Rows of -1:
tokens the engine did not run (a prompt prefix read from a kept session, the last completion token)."""

ADAPTER_SEED_STRIDE = 1_000_033
"""Seed offset between the tasks of a multi-task generation (see the module docstring)."""


class NativeRolloutEngine:
    """max_batch_sequences: rows of the cache (sequences decoded together); with
    share_prompt_prefix, at least `sampling.n` (a prompt's samples can all decode at once).
    sync_group: the ranks that run the model's forwards together (FSDP/TP); every rank of it runs
    the same number of forwards. Default: the whole default process group when one is running.
    share_prompt_prefix: prefill each prompt once for its `n` samples (False: once per sample).
    stop_check_interval: decode steps between two reads of the done flags (with stop tokens).
    cuda_graphs: on a CUDA device, replay the decode step from a CUDA graph (captured once per
    `generate`, over the whole table and the longest spans, so that every step has one shape); a
    model whose step cannot be captured (host syncs in MoE routing or in recurrent layers) decodes
    eagerly instead. Ignored off CUDA.
    max_session_tokens: the most tokens of kept session state (`generate(..., sessions=)`) held at
    once, the least recently used sessions evicted beyond it; None: no bound (`end_sessions` frees).
    prefill_chunk_tokens: the most prompt tokens one prefill forward takes; a prefill of more runs as
    several forwards, each continuing its prompts from the cache (see the module docstring). None:
    every prefill in one forward.
    record_routing: on an MoE model, give every sample the expert ids its tokens were routed to,
    `Sample.extra["routed_experts"]` (see ROUTED_EXPERTS).
    drafter: speculative decoding (archon/rollout/speculative.py): each decode round the drafter
    proposes `drafter.num_tokens` tokens per row and one forward of the model verifies them. One
    process only, no routing record, no recurrent (linear-attention) layers; decodes eagerly (no
    CUDA graph). None: one token per decode step."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str = "cpu",
        max_batch_sequences: int = 256,
        sync_group=None,
        share_prompt_prefix: bool = True,
        stop_check_interval: int = 8,
        cuda_graphs: bool = True,
        max_session_tokens: int | None = None,
        prefill_chunk_tokens: int | None = None,
        record_routing: bool = False,
        drafter: DraftModelDrafter | MTPDrafter | None = None,
    ) -> None:
        if max_batch_sequences < 1 or stop_check_interval < 1:
            raise ValueError(
                f"max_batch_sequences ({max_batch_sequences}) and "
                f"stop_check_interval ({stop_check_interval}) must be >= 1"
            )
        if max_session_tokens is not None and max_session_tokens < 0:
            raise ValueError(f"max_session_tokens must be >= 0 or None, got {max_session_tokens}")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 1 or None (one forward per prefill), got {prefill_chunk_tokens}"
            )
        self.model = model
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        self.share_prompt_prefix = share_prompt_prefix
        self.stop_check_interval = stop_check_interval
        self.cuda_graphs = cuda_graphs
        self.policy = ServedPolicy()
        """The adapter version samples are tagged with; written by the weight sync."""
        self.sync_group = sync_group
        if sync_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.sync_group = dist.group.WORLD
        self.max_session_tokens = max_session_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if record_routing and not moe_routers(model):
            raise ValueError("record_routing needs an MoE model; this model has no MoE router")
        self.record_routing = record_routing
        if drafter is not None:
            _check_speculative(model, self.sync_group, record_routing)
        self.drafter = drafter
        self._sessions: OrderedDict[Hashable, _Session] = OrderedDict()
        """Kept sessions by key, least recently used first."""
        self._session_tokens = 0
        self.stats = RolloutStats()
        self._update_lock = threading.Lock()
        self._pending_update: tuple[int, dict[str, torch.Tensor]] | None = None
        self._generating = False

    def reset_stats(self) -> None:
        self.stats = RolloutStats()

    @property
    def session_tokens(self) -> int:
        """Tokens of kept session state held now."""
        return self._session_tokens

    def end_sessions(self, keys) -> None:
        """Free the state kept under `keys` (unknown keys are ignored)."""
        for key in keys:
            self._drop_session(key)

    def clear_sessions(self) -> None:
        self._sessions.clear()
        self._session_tokens = 0

    def _drop_session(self, key) -> _Session | None:
        session = self._sessions.pop(key, None)
        if session is not None:
            self._session_tokens -= len(session.kept.tokens)
        return session

    def _keep_session(self, key, session: _Session) -> None:
        self._drop_session(key)
        self._sessions[key] = session
        self._session_tokens += len(session.kept.tokens)
        while self.max_session_tokens is not None and self._session_tokens > self.max_session_tokens:
            self._drop_session(next(iter(self._sessions)))

    def _take_kept_states(self, groups: list[_Group], version: int) -> None:
        """Give each group the longest state its keys keep for a prefix of its prompt (same adapter
        version and task, at least one prompt token left to prefill); the call's keys are taken out
        of the store, to be replaced by its samples' states. With an MTP drafter, whose entries come
        from the target's prefill of the whole prompt, no state is continued."""
        continues = not (self.drafter is not None and self.drafter.needs_target_hidden)
        for group in groups:
            for key in group.session_keys:
                session = self._drop_session(key)
                if not continues or session is None or session.version != version or session.adapter != group.adapter:
                    continue
                tokens = session.kept.tokens
                if len(tokens) < len(group.prompt) and group.prompt[: len(tokens)] == tokens:
                    if group.kept is None or len(tokens) > len(group.kept.tokens):
                        group.kept = session.kept

    def _agree(self, prefill_forwards: int, decode_steps: int, unfinished: int) -> tuple[int, int, int]:
        """(the most prefill forwards, the most decode steps any rank needs, whether any rank has
        samples left (0/1)) over the sync group."""
        if self.sync_group is None:
            return prefill_forwards, decode_steps, unfinished
        t = torch.tensor([prefill_forwards, decode_steps, unfinished], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync_group)
        return int(t[0]), int(t[1]), int(t[2])

    def update_adapter(self, version: int, factors: dict[str, torch.Tensor]) -> None:
        """Make `factors` (LoRA parameters by name, as archon.lora.lora_parameters names them, in the
        shapes this rank holds: its local shards under FSDP/TP) the model's adapter, published as
        `version`. While a `generate` runs in
        another thread, the generation applies it at its next step boundary and tags the tokens
        sampled after it with `version` (see the module docstring); otherwise it applies now."""
        if task_names(self.model):
            raise ValueError("update_adapter swaps a single adapter; this model has several task adapters")
        params = lora_parameters(self.model)
        unknown = sorted(set(factors) - set(params))
        if unknown:
            raise ValueError(
                f"update_adapter: {unknown[0]!r} (and {len(unknown) - 1} more) is no LoRA parameter of the model"
            )
        with self._update_lock:
            self._pending_update = (version, factors)
            generating = self._generating
        if not generating:
            self._apply_pending_update()

    def _apply_pending_update(self) -> int | None:
        """Apply the update waiting (if any) and publish its version; returns that version or None.
        The copy runs under the lock, so a generation starting meanwhile waits for it to end."""
        with self._update_lock:
            if self._pending_update is None:
                return None
            (version, factors), self._pending_update = self._pending_update, None
            params = lora_parameters(self.model)
            with torch.no_grad():
                for name, tensor in factors.items():
                    local_tensor(params[name]).copy_(tensor)
            self.policy.publish(None, version)
            return version

    def health(self) -> dict:
        return {"engine": "native", "alive": True, "adapter_version": self.policy.version}

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapters: list[int] | None = None,
        adapter_seeds: dict[int, int] | None = None,
        sessions: list[Hashable] | None = None,
    ) -> list[Sample]:
        """adapters: on a multi-task model, the task index whose adapter each prompt samples with.
        adapter_seeds: each task's sampling seed (by task index), when a task's samples must not
        depend on its index (default: sampling.seed + ADAPTER_SEED_STRIDE * task).
        sessions: a key per returned sample (len(prompts) * sampling.n, in the output order): the
        sample's cached state is kept under it, and a prompt whose key keeps the state of a prefix
        of it prefills only the rest (see the module docstring)."""
        if self.share_prompt_prefix and sampling.n > self.max_batch_sequences:
            raise ValueError(
                f"sampling.n={sampling.n} exceeds max_batch_sequences={self.max_batch_sequences}: the n samples "
                "of a prompt share one prefix slot of the cache, which needs at least n rows"
            )
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; generation needs at least one prompt token")
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"adapters has {len(adapters)} entries for {len(prompts)} prompts")
        if sessions is not None:
            if len(sessions) != len(prompts) * sampling.n:
                raise ValueError(
                    f"sessions has {len(sessions)} keys for {len(prompts)} prompts x sampling.n={sampling.n} "
                    "samples: it needs one key per returned sample"
                )
            if len(set(sessions)) != len(sessions):
                raise ValueError("sessions repeats a key: each sample's state needs a key of its own")
        multi_task_model = bool(task_names(self.model))
        if multi_task_model and adapters is None:
            if prompts:
                raise ValueError(
                    f"the model has several task adapters {list(task_names(self.model))}: pass adapters= (each "
                    "prompt's task index), or generate inside archon.lora.task_view(model, task)"
                )
            adapters = []  # nothing to generate here; the one-token forwards that keep in step still need tasks
        generator = None
        if sampling.seed is not None and adapters is None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        task_of_prompt = adapters if adapters is not None else [0] * len(prompts)
        if self.share_prompt_prefix:
            groups = [_Group(i, list(p), sampling.n, task_of_prompt[i]) for i, p in enumerate(prompts)]
        else:
            groups = [
                _Group(i, list(p), 1, task_of_prompt[i]) for i, p in enumerate(prompts) for _ in range(sampling.n)
            ]
        if sessions is not None:  # groups are in the output order
            for j, group in enumerate(groups):
                group.session_keys = list(sessions[j * group.samples : (j + 1) * group.samples])
        if adapters is not None and sampling.seed is not None:
            if adapter_seeds is None:
                adapter_seeds = {task: sampling.seed + ADAPTER_SEED_STRIDE * task for task in set(adapters)}
            missing = sorted(set(adapters) - set(adapter_seeds))
            if missing:
                raise ValueError(f"adapter_seeds has no seed for task index(es) {missing}")
            task_generators = {
                task: torch.Generator(device=self.device).manual_seed(adapter_seeds[task]) for task in set(adapters)
            }
            for group in groups:
                seed = int(torch.randint(2**62, (1,), generator=task_generators[group.adapter], device=self.device))
                group.generator = torch.Generator(device=self.device).manual_seed(seed)
        was_training = self.model.training
        self.model.eval()
        # the adapters do not change during a generation: every layer stacks its tasks' factors once
        factors = cached_task_factors(self.model) if multi_task_model else contextlib.nullcontext()
        recording = recorded_routing(self.model) if self.record_routing else contextlib.nullcontext()
        with self._update_lock:
            self._generating = True
        try:
            self._apply_pending_update()
            with self.policy.lease() as (_, version), factors, recording:
                if sessions is not None:
                    self._take_kept_states(groups, version)
                try:
                    return _Generation(
                        self, groups, sampling, generator, multi_task=adapters is not None, version=version
                    ).run()
                finally:
                    self.model.train(was_training)
        finally:
            with self._update_lock:
                self._generating = False
            self._apply_pending_update()


class _Generation:
    """One `generate` call: the cache, the per-row state on the device, the round loop."""

    def __init__(
        self,
        engine: NativeRolloutEngine,
        groups: list[_Group],
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
        self.drafter = engine.drafter
        # speculative decoding verifies up to k tokens past a row's last one: k more suffix places
        draft_tokens = 0 if self.drafter is None else self.drafter.num_tokens
        self.cache = KVCache(
            len(self.model.layers), num_slots, rows, G, max_prompt, sampling.max_new_tokens + draft_tokens, self.device
        )
        dev = self.device
        self.max_new = sampling.max_new_tokens
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
        self.multi_task = multi_task
        self.row_adapter = torch.zeros(rows, dtype=torch.long, device=dev)
        """Each row's task (multi-task models); free rows keep their last one."""
        self.sample_noise = multi_task and sampling.seed is not None and sampling.temperature > 0
        """Whether each sample draws its sampling noise from its own generator."""
        self.sample_generators: dict[tuple[int, int], torch.Generator] = {}
        """(group, sample) -> the sample's generator, while the sample's group is in a slot."""
        self.stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=dev)
        self.slot_logits: torch.Tensor | None = None
        """[num_slots, V]: the logits at each slot's last prompt token, which its samples start from."""
        self.slot_version = [version] * num_slots
        """The adapter version of each slot's prefill (of its samples' first tokens)."""
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
        self.speculative_counts = torch.zeros(2, dtype=torch.long, device=dev)
        """Speculative decoding: draft tokens proposed and accepted in this generation."""
        self.waiting_samples: deque[tuple[int, int]] = deque()
        """(slot, place) of the samples of prefilled prompts that wait for a free row."""
        # not under a sync group: the step's collectives (FSDP gathers, TP reductions) stay eager
        # nor with several tasks: the routing of tokens to adapters changes as rows start samples
        self.static_decode = (
            engine.cuda_graphs
            and self.drafter is None
            and not multi_task
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
        self.samples: dict[int, list[Sample | None]] = {}
        """Each group's samples, by group index."""

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
                self._take_update()
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

    def _take_update(self) -> None:
        """At a step boundary: apply an adapter update published meanwhile (update_adapter)."""
        if not self.updates_in_flight:
            return
        version = self.engine._apply_pending_update()
        if version is not None:
            self.version = version
            self.version_now.fill_(version)

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
        stats = self.engine.stats
        stats.reused_tokens += sum(kept_lens)
        if self.moe:
            self.prompt_experts[slots] = -1
        adapter_of = {slot: self.groups[self.slot_group[slot]].adapter for slot in slots}
        last_logits = []  # [prompts ending in the forward, V] per forward, in slot order
        for pieces in chunks:
            lens = torch.tensor([end - start for _, start, end in pieces])
            cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
            tokens = torch.tensor([t for slot, start, end in pieces for t in prompt_of[slot][start:end]], device=dev)
            positions = torch.cat([torch.arange(start, end) for _, start, end in pieces]).to(dev)
            starts = torch.tensor([start for _, start, _ in pieces])
            self.cache.begin_prefill(torch.tensor([slot for slot, _, _ in pieces]), lens, starts)
            ends_prompt = torch.tensor([end == len(prompt_of[slot]) for slot, _, end in pieces])
            token_adapters = None
            if self.multi_task:
                token_adapters = torch.tensor(
                    [adapter_of[slot] for slot, _, _ in pieces], device=dev
                ).repeat_interleave(lens.to(dev))
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
                last_logits.append(full_vocab_logits(hidden[logits_rows], self.model.output_weight))
                self.drafter.prefill_hidden(pieces, prompt_of, hidden)
            else:
                last_logits.append(
                    self._forward(
                        token_adapters,
                        tokens,
                        positions,
                        cu_seqlens.to(dev),
                        int(lens.max()),
                        cache=self.cache,
                        logits_rows=logits_rows,
                    )
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
        for slot in slots:
            self.slot_version[slot] = self.version
        logits = torch.cat(last_logits)  # [len(slots), V]
        if self.slot_logits is None:
            self.slot_logits = logits.new_zeros(len(self.slot_group), logits.shape[-1])
        self.slot_logits[torch.tensor(slots, device=dev)] = logits
        if self.drafter is not None:  # the drafter prefills the whole prompt (a kept state is the target's)
            self.drafter.prefill(prompt_of, adapter_of, self.engine.prefill_chunk_tokens)

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
        race = None
        if self.sample_noise:
            race = torch.cat(
                [
                    torch.empty(1, logits.shape[-1], device=dev).exponential_(
                        generator=self.sample_generators[self.slot_group[slot], place]
                    )
                    for slot, place in zip(slots, places)
                ]
            )
        first, first_lp = sample_next_tokens(logits, self.sampling, self.generator, race)
        if self.drafter is not None:
            self.drafter.start_rows(rows, slots, places, first)
        self.tokens[rows_t, 0], self.logprobs[rows_t, 0] = first, first_lp
        self.token_versions[rows_t, 0] = torch.tensor([self.slot_version[slot] for slot in slots], device=dev)
        self.ngen[rows_t] = 1
        self.done[rows_t] = torch.isin(first, self.stop_ids) | (self.max_new <= 1)
        self.prompt_lens[rows_t] = torch.tensor([len(g.prompt) for g in groups], device=dev)

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
        token, logprob = sample_next_tokens(logits, self.sampling, self.generator, self._sample_race(logits))
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

    def _forward(self, task_of_token: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
        """The model's forward; on a multi-task model each token with its task's adapter."""
        if task_of_token is None:
            return self.model(*args, **kwargs)
        with adapter_routing(self.model, task_of_token):
            return self.model(*args, **kwargs)

    def _sample_race(self, logits: torch.Tensor) -> torch.Tensor | None:
        """The Exp(1) sampling draws [R, V] of a decode step, each busy row's drawn from its sample's
        own generator (free rows: ones), or None when samples do not draw on their own."""
        if not self.sample_noise:
            return None
        race = torch.ones_like(logits, dtype=torch.float32)
        for row, sample in enumerate(self.row_sample[: logits.shape[0]]):
            if sample is not None:
                slot, place = sample
                race[row].exponential_(generator=self.sample_generators[self.slot_group[slot], place])
        return race

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
                self.engine._keep_session(group.session_keys[place], _Session(kept, self.version, group.adapter))
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


def _check_speculative(model: nn.Module, sync_group, record_routing: bool) -> None:
    """Refuse speculative decoding where the engine cannot do it (a clear error at construction)."""
    if sync_group is not None:
        raise ValueError(
            "speculative decoding runs in one process: under FSDP/TP the ranks would run different numbers "
            "of forwards (a round's draft and verify forwards); turn rollout.speculative off or train on one process"
        )
    if record_routing:
        raise ValueError("speculative decoding does not record MoE routing (routing replay): turn one of them off")
    from archon.models.common.linear_attention import GatedDeltaNet
    from archon.models.kimi_linear.model import KimiDeltaAttention

    recurrent = [name for name, m in model.named_modules() if isinstance(m, (GatedDeltaNet, KimiDeltaAttention))]
    if recurrent:
        raise ValueError(
            f"speculative decoding does not support models with recurrent (linear-attention) layers ({recurrent[0]}, "
            "...): their state cannot be rolled back to the accepted tokens"
        )
