"""The RL recipe's configuration tree: one dataclass per section, RLConfig at its root.

Every field is a flag on the command line (archon.rl.config.cli) and a key in a YAML or TOML file
(archon.rl.config.files); archon.rl.config.validation checks the settings together.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Literal

from archon.agents.setup import EnvironmentConfig
from archon.load_balance import MoEConfig
from archon.lora import LoRAConfig
from archon.optim import OptimConfig
from archon.parallel import ParallelConfig
from archon.parallel.parallelize import DTypeName
from archon.rl.algorithms import AlgorithmConfig, TeacherConfig  # noqa: F401 - TeacherConfig at its old path
from archon.rl.config.demo import DemoConfig
from archon.rl.data import DataConfig
from archon.rl.logging.trackers import TRACKERS, TrackerName, unknown_tracker
from archon.rl.problems import Problems
from archon.rl.rewards import RewardConfig
from archon.rollout.speculative import SpeculativeConfig
from archon.rollout.vllm import VLLMConfig


def warn_renamed(old: str, new: str) -> None:
    """The warning for a setting or name spelled as before a rename; the old spelling still works for
    one release."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}", FutureWarning, stacklevel=3
    )


def both_spellings_error(old: str, old_value: object, new: str, new_value: object) -> ValueError:
    """Both spellings of a renamed setting given, with different values."""
    return ValueError(
        f"{old}={old_value!r} and {new}={new_value!r} set the same thing to different values; set only {new}"
    )


@dataclass
class ModelConfig:
    path: str | None = None
    """HF checkpoint directory. None runs the built-in demo (a small Qwen3 warm-started on arithmetic)."""
    tokenizer: str | None = None
    """Tokenizer directory; default: the model path."""
    dtype: DTypeName = "float32"
    """Base-weight dtype; use float32 on CPU."""
    quantized_base: Literal["keep", "dequantize"] = "keep"
    """For an FP8 (block-scaled) or MXFP4 checkpoint: keep its quantized weights in their format,
    frozen, dequantized per GEMM (keep), or dequantize them into `dtype` as they load (dequantize)."""
    device: str = "auto"
    """auto, cuda, npu or cpu."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Load balancing of MoE routers (off by default)."""
    mtp: Literal["auto", "load", "skip"] = "auto"
    """The checkpoint's multi-token-prediction (MTP) layers (DeepSeek-V3 / Kimi K2, Qwen3.5, Qwen3-Next;
    see docs/mtp.md): load them (load; refused for a checkpoint without them), leave them on disk as
    the causal LM does (skip), or load them when the checkpoint has them and the run uses them, i.e.
    algorithm.mtp_loss_weight > 0 (auto)."""


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
    prefill_chunk_tokens: int | None = None
    """The most prompt tokens one prefill forward of the native engine takes: a prefill of more runs
    as successive forwards of at most this many tokens (a long prompt split across them, short ones
    sharing one), which bounds the prefill's activation memory, with the one-shot prefill's results.
    None: every prefill in one forward."""
    max_staleness: int = 0
    """Asynchronous RL: with N >= 1 the rollouts of later steps are generated (vLLM) while the
    current step trains, and a sample made with adapter version v is trained on only at trainer
    version <= v + N (older groups are dropped and sampled again). 0: the synchronous loop."""
    update_policy: Literal["finish", "continue"] = "finish"
    """What a request in flight does when a new adapter version is published (asynchronous RL, so
    it needs max_staleness >= 1 on the run or on a task). finish: it ends on the version it started
    with. continue: it goes on under the new version from its next token (partial rollouts), so a
    sample's tokens may come from several versions; each token carries the version that sampled it
    (Sample.token_versions), which the staleness bound (a sample's oldest token) and the decoupled
    loss use. See docs/rollouts.md#partial-rollouts."""
    measure_version_gap: bool = True
    """With max_staleness >= 1: score lagging samples again under the adapter version that sampled
    them (one extra forward per lag present), to split the trainer-rollout log-prob gap into the
    part due to version lag and the part due to numerics."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM servers, transport (disk, collective) and mode (adapter, merged); used with engine=vllm."""
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    """Speculative decoding in the native engine: method (off, mtp, draft_model), num_tokens,
    draft_model_path."""


