"""Samples from vLLM (`--sampler vllm`): the server launches vLLM servers with LoRA on the same base
checkpoint (archon.rollout.vllm, the `--vllm.*` settings), writes each sampler's adapter as a PEFT
directory and loads it on them under the sampler's own name (several adapters are served at once),
and sends each generation to them. The log-probs a request asks of its prompt (and the top-k ones)
are the trainer's model's (archon/serve/scoring.py), as with the built-in engine."""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

from archon.lora.peft import save_peft_adapter
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.vllm import VLLMRolloutEngine
from archon.rollout.vllm_sampling import completion_body
from archon.serve.adapters import TrainingModel

ADAPTERS_DIR = "vllm_adapters"
"""Under --checkpoint-dir: the adapters of samplers made from a training client's current weights."""


def adapter_name(sampler_id: str) -> str:
    """The name a sampler's adapter is loaded under on the vLLM servers."""
    return "tinker-" + re.sub(r"[^A-Za-z0-9_-]", "-", sampler_id)


class VLLMSampler:
    def __init__(self, config, context_length: int, checkpoint_root: Path) -> None:
        """config: the ServeConfig (its base_model, max_lora_rank and vllm settings)."""
        vllm = dataclasses.replace(
            config.vllm, mode="adapter", max_model_len=config.vllm.max_model_len or context_length
        )
        self.root = checkpoint_root / ADAPTERS_DIR
        self.base_model = config.base_model
        self.engine = VLLMRolloutEngine(
            vllm, model_path=config.base_model, lora_rank=config.max_lora_rank, log_dir=self.root / "logs"
        )
        self.servers = self.engine.servers
        self.loaded: dict[str, Path | None] = {}
        """Sampler id -> the adapter directory this sampler wrote (None: a checkpoint's own)."""

    def load_trained(self, sampler_id: str, trained: TrainingModel) -> None:
        """Write `trained`'s adapter as it is now and load it for `sampler_id`."""
        directory = self.root / adapter_name(sampler_id)
        save_peft_adapter(trained.model, trained.loaded.converter, trained.lora, directory, self.base_model)
        self._load(sampler_id, directory, owned=True)

    def load_checkpoint(self, sampler_id: str, adapter_dir: Path) -> None:
        self._load(sampler_id, adapter_dir, owned=False)

    def _load(self, sampler_id: str, directory: Path, owned: bool) -> None:
        body = {"lora_name": adapter_name(sampler_id), "lora_path": str(directory.resolve())}
        self.servers.on_each(self.servers.request, "POST", "/v1/load_lora_adapter", body, 600)
        self.loaded[sampler_id] = directory if owned else None

    def unload(self, sampler_id: str) -> None:
        if sampler_id not in self.loaded:
            return
        body = {"lora_name": adapter_name(sampler_id)}
        self.servers.on_each(self.servers.request, "POST", "/v1/unload_lora_adapter", body)
        directory = self.loaded.pop(sampler_id)
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def generate(self, sampler_id: str | None, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        """n samples per prompt, in prompt order, from the sampler's adapter (None: the base)."""
        name = self.engine.served_model if sampler_id is None else adapter_name(sampler_id)
        server = self.servers[0]
        body = completion_body(name, prompts, sampling)
        response = self.servers.request(server, "POST", "/v1/completions", body, self.servers.config.request_timeout_s)
        choices = sorted(response["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * sampling.n:
            raise RuntimeError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts x n={sampling.n}")
        samples = []
        for choice in choices:
            index = choice["index"] // sampling.n
            tokens = list(choice["token_ids"])
            samples.append(
                Sample(
                    prompt_index=index,
                    prompt_ids=list(prompts[index]),
                    completion_ids=tokens,
                    logprobs=[float(x) for x in choice["logprobs"]["token_logprobs"]],
                    finish_reason="stop" if choice["finish_reason"] == "stop" else "length",
                    version=0,
                    token_versions=[0] * len(tokens),
                )
            )
        return samples

    def close(self) -> None:
        self.engine.close()
