"""The GRPO-LoRA recipe's configuration: one tree of dataclasses, exposed on the command line with
tyro and loadable from a YAML or TOML file (`--config FILE`, then command-line overrides).

A file's values are converted by each field's type as tyro converts a flag's text (merge_into), and
validate() checks the settings together before anything is built; both name the field at fault.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from archon.lora import LoRAConfig
from archon.load_balance import MoEConfig
from archon.parallel import ParallelConfig
from archon.parallel.parallelize import DTypeName
from archon.rl.algorithms import ALGORITHMS, LossConfig, algorithm_problems, importance_sampling_for
from archon.rl.data import DataConfig
from archon.rl.reward_fns import reward_function_problem
from archon.rl.rewards import RewardConfig
from archon.rl.tasks import ArithmeticTaskConfig
from archon.rollout.vllm import VLLMConfig
from archon.rollout.vllm_server import max_position_embeddings
from archon.trainer import OptimConfig


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
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Load balancing of MoE routers (off by default)."""


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
    max_staleness: int = 0
    """Asynchronous RL: with N >= 1 the rollouts of later steps are generated (vLLM) while the
    current step trains, and a sample made with adapter version v is trained on only at trainer
    version <= v + N (older groups are dropped and sampled again). 0: the synchronous loop."""
    measure_version_gap: bool = True
    """With max_staleness >= 1: score lagging samples again under the adapter version that sampled
    them (one extra forward per lag present), to split the trainer-rollout log-prob gap into the
    part due to version lag and the part due to numerics."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """vLLM servers, transport (disk, collective) and mode (adapter, merged); used with engine=vllm."""


@dataclass
class AlgorithmConfig:
    loss: LossConfig = field(default_factory=LossConfig)
    """The algorithm (archon.rl.algorithms: grpo, drgrpo, dapo, gspo, cispo, rloo, reinforce_pp,
    reinforce_pp_baseline) and its loss: clip range, dual clip, aggregation, KL penalty, entropy
    bonus, importance sampling, IcePop."""
    dynamic_sampling: bool = False
    """DAPO: drop groups whose rewards are all equal."""
    overlong_buffer: int = 0
    """DAPO soft overlong penalty over the last N tokens before max_new_tokens; 0 disables it."""
    overlong_penalty_factor: float = 1.0
    ppo_epochs: int = 1
    minibatches: int = 1
    """Optimizer steps per PPO epoch (the step's samples split by prompt group)."""
    recompute_old_logprobs: bool = True
    """Score the rollout with the trainer before the update (pi_old); otherwise use the rollout log-probs,
    which is allowed only without truncation (rollout.top_p = 1, top_k = 0): the rollout log-probs are
    those of the truncated distribution that sampled, not of the policy the loss scores."""
    teacher_path: str | None = None
    """On-policy distillation: an HF checkpoint loaded read-only; the per-token advantage becomes
    -(log pi_theta - log pi_teacher) on the student's own samples and rewards are only logged
    (unless distillation_weight is set)."""
    distillation_weight: float | None = None
    """On-policy distillation mixed with task rewards: the per-token advantage becomes the reward
    advantage plus distillation_weight * (log pi_teacher - log pi_theta). Needs teacher_path; must
    be > 0. None: the teacher's advantage alone."""
    max_skipped_steps: int = 3
    """An update whose loss or gradient norm is NaN or inf is skipped (adapter and optimizer state
    left as they were, the LR schedule still follows the RL step; counted in the metric
    skipped_steps). This many RL steps in a row with a skipped update stop the run with an error."""


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
    """Resume checkpoints kept (the newest)."""
    keep_last_adapters: int = 2
    """PEFT exports kept in RUN_DIR/adapters (the newest); the final one, RUN_DIR/adapter, is separate."""


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
    """Stop SFT once the greedy accuracy of every operation on its development problems has been at
    least this for sft_checks_at_target checks in a row, so RL starts from a weak but non-zero
    policy on each. The development problems are kept out of the SFT batches, so the stop does not
    depend on memorised answers; several checks in a row, so it does not stop on a lucky one."""
    sft_check_every: int = 10
    sft_checks_at_target: int = 3
    sft_dev_examples: int = 128
    """Development problems per operation, taken from the training split."""
    sft_batch_size: int = 64
    sft_lr: float = 3e-3
    cache_dir: str = ".cache/archon/demo"
    """Warm-start results are cached here, keyed by the settings above."""


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
    tasks: tuple[TaskConfig, ...] = ()
    """Multi-LoRA: several tasks trained at once on the one frozen base, each with its own adapter
    (archon.rl.task). Each task's data, reward, algorithm, lora and optim replace the top-level
    ones, which must then be left unset (data.path). Empty: the single-adapter recipe. A task may
    be added to or removed from the list when a run is resumed; the others resume as they were."""


# ---- typed values from config files -------------------------------------------------------------
# A file's values are converted by the field's type hint with the rules tyro applies to a flag's
# text, so `lr: 1e-3` (a string to PyYAML) is the float a flag would give, and anything a flag would
# refuse is an error that names the field.


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_none(value: Any) -> bool:
    """None, or "None": tyro's spelling of None on the command line (TOML has no null)."""
    return value is None or value == "None"


def _shown(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _expected(tp: Any) -> str:
    """What a value of type `tp` looks like, for error messages."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list, each {_expected(args[0])}"
        return f"a list of {len(args)} items ({', '.join(_expected(a) for a in args)})"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(member) for member in typing.get_args(tp))
    if _is_dataclass_type(tp):
        return f"a section (a mapping of {tp.__name__} fields)"
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"a mapping of {_expected(key_tp)} to {_expected(value_tp)}"
    return repr(tp)


class _WrongType(ValueError):
    """A value that does not fit its field's type (within a union, the next member is tried)."""


def _convert(value: Any, tp: Any, where: str, current: Any = None) -> Any:
    """`value` (as read from a file) as type `tp`; raises ValueError naming `where`."""
    origin = typing.get_origin(tp)

    def wrong() -> _WrongType:
        hint = " (quote it to make it a string)" if tp is str and value is not None else ""
        return _WrongType(f"{where}: expected {_expected(tp)}, got {_shown(value)}{hint}")

    if origin in (typing.Union, types.UnionType):
        members = [member for member in typing.get_args(tp) if member is not type(None)]
        if len(members) < len(typing.get_args(tp)) and _is_none(value):
            return None
        if len(members) == 1:
            return _convert(value, members[0], where, current)
        for member in members:
            try:
                return _convert(value, member, where, current)
            except _WrongType:
                continue
        raise wrong()
    if tp is type(None):
        if _is_none(value):
            return None
        raise wrong()
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise wrong()
        return merge_into(current if isinstance(current, tp) else tp(), value, where)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if type(value) is type(choice) and value == choice:
                return choice
            if isinstance(value, str) and not isinstance(choice, str) and value == str(choice):
                return choice
        raise wrong()
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise wrong()
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(value) != len(args):
            raise _WrongType(f"{where}: expected {_expected(tp)}, got {len(value)} items: {list(value)!r}")
        return tuple(_convert(item, item_tp, f"{where}[{i}]") for i, (item, item_tp) in enumerate(zip(value, args)))
    if origin is dict:
        if not isinstance(value, dict):
            raise wrong()
        key_tp, value_tp = typing.get_args(tp)
        return {
            _convert(key, key_tp, f"{where} key {key!r}"): _convert(item, value_tp, f"{where}[{key!r}]")
            for key, item in value.items()
        }
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise wrong()
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise wrong()
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise wrong()
    if tp is str:
        if isinstance(value, str):
            return value
        raise wrong()
    if tp is Any:
        return value
    raise TypeError(f"{where}: config files cannot set a field of type {tp!r}")


def merge_into(instance: Any, values: dict[str, Any], where: str = "") -> Any:
    """A copy of dataclass `instance` with `values` (nested mappings, as read from a file) applied.

    Each value is converted to its field's type; an unknown key, a value of the wrong type, a
    scalar given for a section or a mapping given for a plain field is a ValueError that names the
    field (dotted path from the root).
    """
    if not isinstance(values, dict):
        raise _WrongType(f"{where or 'the config'}: expected {_expected(type(instance))}, got {_shown(values)}")
    hints = typing.get_type_hints(type(instance))
    names = [f.name for f in dataclasses.fields(instance) if f.init]
    changes = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ValueError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}")
        if path == "resume" and isinstance(value, bool):  # as on the command line: a bare --resume is "latest"
            value = "latest" if value else None
        changes[key] = _convert(value, hints[key], path, getattr(instance, key))
    try:
        return dataclasses.replace(instance, **changes)
    except (TypeError, ValueError) as e:  # the dataclass's own checks (__post_init__)
        raise ValueError(f"{where or 'the config'}: {e}") from None


def _read_values(path: Path) -> Any:
    """The parsed contents of a YAML or TOML file; a syntax error is a ValueError (with its line)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)  # TOMLDecodeError is a ValueError
    import yaml

    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML: {e}") from None
    return {} if values is None else values


def load_config_file(path: str | Path, base: GRPOConfig | None = None) -> GRPOConfig:
    """`base` (default: GRPOConfig()) with the values of a YAML or TOML file; errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    if path.suffix not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"config file {str(path)!r} must end in .yaml, .yml or .toml")
    try:
        return merge_into(base or GRPOConfig(), _read_values(path))
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"config file {path}: {e}") from None


