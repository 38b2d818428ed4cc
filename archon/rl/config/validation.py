"""The settings of an RLConfig checked together before anything is built: validate() runs every
rule, in one order, and fails with every problem at once, each naming its field.

Each rule has one home: a section's rules on its own beside its dataclass (schema; algorithms,
rewards and demo sections in archon.rl.algorithms.config, archon.rl.rewards.config and
archon.rl.config.demo; the sections of lower layers in lower_sections), the rules across sections
in cross_section, and those that read files (the model directory's config.json, the teachers', the
data) in model_files. The run's shared settings are checked here.
"""

from __future__ import annotations

import copy
import os

from archon import device as devices
from archon.parallel.activation_offload import check_activation_offload
from archon.rl.config.cross_section import (  # noqa: F401 - the limits, at their old path for one release
    MAX_STALENESS,
    TASK_NAME,
    TASK_NAME_MAX_CHARS,
    agent_problems,
    async_native_problems,
    multi_task_problems,
    speculative_problems,
    task_problems,
)
from archon.rl.config.model_files import model_problems, mtp_problems
from archon.rl.config.schema import (
    RLConfig,
    checkpoint_problems,
    eval_problems,
    logging_problems,
    rollout_problems,
    tasks_and_fields,
)
from archon.rl.problems import Problems
from archon.secrets import redact, register_secrets

_last_valid: tuple[RLConfig, int] | None = None
"""A copy of the config that validate() last passed, and the world size it was checked for."""


def validate(config: RLConfig, world_size: int | None = None) -> None:
    """Fail now, naming each field, on settings that would otherwise fail or misbehave only once the
    run is under way.

    world_size: processes in the run; default: the process group's size, else torchrun's
    WORLD_SIZE, else 1. Reads the config.json of model.path and of each teacher (no weights).

    A config equal to the one last passed, for the same world size, is not checked again: parse_config
    validates, and RLRun's validate() of the parsed config returns at once. A config changed since,
    or built in Python, is checked in full.
    """
    global _last_valid
    register_secrets(config)  # from here on, nothing the process writes shows them (archon.secrets)
    world = _world_size() if world_size is None else world_size
    if _last_valid == (config, world):
        return
    problems = _problems(config, world)
    if problems:
        raise ValueError(redact("invalid configuration:\n" + "\n".join(f"  {problem}" for problem in problems)))
    _last_valid = (copy.deepcopy(config), world)


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _problems(config: RLConfig, world_size: int) -> list[str]:
    problems = _run_problems(config)
    for task, fields in tasks_and_fields(config):
        problems += task_problems(task, fields, config)
    if config.tasks:
        problems += multi_task_problems(config)
    problems += _parallel_problems(config, world_size)
    problems += model_problems(config)
    problems += mtp_problems(config)
    problems += speculative_problems(config)
    problems += agent_problems(config, world_size)
    problems += async_native_problems(config, world_size)
    problems += logging_problems(config.logging)
    return problems


def _run_problems(config: RLConfig) -> list[str]:
    """The run's shared settings: its own, the rollout, evaluation and checkpoint sections', and those
    that tie them to the model and the tasks."""
    rollout = config.rollout
    problems = Problems()
    problems.require(config.steps >= 1, "steps", config.steps, "must be at least 1")
    problems.require(
        config.model.moe.bias_update_rate == 0 or rollout.engine != "vllm",
        "model.moe.bias_update_rate",
        config.model.moe.bias_update_rate,
        "must be 0 with rollout.engine=vllm: the weight sync does not send the "
        "routers' correction biases, so vLLM would route with the ones it loaded",
    )
    problems.require(
        config.micro_batch_tokens >= 1, "micro_batch_tokens", config.micro_batch_tokens, "must be at least 1"
    )
    problems += rollout_problems(rollout)
    problems.require(
        rollout.update_policy != "continue" or any(task.max_staleness > 0 for task in config.task_configs()),
        "rollout.update_policy",
        rollout.update_policy,
        "switches requests in flight to a newly published adapter version, and versions are published while "
        "rollouts are generated only in asynchronous RL: set rollout.max_staleness (or a task's max_staleness) "
        "to 1 or more, or leave rollout.update_policy at 'finish'",
    )
    problems += eval_problems(config.eval)
    problems += checkpoint_problems(config.checkpoint)
    return problems


def _parallel_problems(config: RLConfig, world_size: int) -> list[str]:
    try:
        dims = config.parallel.dims(world_size, "cpu")
    except (ValueError, NotImplementedError) as e:
        return [f"parallel: {e}"]
    problems = []
    if config.rollout.prompts_per_step < dims.dp:
        problems.append(
            f"rollout.prompts_per_step={config.rollout.prompts_per_step}: smaller than the data-parallel size "
            f"{dims.dp} (world size {world_size}, parallel.cp={dims.cp}, parallel.tp={dims.tp}); every data-parallel "
            "rank needs at "
            "least one prompt per step"
        )
    if config.parallel.activation_offload:
        try:
            check_activation_offload(devices.device_type(config.model.device), config.parallel.compile)
        except ValueError as e:
            problems.append(str(e))
        except RuntimeError:
            pass  # a device that is not there fails the run when it starts, naming model.device
    return problems
