"""The GRPO-LoRA recipe's configuration: one tree of dataclasses, exposed on the command line with
tyro and loadable from a YAML or TOML file (`--config FILE`, then command-line overrides)."""

from __future__ import annotations

import dataclasses
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from archon.engine import OptimConfig
from archon.lora import LoRAConfig
from archon.parallel import ParallelConfig
from archon.parallel.parallelize import DTypeName
from archon.rl.data import DataConfig
from archon.rl.losses import LossConfig
from archon.rl.rewards import RewardConfig
from archon.rl.tasks import ArithmeticTaskConfig
from archon.rollout.vllm import VLLMConfig


@dataclass
class ModelConfig:
    path: str | None = None
    """HF checkpoint directory. None runs the built-in demo (a small Qwen3 warm-started on arithmetic)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model path."""
    dtype: DTypeName = "float32"
    """Base-weight dtype; use float32 on CPU."""
    device: str = "auto"
    """auto, cuda, npu or cpu."""


@dataclass
class RolloutConfig:
    engine: Literal["native", "vllm"] = "native"
    """native: the embedded engine on the training model; vllm: vLLM servers (launched or given by
    URL), synced every step (see rollout.vllm)."""
    group_size: int = 8
    """Samples per prompt (G)."""
    prompts_per_step: int = 32
    """Prompts per step over all data-parallel ranks."""
    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_batch_sequences: int = 512
    """Sequences generated together by the native engine."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM servers, transport (disk, collective) and mode (adapter, merged); used with engine=vllm."""


@dataclass
class AlgorithmConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss (grpo, drgrpo, dapo, gspo, cispo), clip range, aggregation, KL penalty, TIS."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0 disables it."""
    overlong_penalty_factor: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1
    """Optimizer steps per PPO epoch (the step's samples split by prompt group)."""
    recompute_old_logprobs: bool = True
    """Score the rollout with the trainer before the update (pi_old); otherwise use the rollout log-probs."""
    teacher_path: str | None = None
    """On-policy distillation: an HF checkpoint loaded read-only; the per-token advantage becomes
    -(log pi_theta - log pi_teacher) on the student's own samples and rewards are only logged."""


@dataclass
class EvalConfig:
    every: int = 10
    """Held-out evaluation every N steps (and before the first and after the last); 0 disables it."""
    path: str | None = None
    """Held-out prompts (same format and fields as data.path)."""
    max_prompts: int = 200
    max_new_tokens: int | None = None
    """Default: rollout.max_new_tokens."""


@dataclass
class CheckpointConfig:
    every: int = 0
    """Resume checkpoint and PEFT adapter export every N steps (0: only at the end)."""
    keep_last: int = 2


@dataclass
class LoggingConfig:
    run_dir: str = "runs/grpo_lora"
    tensorboard: bool = True
    progress: bool = True


@dataclass
class DemoConfig:
    """The built-in demo: a small Qwen3 model warm-started by SFT on synthetic arithmetic."""

    task: ArithmeticTaskConfig = field(
        default_factory=lambda: ArithmeticTaskConfig(
            operations=("+",), min_digits=2, max_digits=2, num_train=6000, num_held_out=200
        )
    )
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 384
    sft_steps: int = 1500
    """Upper bound on SFT steps; the warm start stops earlier at sft_target_accuracy."""
    sft_target_accuracy: float = 0.25
    """Stop SFT once greedy accuracy on sft_dev_examples training problems reaches this, so RL
    starts from a weak but non-zero policy."""
    sft_check_every: int = 25
    sft_dev_examples: int = 128
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    cache_dir: str = ".cache/archon/demo"
    """Warm-start results are cached here, keyed by the settings above."""


@dataclass
class GRPOConfig:
    steps: int = 200
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(rank=16, alpha=32.0))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    micro_batch_tokens: int = 8192
    """Token budget of one forward/backward in training and scoring."""
    resume: str | None = None
    """Continue a run from a checkpoint (adapter, optimizer, step, RNG, data position): "latest" (a
    bare `--resume`) takes the newest in RUN_DIR/checkpoints, or give a checkpoint directory
    (RUN_DIR/checkpoints/step-NNNNNNNN). It is an error when there is nothing to resume, or when the
    checkpoint is damaged (the error names the newest intact one)."""
    overwrite: bool = False
    """Start a new run in a run directory that holds an earlier run: its outputs (checkpoints,
    adapters, metrics, TensorBoard logs, plots, vLLM logs) are deleted first. Anything else in the
    directory is never deleted; such a directory is refused. Without this flag or --resume, a
    non-empty run directory is refused."""


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _dataclass_in(tp: Any) -> type | None:
    """The dataclass inside `tp` (itself, or the non-None member of `X | None`)."""
    if _is_dataclass_type(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        members = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(members) == 1 and _is_dataclass_type(members[0]):
            return members[0]
    return None


def merge_into(instance: Any, values: dict[str, Any], where: str = "") -> Any:
    """A copy of dataclass `instance` with `values` (nested dicts) applied; unknown keys are errors."""
    if not isinstance(values, dict):
        raise ValueError(f"config section {where or '<root>'!r} must be a mapping, got {type(values).__name__}")
    hints = typing.get_type_hints(type(instance))
    names = {f.name for f in dataclasses.fields(instance)}
    changes = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else key
        if key not in names:
            raise ValueError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}")
        sub = _dataclass_in(hints[key])
        current = getattr(instance, key)
        if sub is not None and isinstance(value, dict):
            changes[key] = merge_into(current if current is not None else sub(), value, path)
        elif isinstance(value, list):
            changes[key] = tuple(value)
        else:
            changes[key] = value
    return dataclasses.replace(instance, **changes)


def load_config_file(path: str | Path, base: GRPOConfig | None = None) -> GRPOConfig:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml

        values = yaml.safe_load(text) or {}
    elif path.suffix == ".toml":
        import tomllib

        values = tomllib.loads(text)
    else:
        raise ValueError(f"config file {str(path)!r} must end in .yaml, .yml or .toml")
    try:
        return merge_into(base or GRPOConfig(), values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from None


def _bare_resume_means_latest(argv: list[str]) -> list[str]:
    """`--resume` followed by nothing or by another flag is `--resume latest`."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("latest")
    return out


def parse_config(argv: list[str] | None = None) -> GRPOConfig:
    """`--config FILE` (optional, first) supplies defaults; every other flag overrides them."""
    import tyro

    argv = _bare_resume_means_latest(list(sys.argv[1:] if argv is None else argv))
    default = GRPOConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a file path")
        default = load_config_file(argv[i + 1])
        del argv[i : i + 2]
    return tyro.cli(GRPOConfig, default=default, args=argv)
