"""The Tinker-compatible server's settings, one dataclass exposed on the command line with tyro:

python -m archon.serve --base-model DIR [--port N] [--host 127.0.0.1] [--api-key K] [--max-lora-rank R]

Under `torchrun --nproc-per-node N -m archon.serve ...` the model is laid out over the N ranks by
--parallel.* (the RL recipe's ParallelConfig: FSDP2 by default, --parallel.tp, --parallel.ep) and
rank 0 serves (archon/serve/ranks.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from archon.parallel import ParallelConfig
from archon.rollout.vllm_config import VLLMConfig
from archon.secrets import secret_field


@dataclass
class ServeConfig:
    base_model: str
    """The HF checkpoint directory of the base model every adapter trains on (config.json,
    safetensors, and the tokenizer the clients load with `get_tokenizer`)."""
    host: str = "127.0.0.1"
    """The address to listen on; the loopback interface unless told otherwise."""
    port: int = 8000
    """The port to listen on (0: any free port, printed at start)."""
    api_key: str | None = secret_field(None)
    """When set, every request must carry it in its X-API-Key header (the SDK's TINKER_API_KEY).
    A secret (archon.secrets): `python -m archon.serve` redacts it from its log records."""
    max_lora_rank: int = 64
    """The largest LoRA rank a training client may ask for."""
    lora_alpha: float = 32.0
    """The LoRA alpha of every adapter (scaling alpha / rank)."""
    model_name: str | None = None
    """The name clients pass as base_model (default: the --base-model path as given). Either the
    name or the path is accepted."""
    device: str = "cpu"
    """The device the model runs on ("cpu", "cuda", "cuda:1", "npu")."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """The base weights' dtype (LoRA factors are float32, float64 under a float64 base). float64 is for
    equality checks: the server then keeps fp32 islands in fp64 (archon.precision.fp32_islands_in_fp64)."""
    max_context_length: int | None = None
    """The longest sequence (prompt plus sampled tokens, or a training datum) served; default: the
    checkpoint's max_position_embeddings."""
    checkpoint_dir: str = "tinker_checkpoints"
    """Where save_state / save_weights_for_sampler write: <dir>/<model id>/<weights|sampler_weights>/<name>/,
    a PEFT adapter (adapter_config.json, adapter_model.safetensors) plus, for save_state, the
    optimizer state (DCP) in optimizer/."""
    default_max_tokens: int = 128
    """max_tokens of a sample request that leaves it unset."""
    seed: int = 0
    """Seeds a LoRA adapter's initialisation when the client gives no seed."""
    sampler: Literal["native", "vllm"] = "native"
    """What generates samples: archon's built-in engine, or vLLM servers the server launches at
    start (with `--vllm.*`; each sampler's adapter is loaded on them under its own name). Prompt
    log-probs are the trainer's model's either way."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """The vLLM servers of --sampler vllm (rollout.vllm's settings; served in adapter mode, with
    max_model_len the context limit unless set). Their max_lora_rank must hold --max-lora-rank."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """How every model is laid out over the ranks under torchrun (the RL recipe's `parallel` section):
    FSDP2 over all ranks by default, tensor parallelism with --parallel.tp, expert parallelism for an
    MoE base with --parallel.ep. Context parallelism (--parallel.cp) is refused."""

    def __post_init__(self) -> None:
        if self.max_lora_rank < 1:
            raise ValueError(f"ServeConfig.max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"ServeConfig.port must be in [0, 65535], got {self.port}")
        if self.max_context_length is not None and self.max_context_length < 2:
            raise ValueError(f"ServeConfig.max_context_length must be >= 2, got {self.max_context_length}")
        if self.parallel.cp != 1:
            raise ValueError(
                f"ServeConfig.parallel.cp={self.parallel.cp}: context parallelism is not served: the server's "
                "forwards (training, prompt scoring, the built-in engine's sampling) run every sequence whole on "
                "each rank and do not split its tokens over context-parallel ranks; use --parallel.tp to spread "
                "a model over more ranks"
            )