def rollout_problems(rollout: RolloutConfig) -> Problems:
    """What is wrong with the rollout section on its own (sampling, batch sizes, the update policy)."""
    problems = Problems()
    problems.require(
        rollout.prompts_per_step >= 1, "rollout.prompts_per_step", rollout.prompts_per_step, "must be at least 1"
    )
    problems.require(rollout.group_size >= 1, "rollout.group_size", rollout.group_size, "must be at least 1")
    problems.require(
        rollout.max_new_tokens >= 1, "rollout.max_new_tokens", rollout.max_new_tokens, "must be at least 1"
    )
    problems.require(
        rollout.temperature > 0,
        "rollout.temperature",
        rollout.temperature,
        "training rollouts sample at this temperature and their log-probs are taken at it, so it must be > 0 "
        "(held-out evaluation is greedy regardless)",
    )
    problems.require(0 < rollout.top_p <= 1, "rollout.top_p", rollout.top_p, "must be in (0, 1]")
    problems.require(rollout.top_k >= 0, "rollout.top_k", rollout.top_k, "must be >= 0 (0 disables top-k)")
    problems.require(
        rollout.engine != "native" or rollout.group_size <= rollout.max_batch_sequences,
        "rollout.max_batch_sequences",
        rollout.max_batch_sequences,
        f"must be at least rollout.group_size={rollout.group_size}: the native engine decodes all the samples "
        "of a prompt at once when it can, one row each, beside the prompt's shared prefix",
    )
    problems.require(
        rollout.prefill_chunk_tokens is None or rollout.prefill_chunk_tokens >= 1,
        "rollout.prefill_chunk_tokens",
        rollout.prefill_chunk_tokens,
        "must be at least 1 (None: every prefill in one forward)",
    )
    problems.require(
        rollout.update_policy in ("finish", "continue"),
        "rollout.update_policy",
        rollout.update_policy,
        "must be 'finish' or 'continue'",
    )
    return problems


@dataclass
class EvalConfig:
    every: int = 10
    """Held-out evaluation every N steps (and before the first and after the last); 0 disables it."""
    path: str | None = None
    """Held-out prompts (same format and fields as data.path)."""
    max_prompts: int = 200
    max_new_tokens: int | None = None
    """Default: rollout.max_new_tokens."""


def eval_problems(evaluation: EvalConfig) -> Problems:
    problems = Problems()
    problems.require(evaluation.every >= 0, "eval.every", evaluation.every, "must be >= 0 (0 disables evaluation)")
    problems.require(evaluation.max_prompts >= 0, "eval.max_prompts", evaluation.max_prompts, "must be >= 0")
    problems.require(
        evaluation.max_new_tokens is None or evaluation.max_new_tokens >= 1,
        "eval.max_new_tokens",
        evaluation.max_new_tokens,
        "must be at least 1 (None: rollout.max_new_tokens)",
    )
    return problems


@dataclass
class CheckpointConfig:
    every: int = 0
    """Resume checkpoint and PEFT adapter export every N steps (0: only at the end)."""
    keep_last: int = 2
    """Resume checkpoints kept (the newest)."""
    keep_last_adapters: int = 2
    """PEFT exports kept in RUN_DIR/adapters (the newest); the final one, RUN_DIR/adapter, is separate."""


def checkpoint_problems(checkpoint: CheckpointConfig) -> Problems:
    problems = Problems()
    problems.require(
        checkpoint.every >= 0, "checkpoint.every", checkpoint.every, "must be >= 0 (0 saves only at the end)"
    )
    problems.require(checkpoint.keep_last >= 1, "checkpoint.keep_last", checkpoint.keep_last, "must be at least 1")
    problems.require(
        checkpoint.keep_last_adapters >= 1,
        "checkpoint.keep_last_adapters",
        checkpoint.keep_last_adapters,
        "must be at least 1",
    )
    return problems


@dataclass
class LoggingConfig:
    run_dir: str = "runs/grpo_lora"
    backends: tuple[TrackerName, ...] = ("tensorboard",)
    """Experiment trackers each step's metrics, the run's config and the sample tables go to, on
    rank 0 (archon.rl.logging.trackers): any of tensorboard (RUN_DIR/tensorboard), wandb, mlflow, trackio.
    metrics.jsonl is always written. Empty: none."""
    tensorboard: bool = True
    """Deprecated, until the next release: false means `backends` without tensorboard."""
    progress: bool = True
    project: str = "archon"
    """The wandb project, the default MLflow experiment and the Trackio project."""
    run_name: str | None = None
    """The tracker run's name; default: the run directory's name."""
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    """wandb's mode; None: WANDB_MODE, else online."""
    wandb_entity: str | None = None
    """The wandb team or user; None: wandb's default."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow runs are recorded; None: MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns."""
    mlflow_experiment: str | None = None
    """The MLflow experiment; None: `project`."""
    samples_every: int = 10
    """A table of samples (prompt, completion, reward and its terms, stop reason, adapter version,
    lag) every N steps, to RUN_DIR/samples/step_N.jsonl and each tracker; evaluations write one
    each (step_N.eval.jsonl). 0: none."""
    samples_per_table: int = 64
    """Rows per task in a sample table, in whole groups (at least one), from every data-parallel rank."""


