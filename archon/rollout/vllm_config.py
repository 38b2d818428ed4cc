"""The configuration of the vLLM servers (rollout.vllm: `VLLMConfig`) and what is decided from it
before any server runs: the serving mode (adapter or merged, `resolve_vllm_mode`), the LoRA ranks
vLLM accepts (`check_lora_rank`) and why merged serving needs the collective transport
(`merged_needs_collective`). Launch (archon.rollout.vllm_launch), the server client
(archon.rollout.vllm_server), generation (archon.rollout.vllm) and the weight sync read it."""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass
from typing import Literal

from archon.secrets import secret_field
from archon.spec import get_spec

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class VLLMConfig:
    urls: tuple[str, ...] = secret_field((), kind="url")
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
    api_key: str | None = secret_field(None)
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
    mode: Literal["adapter", "merged"] | None = None
    """adapter: vLLM applies the LoRA; merged: W + s*B@A is loaded into the served base weights.
    Default: the mode the model's family is served in (its ModelSpec.vllm_modes), or merged when
    every weight is trained (no LoRA)."""
    sync_dir: str | None = None
    """Where disk sync writes adapters (must be readable by the servers); default: RUN_DIR/vllm_adapters."""
    sync_host: str | None = None
    """Address of trainer rank 0 as the servers' workers reach it (the TCPStore of the sync group);
    it must be an address of rank 0's machine. Default: rank 0's address on its route to the first
    server (127.0.0.1 for a server on loopback), found where rank 0 runs, so it holds on whichever
    node a multi-node launch puts rank 0."""
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
        for i, url in enumerate(self.urls):
            parts = urllib.parse.urlsplit(url)
            try:
                valid = parts.scheme in ("http", "https") and bool(parts.hostname) and not parts.path.strip("/")
                valid = valid and (parts.port is None or parts.port > 0)
            except ValueError:  # a port that is not a number
                valid = False
            if not valid:
                raise ValueError(
                    f"rollout.vllm.urls[{i}]={url!r}: expected a server's address, http://HOST:PORT (no path: "
                    "archon adds /health, /v1/... itself)"
                )
        if self.num_servers < 1 and not self.urls:
            raise ValueError(f"rollout.vllm.num_servers must be at least 1, got {self.num_servers}")
        if self.mode == "merged" and self.transport != "collective":
            raise ValueError(merged_needs_collective(self, lora=True))


def merged_needs_collective(config: VLLMConfig, lora: bool) -> str:
    """Why merged serving refuses `config.transport` (disk): `lora` says whether the run trains a
    LoRA, which makes an unset mode merged only if the family is served so."""
    if config.mode is not None:
        why = f"rollout.vllm.mode={config.mode!r}"
    else:
        why = (
            "the model is served merged (rollout.vllm.mode is unset: "
            f"{'its family is served merged' if lora else 'no LoRA'})"
        )
    return (
        f"rollout.vllm.transport={config.transport!r}: {why}, and merged weights go over the collective "
        "transport only; set rollout.vllm.transport='collective'"
    )


def check_lora_rank(lora_rank: int | None, max_lora_rank: int) -> None:
    if max_lora_rank not in VLLM_LORA_RANKS:
        raise ValueError(f"max_lora_rank {max_lora_rank} is not one vLLM accepts: {VLLM_LORA_RANKS}")
    if lora_rank is not None and lora_rank > max_lora_rank:
        raise ValueError(
            f"LoRA rank {lora_rank} is above the vLLM server's max_lora_rank {max_lora_rank}; raise "
            f"max_lora_rank (one of {VLLM_LORA_RANKS}) or lower the LoRA rank"
        )


def family_spec(model_config: dict | None):
    """The ModelSpec of the served model's family, or None when its config is unknown (a hub name)."""
    if model_config is None:
        return None
    return get_spec(model_config.get("model_type"))


def resolve_vllm_mode(config: VLLMConfig, model_config: dict | None, lora: bool) -> Literal["adapter", "merged"]:
    """The mode the servers are run in: `config.mode` when set; else merged without LoRA (every
    weight is sent) and otherwise the family's (ModelSpec.vllm_modes)."""
    if config.mode is not None:
        return config.mode
    if not lora:
        return "merged"
    spec = family_spec(model_config)
    if spec is None:
        raise ValueError(
            "rollout.vllm.mode is unset and the served model's family is unknown (no local config.json); "
            "set rollout.vllm.mode to 'adapter' or 'merged'"
        )
    return spec.vllm_mode(model_config.get("model_type"))
