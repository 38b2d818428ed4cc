"""The embedded rollout engine: generation with a KV cache on the archon model itself.

The engine shares the trainer's model, so an adapter update is in-process: the weight sync only
publishes the new version (archon.sync.weight_sync.InProcessSync), the next `generate` samples from
the weights as they are, and every sample is tagged with the version published when it started.

Updates during a generation (the update policy 'continue', partial rollouts): `update_adapter(version,
factors)` from another thread while `generate` runs is applied by the generation loop at its next
step boundary (before a prefill forward or a decode step): the LoRA factors are copied into the
model in place, and every token sampled after that carries the new version in its sample's
`token_versions`, with the log-prob of the distribution it was drawn from. The cached context is
then computed again under the new adapter (archon/rollout/generation.py): every prompt in a slot is
prefilled again, and every started sample's tokens so far are fed again, so that each token after
the update is drawn from the new version's full forward over its whole context, as the trainer
scores it. A sample that starts from a prompt prefilled before the update draws its first token
from the prompt's logits as prefilled again, under the new version. With a sync group (FSDP/TP
ranks in lockstep), or under the update policy 'finish', the update waits for the end of the
generation.

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
- Prefill (archon/rollout/prefill.py): the admitted prompts are packed into one forward, or
  with `prefill_chunk_tokens` into successive forwards of at most that many tokens, each continuing
  its prompts from the cache. The head runs on the last position of each sequence only.
- Decode (archon/rollout/decode.py): tokens, log-probs and each row's done flag stay on the device;
  the host reads the done flags once every `stop_check_interval` decode steps (only when there are
  stop tokens; every step on the CPU, where reading them costs next to nothing) and the finished
  rows' tokens once. On CUDA (one process, one task), the decode step
  is captured once per `generate` in a CUDA graph and replayed (`cuda_graphs`).

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
behaviour policy (archon/rollout/sampling.py): temperature-scaled logits, truncated by top-k then
top-p, renormalised; greedy decoding reports log_softmax(logits).

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

Layout: this module holds the engine (its settings, adapter updates and kept sessions, `generate`);
archon/rollout/generation.py one `generate` call (its cache, per-row state and round loop), whose
prefill and decode steps are in archon/rollout/prefill.py and archon/rollout/decode.py;
archon/rollout/sampling.py draws the tokens, archon/rollout/sessions.py keeps sessions.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from archon.lora import cached_task_factors, lora_parameters, task_names
from archon.packed_linear import PackedWeights, packing_supported
from archon.parallel.tensor_parallel import local_tensor
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.generation import ROUTED_EXPERTS  # noqa: F401 - at its old path for one release
from archon.rollout.generation import Generation as _Generation
from archon.rollout.generation import PromptGroup as _Group
from archon.rollout.policy import ServedPolicy
from archon.rollout.sampling import sample_next_tokens, truncated_logprobs  # noqa: F401 - at their old path
from archon.rollout.sessions import SessionStore
from archon.rollout.speculative import DraftModelDrafter, MTPDrafter, check_speculative_engine
from archon.routing_replay import moe_routers, recorded_routing


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


ADAPTER_SEED_STRIDE = 1_000_033
"""Seed offset between the tasks of a multi-task generation (see the module docstring)."""


class NativeRolloutEngine:
    """max_batch_sequences: rows of the cache (sequences decoded together); with
    share_prompt_prefix, at least `sampling.n` (a prompt's samples can all decode at once).
    sync_group: the ranks that run the model's forwards together (FSDP/TP); every rank of it runs
    the same number of forwards. Default: the whole default process group when one is running.
    share_prompt_prefix: prefill each prompt once for its `n` samples (False: once per sample).
    stop_check_interval: decode steps between two reads of the done flags (with stop tokens).
    Default: 1 on the CPU, where the flags lie in host memory and a read costs microseconds against
    milliseconds for a step (a row that ended frees its place at once, and a call whose samples all
    ended stops); 8 on an accelerator, where each read synchronises the host with the device.
    cuda_graphs: on a CUDA device, replay the decode step from a CUDA graph (captured once per
    `generate`, over the whole table and the longest spans, so that every step has one shape); a
    model whose step cannot be captured (host syncs in MoE routing or in recurrent layers) decodes
    eagerly instead. Ignored off CUDA.
    max_session_tokens: the most tokens of kept session state (`generate(..., sessions=)`) held at
    once, the least recently used sessions evicted beyond it; None: no bound (`end_sessions` frees).
    prefill_chunk_tokens: the most prompt tokens one prefill forward takes; a prefill of more runs as
    several forwards, each continuing its prompts from the cache (archon/rollout/prefill.py). None:
    every prefill in one forward.
    record_routing: on an MoE model, give every sample the expert ids its tokens were routed to,
    `Sample.extra["routed_experts"]` (see ROUTED_EXPERTS).
    drafter: speculative decoding (archon/rollout/speculative.py): each decode round the drafter
    proposes `drafter.num_tokens` tokens per row and one forward of the model verifies them. One
    process only, no routing record, no recurrent (linear-attention) layers; decodes eagerly (no
    CUDA graph). None: one token per decode step.
    speculative_max_rows: with a drafter, speculate only in generations of at most this many rows
    (prompts times samples, capped by max_batch_sequences); larger ones decode one token per step.
    update_policy: what an `update_adapter` during a generation does (rollout.update_policy):
    'continue' applies it at the generation's next step boundary (partial rollouts, see the module
    docstring); 'finish' keeps it until the generation ends, so that every token of a generation
    comes from the version it started with.
    prepack_linears: on the CPU, compute the linears of frozen fp32 weights (a LoRA run's base, an
    inference model) of at least packed_linear.MIN_PACKED_ELEMENTS elements with oneDNN on copies
    of the weights packed once (archon/packed_linear.py): faster at a decode step's few rows, for a
    second copy of those weights. Ignored off the CPU."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str = "cpu",
        max_batch_sequences: int = 256,
        sync_group=None,
        share_prompt_prefix: bool = True,
        stop_check_interval: int | None = None,
        cuda_graphs: bool = True,
        max_session_tokens: int | None = None,
        prefill_chunk_tokens: int | None = None,
        record_routing: bool = False,
        drafter: DraftModelDrafter | MTPDrafter | None = None,
        update_policy: str = "continue",
        speculative_max_rows: int | None = None,
        prepack_linears: bool = True,
    ) -> None:
        self.device = torch.device(device)
        if stop_check_interval is None:
            stop_check_interval = 1 if self.device.type == "cpu" else 8
        if max_batch_sequences < 1 or stop_check_interval < 1:
            raise ValueError(
                f"max_batch_sequences ({max_batch_sequences}) and "
                f"stop_check_interval ({stop_check_interval}) must be >= 1"
            )
        if update_policy not in ("finish", "continue"):
            raise ValueError(f"update_policy must be 'finish' or 'continue', got {update_policy!r}")
        self.update_policy = update_policy
        if max_session_tokens is not None and max_session_tokens < 0:
            raise ValueError(f"max_session_tokens must be >= 0 or None, got {max_session_tokens}")
        if prefill_chunk_tokens is not None and prefill_chunk_tokens < 1:
            raise ValueError(
                f"prefill_chunk_tokens must be >= 1 or None (one forward per prefill), got {prefill_chunk_tokens}"
            )
        self.model = model
        self.max_batch_sequences = max_batch_sequences
        self.share_prompt_prefix = share_prompt_prefix
        self.stop_check_interval = stop_check_interval
        self.cuda_graphs = cuda_graphs
        self.policy = ServedPolicy()
        """The adapter version samples are tagged with; written by the weight sync."""
        self.sync_group = sync_group
        if sync_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.sync_group = dist.group.WORLD
        self.prefill_chunk_tokens = prefill_chunk_tokens
        if record_routing and not moe_routers(model):
            raise ValueError("record_routing needs an MoE model; this model has no MoE router")
        self.record_routing = record_routing
        if drafter is not None:
            check_speculative_engine(model, self.sync_group, record_routing)
        self.drafter = drafter
        if speculative_max_rows is not None and speculative_max_rows < 1:
            raise ValueError(f"speculative_max_rows must be >= 1 or None, got {speculative_max_rows}")
        self.speculative_max_rows = speculative_max_rows
        self.kept_sessions = SessionStore(max_session_tokens)
        """Kept sessions by key (`generate(..., sessions=)`)."""
        self.packed_weights = PackedWeights() if prepack_linears and packing_supported(self.device) else None
        """On the CPU: oneDNN-prepacked copies of the frozen fp32 weights, which the generation's
        linears compute with (archon.packed_linear); None where they compute with F.linear."""
        self.stats = RolloutStats()
        self._update_lock = threading.Lock()
        self._pending_update: tuple[int, dict[str, torch.Tensor]] | None = None
        self._generating = False

    def reset_stats(self) -> None:
        self.stats = RolloutStats()

    @property
    def max_session_tokens(self) -> int | None:
        """The bound of kept session state, in tokens (None: none)."""
        return self.kept_sessions.max_tokens

    @max_session_tokens.setter
    def max_session_tokens(self, value: int | None) -> None:
        self.kept_sessions.max_tokens = value

    @property
    def session_tokens(self) -> int:
        """Tokens of kept session state held now."""
        return self.kept_sessions.tokens

    def end_sessions(self, keys) -> None:
        """Free the state kept under `keys` (unknown keys are ignored)."""
        for key in keys:
            self.kept_sessions.drop(key)

    def clear_sessions(self) -> None:
        self.kept_sessions.clear()

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
            self._apply_update_now()

    def _apply_pending_update(self) -> int | None:
        """At a step boundary of a generation (archon/rollout/generation.py): under the update
        policy 'continue', apply the update waiting (if any) and return its version; else None."""
        if self.update_policy != "continue":
            return None
        return self._apply_update_now()

    def _apply_update_now(self) -> int | None:
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
        self._check_request(prompts, sampling, adapters, sessions)
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
        groups = self._groups(prompts, sampling, adapters, adapter_seeds, sessions)
        was_training = self.model.training
        # eval() sets every module's flag (a millisecond on a small model, per call): only when one is set
        switched = any(m.training for m in self.model.modules())
        if switched:
            self.model.eval()
        # the adapters do not change during a generation: every layer stacks its tasks' factors once
        factors = cached_task_factors(self.model) if multi_task_model else contextlib.nullcontext()
        recording = recorded_routing(self.model) if self.record_routing else contextlib.nullcontext()
        packed = self.packed_weights.active() if self.packed_weights is not None else contextlib.nullcontext()
        with self._update_lock:
            self._generating = True
        try:
            self._apply_update_now()
            with self.policy.lease() as (_, version), factors, recording, packed:
                try:
                    generation = _Generation(
                        self, groups, sampling, generator, multi_task=adapters is not None, version=version
                    )
                    if sessions is not None:
                        # a drafter on the target's hidden states (MTP, draft head) takes its entries from
                        # the prefill of the whole prompt: with one drafting (not past speculative_max_rows),
                        # no state is continued
                        drafter = generation.drafter
                        continues = not (drafter is not None and drafter.needs_target_hidden)
                        self.kept_sessions.take_kept_states(groups, version, continues)
                    return generation.run()
                finally:
                    if switched:
                        self.model.train(was_training)
        finally:
            with self._update_lock:
                self._generating = False
            self._apply_update_now()

    def _check_request(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapters: list[int] | None,
        sessions: list[Hashable] | None,
    ) -> None:
        """Refuse a `generate` call the engine cannot serve as asked (see `generate`)."""
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

    def _groups(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams,
        adapters: list[int] | None,
        adapter_seeds: dict[int, int] | None,
        sessions: list[Hashable] | None,
    ) -> list[_Group]:
        """The prompts' groups of samples, in the output order, with their session keys and, for a
        multi-task generation with a seed, their own generators (see `generate`)."""
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
        return groups