def logging_problems(logging: LoggingConfig) -> Problems:
    """Trackers named right, the deprecated logging.tensorboard not contradicting logging.backends,
    the sample tables' cadence and size."""
    problems = Problems()
    problems += [unknown_tracker(name) for name in logging.backends if name not in TRACKERS]
    if not logging.tensorboard and "tensorboard" in logging.backends and tuple(logging.backends) != ("tensorboard",):
        conflict = both_spellings_error("logging.tensorboard", False, "logging.backends", list(logging.backends))
        problems.append(str(conflict))
    problems.require(
        logging.samples_every >= 0, "logging.samples_every", logging.samples_every, "must be >= 0 (0: no sample tables)"
    )
    problems.require(
        logging.samples_per_table >= 1, "logging.samples_per_table", logging.samples_per_table, "must be at least 1"
    )
    return problems


@dataclass
class TaskConfig:
    """One task of a multi-LoRA run: its own adapter on the shared frozen base, trained on its own
    data with its own reward, algorithm, LoRA config and optimizer. The run's model, rollout
    sampling (group size, prompts per step, tokens, temperature), evaluation cadence, checkpoint
    cadence and logging are shared. Outputs go to RUN_DIR/tasks/<name>/ and metrics are prefixed
    "<name>/"."""

    name: str = ""
    """Names the adapter, its output directory and its metrics (letters, digits, '_' and '-'; at most
    100 characters)."""
    data: DataConfig = field(default_factory=DataConfig)
    eval_path: str | None = None
    """Held-out prompts of this task (same format as data.path); None: no evaluation."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes (tools, environments); unset: single-turn."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The task's algorithm; ppo_epochs and minibatches must be the same for every task (a
    minibatch update trains every task at once)."""
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(rank=16, alpha=32.0))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    max_staleness: int = 0
    """This task's staleness bound (as rollout.max_staleness for one task, which must then be 0):
    with N >= 1 (vLLM rollouts) its later steps' rollouts are generated while the run trains, and a
    sample made with this task's adapter version v is trained on only at its version <= v + N."""


@dataclass
class RLConfig:
    steps: int = 200
    seed: int = 0
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoRAConfig = field(default_factory=lambda: LoRAConfig(rank=16, alpha=32.0))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    environment: EnvironmentConfig = field(default_factory=EnvironmentConfig)
    """Multi-turn episodes: an environment, its tools, the chat format and the episode limits
    (archon.agents); unset: one prompt, one completion."""
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
    adapters, metrics, sample tables, tracker files, plots, vLLM logs) are deleted first. Anything else in the
    directory is never deleted; such a directory is refused. Without this flag or --resume, a
    non-empty run directory is refused."""
    tasks: tuple[TaskConfig, ...] = ()
    """Multi-LoRA: several tasks trained at once on the one frozen base, each with its own adapter
    (archon.rl.run.task). Each task's data, reward, algorithm, lora and optim replace the top-level
    ones, which must then be left unset (data.path). Empty: one unnamed task of the top-level
    fields. A task may be added to or removed from the list when a run is resumed; the others
    resume as they were."""

    def task_configs(self) -> tuple[TaskConfig, ...]:
        """The tasks the run trains: `tasks`, or without them one unnamed task ("") made of the
        top-level data, eval.path, reward, algorithm, lora, optim and rollout.max_staleness."""
        if self.tasks:
            return self.tasks
        single = TaskConfig(
            name="",
            data=self.data,
            eval_path=self.eval.path,
            reward=self.reward,
            environment=self.environment,
            algorithm=self.algorithm,
            lora=self.lora,
            optim=self.optim,
            max_staleness=self.rollout.max_staleness,
        )
        return (single,)


@dataclass(frozen=True)
class TaskFields:
    """Where a task's settings are in the config, for the messages: tasks[i]'s own fields, or the
    top-level ones for the single task of a run without tasks."""

    prefix: str
    """Of the task's data, reward, algorithm, lora and optim fields: "tasks[i]." or ""."""
    eval_path: str
    """tasks[i].eval_path or eval.path."""
    max_staleness: str
    """tasks[i].max_staleness or rollout.max_staleness."""


def tasks_and_fields(config: RLConfig) -> list[tuple[TaskConfig, TaskFields]]:
    if not config.tasks:
        return [(config.task_configs()[0], TaskFields("", "eval.path", "rollout.max_staleness"))]
    return [
        (task, TaskFields(f"tasks[{i}].", f"tasks[{i}].eval_path", f"tasks[{i}].max_staleness"))
        for i, task in enumerate(config.tasks)
    ]
