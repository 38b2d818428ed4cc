"""Rollouts from vLLM servers over the OpenAI-compatible completions API.

`VLLMRolloutEngine` only generates: the servers it launches or connects to are managed by
archon.rollout.vllm_server, and adapters or weights reach them through a weight sync
(archon.sync.weight_sync), which publishes each new version to the engine's `policy`. Token ids go
in and come back (`return_token_ids`), with the sampled token's log-prob per step. The servers are
launched with `--logprobs-mode processed_logprobs`: the log-prob is that of the distribution vLLM
sampled from (temperature, then top-k/top-p truncation, renormalised), the convention of every
engine here (see archon/rollout/base.py Sample and archon/rollout/native.py). The servers'
configuration and mode are archon.rollout.vllm_config; the request a sampling asks for is built by
archon.rollout.vllm_sampling.

Versions and concurrent updates: generation may run in one thread while a sync publishes from
another. Each HTTP request reads (served adapter name, version) from the policy when it starts and
holds a lease on it until it returns. Two update policies (rollout.update_policy):
- finish (default): a request in flight finishes on the version it started with; its samples carry
  that version, for every token.
- continue (partial rollouts): requests stream their tokens; once a new version is published (or a
  merged publish waits to swap weights), the request is closed at the next streamed chunk (vLLM
  aborts a request whose client went away) and every sample not yet ended goes on in a request of
  its own, on the version now published: its prompt followed by the tokens it has so far, as a
  prompt to continue, with the tokens left to it and a seed derived from the sample's (the same
  seed would draw the same noise again). A token's version is the version of the request that
  streamed it, and its log-prob that of the distribution it was drawn from under that version;
  the prefix is computed again under the new version (prefill of the continuation prompt).
In adapter mode a publish registers the new version under a new name and switches new requests to
it; an old adapter is unloaded once no request holds it: under 'finish' at a later publish (requests
in flight keep their adapter), under 'continue' within the publish (the requests in flight let go
of it at their next chunk). In merged mode a publish holds new requests back, waits for the
requests in flight (under 'finish' to their end, under 'continue' to their next chunk), swaps the
served weights, then lets the waiting requests go on the new version. A publish never waits for
requests that have not started.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from archon.rollout.base import Sample, SamplingParams
from archon.rollout.policy import ServedPolicy
from archon.rollout.vllm_config import (  # noqa: F401 - VLLM_LORA_RANKS, merged_needs_collective at their old path
    VLLM_LORA_RANKS,
    VLLMConfig,
    check_lora_rank,
    family_spec,
    merged_needs_collective,
    resolve_vllm_mode,
)
from archon.rollout.vllm_sampling import (  # noqa: F401 - STREAM_INTERVAL_TOKENS at its old path
    STREAM_INTERVAL_TOKENS,
    completion_body,
    continuation_seed,
)
from archon.rollout.vllm_server import VLLMServerError, VLLMServers, looks_like_path, read_model_config


class VLLMRolloutEngine:
    """Generation on vLLM servers, launched here (rank 0) or given by URL.

    `lora_rank` is the trainer's LoRA rank (None: no LoRA, merged/full weights only). Attributes the
    weight sync uses: `servers` (archon.rollout.vllm_server.VLLMServers), `mode` (adapter or
    merged, resolved), `policy` (the published version), `model` (the served model's path)."""

    def __init__(
        self,
        config: VLLMConfig,
        model_path: str | None = None,
        lora_rank: int | None = None,
        log_dir: str | os.PathLike | None = None,
        rank: int = 0,
        longest_prompt_tokens: int | None = None,
        max_new_tokens: int | None = None,
        update_policy: Literal["finish", "continue"] = "finish",
    ) -> None:
        """`longest_prompt_tokens` and `max_new_tokens` (the most any request asks for) size the
        launched servers' max_model_len when the config leaves it unset. `update_policy`: what a
        request in flight does on a publish (rollout.update_policy, see the module docstring)."""
        if update_policy not in ("finish", "continue"):
            raise ValueError(f"rollout.update_policy must be 'finish' or 'continue', got {update_policy!r}")
        self.update_policy = update_policy
        self.config = config
        self.rank = rank
        self.model = config.model or model_path
        self.session = uuid.uuid4().hex[:8]
        """Part of every adapter name this run registers (runs sharing servers do not collide)."""
        self.policy = ServedPolicy()
        launches = not config.urls and rank == 0
        if launches and self.model is not None and looks_like_path(self.model):
            if not (Path(self.model).expanduser() / "config.json").exists():
                raise FileNotFoundError(f"model path {self.model!r} for vLLM does not exist or has no config.json")
        model_config = read_model_config(self.model) if self.model is not None and looks_like_path(self.model) else None
        self.mode = resolve_vllm_mode(config, model_config, lora=lora_rank is not None)
        lora = lora_rank is not None and self.mode == "adapter"
        if lora:
            check_lora_rank(lora_rank, config.max_lora_rank)
        spec = family_spec(model_config)
        hf_overrides = spec.vllm_hf_overrides.get(model_config["model_type"]) if spec is not None else None
        self.servers = VLLMServers(
            config,
            self.model,
            lora=lora,
            hf_overrides=hf_overrides,
            log_dir=log_dir,
            rank=rank,
            model_config=model_config if launches else None,
            longest_prompt_tokens=longest_prompt_tokens,
            max_new_tokens=max_new_tokens,
        )

    @property
    def served_model(self) -> str | None:
        """The base model's name on the servers (what merged-mode requests ask for)."""
        return self.servers.served_model

    def health(self) -> dict:
        status = self.servers.health()
        name, version = self.policy.current()
        return {
            "engine": "vllm",
            "alive": all(s["alive"] for s in status),
            "adapter_version": version,
            "adapter_name": name,
            "servers": status,
        }

    def close(self) -> None:
        self.servers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- generation -----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; generation needs at least one prompt token")
        servers = list(self.servers)
        if not servers:
            raise RuntimeError("this rank holds no vLLM servers (only rank 0 talks to vLLM)")
        if not prompts:
            return []
        shares = [list(range(len(prompts)))[i :: len(servers)] for i in range(len(servers))]
        futures = {}
        for server, indices in zip(servers, shares):
            if indices:
                future = self.servers.submit(self._complete, server, [prompts[i] for i in indices], sampling)
                futures[future] = server
        results = self.servers.wait_all(futures)
        by_prompt: dict[int, list[Sample]] = {}
        for indices, samples in zip([s for s in shares if s], results):
            for sample in samples:
                sample.prompt_index = indices[sample.prompt_index]
                by_prompt.setdefault(sample.prompt_index, []).append(sample)
        return [s for i in range(len(prompts)) for s in by_prompt[i]]

    def _complete(self, server, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """One request: its samples carry the version the policy published when it started."""
        if self.update_policy == "continue":
            return self._complete_continuing(server, prompts, sampling)
        with self.policy.lease() as (adapter_name, version):
            model_name = adapter_name or self.served_model
            response = self.servers.request(
                server,
                "POST",
                "/v1/completions",
                completion_body(model_name, prompts, sampling),
                timeout=self.config.request_timeout_s,
            )
        choices = sorted(response["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * sampling.n:
            raise VLLMServerError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts x n={sampling.n}")
        samples = []
        for choice in choices:
            prompt_index = choice["index"] // sampling.n
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise VLLMServerError(
                    "vLLM's completion has no token_ids; this engine needs vLLM >= 0.10.2 (return_token_ids)"
                )
            logprobs = choice["logprobs"]["token_logprobs"]
            samples.append(
                Sample(
                    prompt_index=prompt_index,
                    prompt_ids=list(prompts[prompt_index]),
                    completion_ids=list(token_ids),
                    logprobs=[float(x) for x in logprobs],
                    finish_reason="stop" if choice["finish_reason"] == "stop" else "length",
                    version=version,
                    token_versions=[version] * len(token_ids),
                    extra={"model": model_name},
                )
            )
        return samples

    # ---- the update policy 'continue' -------------------------------------------------------------
    def _complete_continuing(self, server, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """The samples of `prompts` streamed in one request until a publish supersedes its version;
        then each unfinished sample goes on alone, on the version then published, until it ends."""
        partials = [_Partial(i // sampling.n, i) for i in range(len(prompts) * sampling.n)]
        self._stream(server, lambda name: completion_body(name, prompts, sampling, stream=True), partials, sampling)
        unfinished = [p for p in partials if p.finish_reason is None]
        if unfinished:
            futures = {
                self.servers.submit(self._continue_sample, server, prompts[p.prompt_index], p, sampling): server
                for p in unfinished
            }
            self.servers.wait_all(futures)
        return [p.sample(prompts[p.prompt_index]) for p in partials]

    def _continue_sample(self, server, prompt: list[int], partial: _Partial, sampling: SamplingParams) -> None:
        """Generate `partial` on to its end, one request per version: each continues the prompt and
        the tokens so far, with the tokens left and a seed of its own."""
        while partial.finish_reason is None:
            left = sampling.max_new_tokens - len(partial.token_ids)
            seed = (
                None
                if sampling.seed is None
                else continuation_seed(sampling.seed, partial.index, len(partial.token_ids))
            )
            rest = SamplingParams(
                max_new_tokens=left,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                stop_token_ids=sampling.stop_token_ids,
                seed=seed,
            )
            continued = prompt + partial.token_ids
            self._stream(
                server, lambda name: completion_body(name, [continued], rest, stream=True), [partial], sampling
            )

    def _stream(self, server, body, partials: list[_Partial], sampling: SamplingParams) -> None:
        """One streaming request (`body(model name)`) under a lease, adding each choice's tokens to
        partials[choice index] with the lease's version, until every partial has ended or a publish
        supersedes the version (the connection is then closed and vLLM aborts the request)."""
        with self.policy.lease() as (adapter_name, version):
            model_name = adapter_name or self.served_model
            events = self.servers.stream(
                server, "/v1/completions", body(model_name), timeout=self.config.request_timeout_s
            )
            try:
                for event in events:
                    for choice in event.get("choices", ()):
                        partials[choice["index"]].extend(choice, version, model_name, sampling.max_new_tokens)
                    if all(p.finish_reason is not None for p in partials) or self.policy.superseded(version):
                        break
            finally:
                events.close()
            if all(p.finish_reason is None for p in partials) and not self.policy.superseded(version):
                raise VLLMServerError("vLLM's completion stream ended before any sample did")


@dataclass
class _Partial:
    """A sample being generated under the update policy 'continue': its tokens so far, each with its
    log-prob and the version that sampled it; `finish_reason` None while it goes on."""

    prompt_index: int
    index: int
    """Its place among the request's samples (prompt_index * n + its place among the prompt's)."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    model: str | None = None
    finish_reason: str | None = None

    def extend(self, choice: dict, version: int, model: str, max_new_tokens: int) -> None:
        """Add a streamed chunk's tokens (at most those left of max_new_tokens), sampled with `version`."""
        token_ids = choice.get("token_ids")
        if token_ids is None:
            raise VLLMServerError(
                "vLLM's completion has no token_ids; this engine needs vLLM >= 0.10.2 (return_token_ids)"
            )
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        if len(logprobs) != len(token_ids):
            raise VLLMServerError(f"vLLM streamed {len(token_ids)} tokens with {len(logprobs)} log-probs")
        if self.finish_reason is not None:
            return
        take = max_new_tokens - len(self.token_ids)
        self.token_ids += token_ids[:take]
        self.logprobs += [float(x) for x in logprobs[:take]]
        self.versions += [version] * len(token_ids[:take])
        self.model = model
        if choice.get("finish_reason") is not None:
            self.finish_reason = "stop" if choice["finish_reason"] == "stop" else "length"
        elif len(self.token_ids) >= max_new_tokens:
            self.finish_reason = "length"

    def sample(self, prompt: list[int]) -> Sample:
        return Sample(
            prompt_index=self.prompt_index,
            prompt_ids=list(prompt),
            completion_ids=self.token_ids,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason,
            version=self.versions[0],
            token_versions=self.versions,
            extra={"model": self.model},
        )