def _bare_resume_means_latest(argv: list[str]) -> list[str]:
    """`--resume` followed by nothing or by another flag is `--resume latest`."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("latest")
    return out


def parse_config(argv: list[str] | None = None) -> GRPOConfig:
    """`--config FILE` (optional) supplies defaults; every other flag overrides them. The result is
    checked with validate()."""
    import tyro

    argv = _bare_resume_means_latest(list(sys.argv[1:] if argv is None else argv))
    default = GRPOConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a file path")
        default = load_config_file(argv[i + 1])
        del argv[i : i + 2]
    config = tyro.cli(GRPOConfig, default=default, args=argv)
    validate(config)
    return config


# ---- validation ---------------------------------------------------------------------------------


def validate(config: GRPOConfig, world_size: int | None = None) -> None:
    """Fail now, naming each field, on settings that would otherwise fail or misbehave only once the
    run is under way.

    world_size: processes in the run; default: the process group's size, else torchrun's
    WORLD_SIZE, else 1. Reads the config.json of model.path and algorithm.teacher_path (no weights).
    """
    problems = _setting_problems(config)
    problems += _parallel_problems(config, _world_size() if world_size is None else world_size)
    problems += _model_problems(config)
    world = _world_size() if world_size is None else world_size
    if config.tasks and world > 1:
        problems.append(f"tasks: a multi-task run trains in one process, not {world}; run it without torchrun")
    if problems:
        raise ValueError("invalid configuration:\n" + "\n".join(f"  {problem}" for problem in problems))


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


MAX_STALENESS = 64
"""The largest rollout.max_staleness (and tasks[i].max_staleness): one or two steps ahead already
hide the generation time (README, Asynchronous RL), samples many versions old are too far
off-policy for the truncated importance weights to correct, and each unit of the bound keeps one
more step of rollouts and one more adapter copy in memory."""


def _setting_problems(config: GRPOConfig) -> list[str]:
    rollout, algorithm, loss = config.rollout, config.algorithm, config.algorithm.loss
    problems: list[str] = []

    def require(ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            problems.append(f"{name}={value!r}: {rule}")

    require(config.steps >= 1, "steps", config.steps, "must be at least 1")
    require(
        config.model.moe.bias_update_rate == 0 or rollout.engine != "vllm", "model.moe.bias_update_rate",
        config.model.moe.bias_update_rate, "must be 0 with rollout.engine=vllm: the weight sync does not send the "
        "routers' correction biases, so vLLM would route with the ones it loaded",
    )  # fmt: skip
    require(config.micro_batch_tokens >= 1, "micro_batch_tokens", config.micro_batch_tokens, "must be at least 1")
    require(rollout.prompts_per_step >= 1, "rollout.prompts_per_step", rollout.prompts_per_step, "must be at least 1")
    require(rollout.max_staleness >= 0, "rollout.max_staleness", rollout.max_staleness, "must be 0 or more")
    if rollout.max_staleness > MAX_STALENESS:
        problems.append(
            f"rollout.max_staleness={rollout.max_staleness}: must be at most {MAX_STALENESS}: the producer runs up to "
            f"N steps ahead, so each unit of N holds one more RL step of rollouts ({rollout.prompts_per_step} prompts "
            f"x {rollout.group_size} samples) in memory, and the trainer keeps the adapters of the last N+1 versions "
            "on every rank to score lagging samples again (rollout.measure_version_gap)"
        )
    elif rollout.max_staleness >= config.steps >= 1:
        problems.append(
            f"rollout.max_staleness={rollout.max_staleness}: must be below steps={config.steps}: the producer runs at "
            "most steps-1 steps ahead, so a larger bound has no effect"
        )
    if rollout.max_staleness > 0:
        require(
            rollout.engine == "vllm", "rollout.engine", rollout.engine,
            f"rollout.max_staleness={rollout.max_staleness} generates while the trainer trains, which needs "
            "rollout servers (engine=vllm); the native engine runs on the training model and is synchronous",
        )  # fmt: skip
        require(
            algorithm.recompute_old_logprobs, "algorithm.recompute_old_logprobs", algorithm.recompute_old_logprobs,
            f"rollout.max_staleness={rollout.max_staleness} trains on samples of older adapter versions; the "
            "trainer's log-probs before the update are the proximal policy of the decoupled objective",
        )  # fmt: skip
    spec = ALGORITHMS[loss.algorithm]
    require(rollout.group_size >= 1, "rollout.group_size", rollout.group_size, "must be at least 1")
    problems += algorithm_problems(algorithm, rollout.group_size)
    require(rollout.max_new_tokens >= 1, "rollout.max_new_tokens", rollout.max_new_tokens, "must be at least 1")
    require(
        rollout.temperature > 0, "rollout.temperature", rollout.temperature,
        "training rollouts sample at this temperature and their log-probs are taken at it, so it must be > 0 "
        "(held-out evaluation is greedy regardless)",
    )  # fmt: skip
    require(0 < rollout.top_p <= 1, "rollout.top_p", rollout.top_p, "must be in (0, 1]")
    require(rollout.top_k >= 0, "rollout.top_k", rollout.top_k, "must be >= 0 (0 disables top-k)")
    require(
        algorithm.recompute_old_logprobs or (rollout.top_p == 1 and rollout.top_k == 0),
        "algorithm.recompute_old_logprobs", algorithm.recompute_old_logprobs,
        f"must be true with rollout.top_p={rollout.top_p} / rollout.top_k={rollout.top_k}: the rollout log-probs are "
        "those of the truncated, renormalised distribution that sampled, the trainer's those of the untruncated "
        "policy, so taken as pi_old they would start every PPO ratio below 1",
    )  # fmt: skip
    require(
        rollout.engine != "native" or rollout.group_size <= rollout.max_batch_sequences,
        "rollout.max_batch_sequences", rollout.max_batch_sequences,
        f"must be at least rollout.group_size={rollout.group_size}: the native engine keeps a prompt's samples "
        "in one block of its cache table",
    )  # fmt: skip
    require(algorithm.minibatches >= 1, "algorithm.minibatches", algorithm.minibatches, "must be at least 1")
    require(algorithm.ppo_epochs >= 1, "algorithm.ppo_epochs", algorithm.ppo_epochs, "must be at least 1")
    require(
        0 <= algorithm.overlong_buffer <= rollout.max_new_tokens,
        "algorithm.overlong_buffer", algorithm.overlong_buffer,
        f"must be between 0 and rollout.max_new_tokens={rollout.max_new_tokens}",
    )  # fmt: skip
    require(loss.kl_coef >= 0, "algorithm.loss.kl_coef", loss.kl_coef, "must be >= 0 (0 disables the KL penalty)")
    require(loss.importance_cap > 0, "algorithm.loss.importance_cap", loss.importance_cap, "must be > 0")
    for name, value, enabled in (
        ("algorithm.loss.importance_sampling", loss.importance_sampling,
         importance_sampling_for(loss, rollout.max_staleness) != "none"),
        ("algorithm.loss.icepop_band", loss.icepop_band, loss.icepop_band is not None),
    ):
        require(
            not enabled or algorithm.recompute_old_logprobs, name, value,
            "needs algorithm.recompute_old_logprobs=true: the correction compares the trainer's log-probs "
            "(pi_old) with the rollout's, which are the same numbers without the recompute",
        )  # fmt: skip
    if loss.icepop_band is not None:
        low, high = loss.icepop_band
        require(
            0 < low <= 1 <= high, "algorithm.loss.icepop_band", loss.icepop_band,
            "must be (low, high) with 0 < low <= 1 <= high (the band of pi_old / mu ratios kept)",
        )  # fmt: skip
    if loss.clip_ratio_c is not None:
        require(
            loss.clip_ratio_c > 1, "algorithm.loss.clip_ratio_c", loss.clip_ratio_c,
            "must be > 1 (None disables dual clip)",
        )  # fmt: skip
        require(
            spec.dual_clip, "algorithm.loss.clip_ratio_c", loss.clip_ratio_c,
            f"dual clip bounds the PPO clipped objective, which algorithm {loss.algorithm!r} does not use",
        )  # fmt: skip
    require(
        loss.entropy_coef >= 0, "algorithm.loss.entropy_coef", loss.entropy_coef,
        "must be >= 0 (0 disables the entropy bonus)",
    )  # fmt: skip
    if loss.kl_cap is not None:
        require(loss.kl_cap > 0, "algorithm.loss.kl_cap", loss.kl_cap, "must be > 0 (None: no cap)")
        require(
            loss.kl_estimator == "k3", "algorithm.loss.kl_cap", loss.kl_cap,
            f"caps the k3 estimator, but algorithm.loss.kl_estimator={loss.kl_estimator!r}",
        )  # fmt: skip
        require(
            loss.kl_coef > 0, "algorithm.loss.kl_cap", loss.kl_cap,
            "has no effect with algorithm.loss.kl_coef=0 (no KL penalty)",
        )  # fmt: skip
    if algorithm.distillation_weight is not None:
        require(
            algorithm.teacher_path is not None, "algorithm.distillation_weight", algorithm.distillation_weight,
            "weights a teacher's advantage, but algorithm.teacher_path is not set",
        )  # fmt: skip
        require(
            algorithm.distillation_weight > 0, "algorithm.distillation_weight", algorithm.distillation_weight,
            "must be > 0 (None: the teacher's advantage alone)",
        )  # fmt: skip
    if config.lora is not None:
        require(config.lora.alpha > 0, "lora.alpha", config.lora.alpha, "must be > 0")
        for key, alpha in config.lora.alpha_pattern.items():
            require(alpha > 0, f"lora.alpha_pattern[{key!r}]", alpha, "must be > 0")
    try:
        config.optim.for_run(config.steps)
    except ValueError as e:
        problems.append(f"optim.warmup_steps={config.optim.warmup_steps}: {e}")
    problems += _optim_problems(config.optim)
    require(config.eval.every >= 0, "eval.every", config.eval.every, "must be >= 0 (0 disables evaluation)")
    require(config.eval.max_prompts >= 0, "eval.max_prompts", config.eval.max_prompts, "must be >= 0")
    require(
        config.eval.max_new_tokens is None or config.eval.max_new_tokens >= 1,
        "eval.max_new_tokens", config.eval.max_new_tokens, "must be at least 1 (None: rollout.max_new_tokens)",
    )  # fmt: skip
    require(
        config.checkpoint.every >= 0, "checkpoint.every", config.checkpoint.every,
        "must be >= 0 (0 saves only at the end)",
    )  # fmt: skip
    require(config.checkpoint.keep_last >= 1, "checkpoint.keep_last", config.checkpoint.keep_last, "must be at least 1")
    require(
        config.checkpoint.keep_last_adapters >= 1, "checkpoint.keep_last_adapters",
        config.checkpoint.keep_last_adapters, "must be at least 1",
    )  # fmt: skip
    require(
        algorithm.max_skipped_steps >= 1, "algorithm.max_skipped_steps", algorithm.max_skipped_steps,
        "must be at least 1",
    )  # fmt: skip
    if config.lora is None:
        needs = ["the PEFT adapter written at each checkpoint and at the end"]
        if loss.kl_coef > 0:
            needs.append(
                f"algorithm.loss.kl_coef={loss.kl_coef} (the reference policy is the model with its adapter off)"
            )
        if rollout.engine == "vllm" and rollout.vllm.mode == "adapter":
            needs.append("rollout.vllm.mode='adapter' (vLLM applies the trained adapter)")
        problems.append(
            f"lora=None (every weight trained, no adapter), but the run needs an adapter for: {'; '.join(needs)}"
        )
    if (problem := reward_function_problem(config.reward.function)) is not None:
        problems.append(f"reward.function={config.reward.function!r}: {problem}")
    if config.tasks:
        problems += _task_problems(config)
    return problems


def _optim_problems(optim: OptimConfig) -> list[str]:
    """AdamW's settings, which torch checks only in part and only once the trainer is built; a NaN or
    infinite value would turn every adapter weight into NaN at the first update."""
    problems = []

    def require(ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            problems.append(f"optim.{name}={value!r}: {rule}")

    require(math.isfinite(optim.lr) and optim.lr >= 0, "lr", optim.lr, "must be a finite number >= 0")
    for i, beta in enumerate(optim.betas):
        require(0 <= beta < 1, f"betas[{i}]", beta, "must be in [0, 1)")
    require(math.isfinite(optim.eps) and optim.eps > 0, "eps", optim.eps, "must be a finite number > 0")
    require(
        math.isfinite(optim.weight_decay) and optim.weight_decay >= 0, "weight_decay", optim.weight_decay,
        "must be a finite number >= 0",
    )  # fmt: skip
    require(
        optim.max_grad_norm is None or (math.isfinite(optim.max_grad_norm) and optim.max_grad_norm >= 0),
        "max_grad_norm", optim.max_grad_norm, "must be a finite number >= 0 (None or 0 only measures the norm)",
    )  # fmt: skip
    return problems


TASK_NAME = re.compile(r"[A-Za-z0-9_-]+")
TASK_NAME_MAX_CHARS = 100
"""A task's name is part of directory names (its served adapters' are archon-<session>-<name>-v<version>),
and file systems take at most 255 bytes a name."""


def _task_problems(config: GRPOConfig) -> list[str]:
    """Each task's settings, checked as the single-task recipe checks its own (field names
    prefixed tasks[i]), and what a multi-task run does not support."""
    problems: list[str] = []
    names = [task.name for task in config.tasks]
    for i, task in enumerate(config.tasks):
        where = f"tasks[{i}]"
        if not TASK_NAME.fullmatch(task.name):
            problems.append(f"{where}.name={task.name!r}: must be letters, digits, '_' or '-' (it names a directory)")
        elif len(task.name) > TASK_NAME_MAX_CHARS:
            problems.append(f"{where}.name={task.name!r}: {len(task.name)} characters, at most {TASK_NAME_MAX_CHARS} "
                            "(it names a directory)")
        elif names.count(task.name) > 1:
            problems.append(f"{where}.name={task.name!r}: task names must be unique")
        as_run = dataclasses.replace(
            config, tasks=(), data=task.data, reward=task.reward, algorithm=task.algorithm, lora=task.lora,
            optim=task.optim, rollout=dataclasses.replace(config.rollout, max_staleness=task.max_staleness),
        )  # fmt: skip
        problems += [f"{where}.{problem.replace('rollout.max_staleness', 'max_staleness')}"
                     for problem in _setting_problems(as_run)]  # fmt: skip
        if task.algorithm.ppo_epochs != config.tasks[0].algorithm.ppo_epochs:
            problems.append(f"{where}.algorithm.ppo_epochs={task.algorithm.ppo_epochs}: every task must have "
                            f"tasks[0]'s ({config.tasks[0].algorithm.ppo_epochs}); a minibatch trains every task")
        if task.algorithm.minibatches != config.tasks[0].algorithm.minibatches:
            problems.append(f"{where}.algorithm.minibatches={task.algorithm.minibatches}: every task must have "
                            f"tasks[0]'s ({config.tasks[0].algorithm.minibatches}); a minibatch trains every task")
        if config.model.path is not None:
            if not task.data.path:
                problems.append(f"{where}.data.path is not set: each task needs its training prompts")
            elif not Path(task.data.path).exists():
                problems.append(f"{where}.data.path={task.data.path!r}: no such file or directory")
            if task.eval_path and not Path(task.eval_path).exists():
                problems.append(f"{where}.eval_path={task.eval_path!r}: no such file or directory")
    if config.data.path:
        problems.append(f"data.path={config.data.path!r}: with tasks, each task has its own data (tasks[i].data.path)")
    if config.rollout.max_staleness:
        problems.append(
            f"rollout.max_staleness={config.rollout.max_staleness}: with tasks, each task has its own bound "
            "(tasks[i].max_staleness); leave this at 0"
        )
    vllm = config.rollout.vllm
    # every task's adapter at once, and a task with a staleness bound also its previous version,
    # which its requests in flight keep while the next one is served
    adapters = sum(2 if task.max_staleness > 0 else 1 for task in config.tasks)
    if config.rollout.engine == "vllm" and not vllm.urls and vllm.max_loras < adapters:
        problems.append(
            f"rollout.vllm.max_loras={vllm.max_loras}: the servers serve every task's adapter at once (two versions "
            f"of a task with max_staleness >= 1), so it must be at least {adapters}"
        )
    if config.rollout.engine == "vllm" and vllm.mode == "merged":
        problems.append(
            "rollout.vllm.mode='merged': merged weights serve one adapter, not one per task; use mode 'adapter'"
        )
    return problems


def _parallel_problems(config: GRPOConfig, world_size: int) -> list[str]:
    try:
        dims = config.parallel.dims(world_size, "cpu")
    except (ValueError, NotImplementedError) as e:
        return [f"parallel: {e}"]
    if config.rollout.prompts_per_step < dims.dp:
        return [
            f"rollout.prompts_per_step={config.rollout.prompts_per_step}: smaller than the data-parallel size "
            f"{dims.dp} (world size {world_size}, parallel.tp={dims.tp}); every data-parallel rank needs at "
            "least one prompt per step"
        ]
    return []


def _read_model_config(directory: str, field_name: str) -> dict | None:
    """The config.json of an HF checkpoint directory, or None when there is none (the model loader
    reports a missing checkpoint); an unreadable file is an error naming it."""
    from archon.checkpoint.hf import read_json_file

    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_json_file(path, "model config")
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None


def _vllm_mode_problems(config: GRPOConfig, model_config: dict) -> list[str]:
    """The servers' mode (rollout.vllm.mode, or the family's) against the transport and the
    staleness bound, before any server is launched."""
    from archon.rollout.vllm import merged_needs_collective, resolve_vllm_mode

    vllm, max_staleness = config.rollout.vllm, config.rollout.max_staleness
    try:
        mode = resolve_vllm_mode(vllm, model_config, lora=config.lora is not None)
    except ValueError as e:
        return [str(e)]
    problems = []
    if mode == "merged" and vllm.transport == "disk":
        problems.append(merged_needs_collective(vllm, lora=config.lora is not None))
    if mode == "adapter" and max_staleness > 0 and not vllm.urls and vllm.max_loras < 2:
        problems.append(
            f"rollout.vllm.max_loras={vllm.max_loras}: with rollout.max_staleness={max_staleness} the requests in "
            "flight keep their adapter version while the next one is served, so a server batch holds two "
            "adapters at once; set it to 2 or more"
        )
    return problems


def _model_problems(config: GRPOConfig) -> list[str]:
    if config.model.path is None:  # the demo builds its model later
        return []
    from archon.checkpoint.hf import check_model_dir

    problems = []
    try:
        check_model_dir(config.model.path, "model.path")
    except (OSError, ValueError) as e:
        problems.append(str(e))
    if config.tasks:
        pass  # each task's data is checked with the task (_task_problems)
    elif not config.data.path:
        problems.append(
            "data.path is not set: it is required with model.path (a .jsonl, .parquet or datasets directory)"
        )
    elif not Path(config.data.path).exists():
        problems.append(f"data.path={config.data.path!r}: no such file or directory")
    if config.model.tokenizer and not Path(config.model.tokenizer).is_dir():
        problems.append(f"tokenizer directory '{config.model.tokenizer}' (from model.tokenizer) does not exist")
    student = _read_model_config(config.model.path, "model.path")
    context = max_position_embeddings(student) if student else None
    if isinstance(context, int):
        for name, value in (
            ("rollout.max_new_tokens", config.rollout.max_new_tokens),
            ("eval.max_new_tokens", config.eval.max_new_tokens),
        ):
            if value is not None and value >= context:
                problems.append(
                    f"{name}={value}: the model's context is {context} tokens (max_position_embeddings in "
                    f"{Path(config.model.path) / 'config.json'}), which leaves no room for a prompt"
                )
    if config.rollout.engine == "vllm" and student is not None:
        problems += _vllm_mode_problems(config, student)
    teacher_path = config.algorithm.teacher_path
    if teacher_path is not None:
        teacher = _read_model_config(teacher_path, "algorithm.teacher_path")
        if teacher is None:
            problems.append(
                f"algorithm.teacher_path={teacher_path!r}: no config.json there; expected an HF model directory"
            )
        elif student is not None and teacher.get("vocab_size") != student.get("vocab_size"):
            problems.append(
                f"algorithm.teacher_path={teacher_path!r}: the teacher's vocabulary has {teacher.get('vocab_size')} "
                f"tokens and the student's (model.path={config.model.path!r}) {student.get('vocab_size')}; "
                "distillation compares log-probs of the same token ids, so they must share a vocabulary"
            )
    return problems
