"""The embedded rollout engine: batched generation with a KV cache on the archon model itself.

The engine shares the trainer's model, so an adapter update is in-process: the weight sync only
publishes the new version (archon.sync.weight_sync.InProcessSync), the next `generate` samples from
the weights as they are, and every sample is tagged with the version published when it started.
Under FSDP/TP every rank of a model-parallel group must call `generate` with the same number of
decode steps; data-parallel ranks generate their own share of the prompts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from archon.lora import adapter_routing
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.kv_cache import KVCache
from archon.rollout.policy import ServedPolicy


def sample_next_tokens(
    logits: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], logprobs [B]).

    The log-prob is that of the temperature-scaled distribution before top-k/top-p truncation
    (temperature 1 for greedy), which is what the trainer recomputes.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        tokens = logits.argmax(dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1)
    else:
        scaled = logits / sampling.temperature
        logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = scaled
        if sampling.top_k:
            kth = torch.topk(filtered, min(sampling.top_k, filtered.shape[-1]), dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if sampling.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered, dim=-1, descending=True)
            cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
            # drop a token once the mass before it already reaches top_p (the first token always stays)
            drop_sorted = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= sampling.top_p
            drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
            filtered = filtered.masked_fill(drop, float("-inf"))
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]


ADAPTER_SEED_STRIDE = 1_000_033
"""Seed offset between the tasks of a mixed multi-task generation (see NativeRolloutEngine.generate)."""


class NativeRolloutEngine:
    """sync_group: the ranks that run the model's forwards together (FSDP/TP); every rank of it
    runs the same number of forwards, padding with a one-token forward once its own sequences are
    done. Default: the whole default process group when one is running."""

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str = "cpu",
        max_batch_sequences: int = 256,
        sync_group=None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.max_batch_sequences = max_batch_sequences
        self.policy = ServedPolicy()
        """The adapter version samples are tagged with; written by the weight sync."""
        self.sync_group = sync_group
        if sync_group is None and dist.is_initialized() and dist.get_world_size() > 1:
            self.sync_group = dist.group.WORLD

    def _any_rank(self, flag: bool | int) -> int:
        """Max of `flag` over the sync group (the value itself when running alone)."""
        if self.sync_group is None:
            return int(flag)
        t = torch.tensor(int(flag), device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.sync_group)
        return int(t)

    def _idle_forward(self) -> None:
        """A one-token forward that keeps this rank's collectives in step with busier ranks."""
        one = torch.zeros(1, dtype=torch.long, device=self.device)
        self.model(one, one, torch.tensor([0, 1], device=self.device), 1)

    def _forward(self, adapters: torch.Tensor | None, *args, **kwargs) -> torch.Tensor:
        """The model's forward, each token with its task's adapter when `adapters` ([T]) is given."""
        if adapters is None:
            return self.model(*args, **kwargs)
        with adapter_routing(self.model, adapters):
            return self.model(*args, **kwargs)

    @staticmethod
    def _sample(logits, sampling, generator, adapters: torch.Tensor | None):
        """sample_next_tokens on the host; with `adapters` ([B]), each task's rows from its own generator."""
        if adapters is None:
            tokens, logprobs = sample_next_tokens(logits, sampling, generator)
            return tokens.cpu(), logprobs.cpu()
        tokens = torch.empty(len(adapters), dtype=torch.long)
        logprobs = torch.empty(len(adapters))
        for adapter in adapters.unique().tolist():
            rows = (adapters == adapter).nonzero()[:, 0]
            chosen, chosen_logprobs = sample_next_tokens(
                logits[rows.to(logits.device)], sampling, None if generator is None else generator[adapter]
            )
            tokens[rows], logprobs[rows] = chosen.cpu(), chosen_logprobs.cpu()
        return tokens, logprobs

    def health(self) -> dict:
        return {"engine": "native", "alive": True, "adapter_version": self.policy.version}

    def close(self) -> None:
        """Nothing to release: the model is the trainer's."""

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, adapters: list[int] | None = None
    ) -> list[Sample]:
        """`adapters`: on a multi-task model (archon.lora.MultiLoRALinear), the task index whose
        adapter each prompt generates with; the tasks' prompts then decode in the same batches. With
        a seed, each task samples from its own generator (seeded with seed + ADAPTER_SEED_STRIDE *
        task index), so a task's samples do not depend on the other tasks' prompts."""
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; generation needs at least one prompt token")
        if adapters is not None and len(adapters) != len(prompts):
            raise ValueError(f"adapters has {len(adapters)} entries for {len(prompts)} prompts")
        generator = None
        if sampling.seed is not None and adapters is None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        elif sampling.seed is not None:
            generator = {a: torch.Generator(device=self.device).manual_seed(sampling.seed + ADAPTER_SEED_STRIDE * a)
                         for a in set(adapters)}  # fmt: skip
        requests = [(i, list(p)) for i, p in enumerate(prompts) for _ in range(sampling.n)]
        was_training = self.model.training
        self.model.eval()
        with self.policy.lease() as (_, version):
            try:
                return self._generate_all(requests, sampling, generator, version, adapters)
            finally:
                self.model.train(was_training)

    def _generate_all(self, requests, sampling: SamplingParams, generator, version: int, adapters=None) -> list[Sample]:
        samples: list[Sample] = []
        chunks = [requests[i : i + self.max_batch_sequences] for i in range(0, len(requests), self.max_batch_sequences)]
        for i in range(self._any_rank(len(chunks))):
            if i < len(chunks):
                samples += self._generate_batch(chunks[i], sampling, generator, version, adapters)
            else:  # no prompts left here: mirror the prefill and decode steps of busier ranks
                self._idle_forward()
                for step in range(sampling.max_new_tokens - 1):
                    if not self._any_rank(False):
                        break
                    self._idle_forward()
        return samples

    def _generate_batch(
        self, requests, sampling: SamplingParams, generator, version: int, adapters=None
    ) -> list[Sample]:
        device = self.device
        prompt_lens = torch.tensor([len(p) for _, p in requests])
        batch = len(requests)
        cache = KVCache(len(self.model.layers), batch, int(prompt_lens.max()) + sampling.max_new_tokens, device)

        tokens = torch.tensor([t for _, p in requests for t in p], device=device)
        positions = torch.cat([torch.arange(n) for n in prompt_lens.tolist()]).to(device)
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.long), prompt_lens.cumsum(0)]).to(device)
        cache.set_step(torch.repeat_interleave(torch.arange(batch), prompt_lens), positions, prefill_from_empty=True)
        slot_adapters = None if adapters is None else torch.tensor([adapters[i] for i, _ in requests])
        prefill_adapters = None
        if slot_adapters is not None:
            prefill_adapters = torch.repeat_interleave(slot_adapters, prompt_lens).to(device)
        logits = self._forward(prefill_adapters, tokens, positions, cu_seqlens, int(prompt_lens.max()), cache=cache)
        last_logits = logits[cu_seqlens[1:] - 1]

        completions: list[list[int]] = [[] for _ in range(batch)]
        logprobs: list[list[float]] = [[] for _ in range(batch)]
        finish = ["length"] * batch
        lengths = prompt_lens.clone()
        active = torch.arange(batch)
        stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long)
        for step in range(sampling.max_new_tokens):
            if len(active):
                next_tokens, next_logprobs = self._sample(
                    last_logits, sampling, generator, None if slot_adapters is None else slot_adapters[active]
                )
                for slot, token, logprob in zip(active.tolist(), next_tokens.tolist(), next_logprobs.tolist()):
                    completions[slot].append(token)
                    logprobs[slot].append(logprob)
                stopped = torch.isin(next_tokens, stop_ids)
                for slot in active[stopped].tolist():
                    finish[slot] = "stop"
                active, next_tokens = active[~stopped], next_tokens[~stopped]
            if step == sampling.max_new_tokens - 1 or not self._any_rank(len(active) > 0):
                break
            if len(active) == 0:
                self._idle_forward()
                continue
            positions = lengths[active]
            cache.set_step(active, positions, prefill_from_empty=False)
            cu_seqlens = torch.arange(len(active) + 1, device=device)
            decode_adapters = None if slot_adapters is None else slot_adapters[active].to(device)
            last_logits = self._forward(decode_adapters, next_tokens.to(device), positions.to(device), cu_seqlens, 1,
                                        cache=cache)  # fmt: skip
            lengths[active] += 1
        return [
            Sample(
                prompt_index=prompt_index,
                prompt_ids=prompt,
                completion_ids=completions[slot],
                logprobs=logprobs[slot],
                finish_reason=finish[slot],
                version=version,
                token_versions=[version] * len(completions[slot]),
            )
            for slot, (prompt_index, prompt) in enumerate(requests)
        ]
