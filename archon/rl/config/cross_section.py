"""The rules across sections: a task's settings against each other and against the run's rollout
settings, the tasks of a multi-task run together, speculative decoding and agent functions against
the engine. A section's rules on its own sit beside its dataclass (schema, archon.rl.algorithms.config,
archon.rl.rewards.config, demo; lower_sections for the sections of the layers below); the rules that
read files are model_files'.

A task's own settings (data, eval path, reward, algorithm, lora, optim, max_staleness) are checked
by the same functions for each of `tasks` (fields named tasks[i].algorithm.loss.clip_low,
tasks[i].max_staleness) and for the top-level settings of a run without tasks (algorithm.loss.clip_low,
rollout.max_staleness); RLConfig.task_configs() gives the tasks, TaskFields where they are.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from archon.lora import LoRAConfig
from archon.rl.algorithms import (
    AlgorithmConfig,
    algorithm_problems,
    algorithm_section_problems,
    importance_sampling_for,
)
from archon.rl.config.lower_sections import environment_problems, optim_problems
from archon.rl.config.model_files import speculative_mtp_problems
from archon.rl.config.schema import RLConfig, RolloutConfig, TaskConfig, TaskFields, tasks_and_fields
from archon.rl.data import data_sources_of
from archon.rl.problems import Problems
from archon.rl.rewards import RewardConfig, unrouted_message
from archon.rl.rewards.config import reward_problems

MAX_STALENESS = 64
"""The largest rollout.max_staleness (and tasks[i].max_staleness): one or two steps ahead already
hide the generation time (README, Asynchronous RL), samples many versions old are too far
off-policy for the truncated importance weights to correct, and each unit of the bound keeps one
more step of rollouts and one more adapter copy in memory."""

TASK_NAME = re.compile(r"[A-Za-z0-9_-]+")
TASK_NAME_MAX_CHARS = 100
"""A task's name is part of directory names (its served adapters' are archon-<session>-<name>-v<version>),
and file systems take at most 255 bytes a name."""


def agent_problems(config: RLConfig, world_size: int) -> list[str]:
    """An agent function's requests reach the built-in engine whenever the agent makes them, so
    they cannot keep the forwards of several processes (or tasks) in step."""
    if config.rollout.engine != "native":
        return []
    return [
        f"{fields.prefix}environment.agent={task.environment.agent!r}: with rollout.engine=native it needs a run of "
        f"one task on one process (this one has {len(config.task_configs())} task(s) on {world_size}); use "
        "rollout.engine=vllm for more"
        for task, fields in tasks_and_fields(config)
        if task.environment.agent is not None and (world_size > 1 or len(config.task_configs()) > 1)
    ]


# ---- a task's settings -----------------------------------------------------------------------------


def task_problems(task: TaskConfig, fields: TaskFields, config: RLConfig) -> list[str]:
    return [
        *_staleness_problems(task.max_staleness, fields.max_staleness, config),
        *_algorithm_problems(task.algorithm, task.max_staleness, fields, config.rollout),
        *_lora_problems(task.lora, task.algorithm, fields.prefix, config.rollout),
        *optim_problems(task.optim, fields.prefix, config.steps),
        *_reward_problems(task.reward, fields.prefix, task, evaluates=bool(config.eval.every)),
        *environment_problems(task.environment, fields.prefix),
        *_routing_replay_problems(task, fields.prefix),
    ]


def _routing_replay_problems(task: TaskConfig, prefix: str) -> list[str]:
    """Routing replay takes each token's experts from the sample that generated it: a multi-turn
    trajectory is put together from several generations and the environment's tokens."""
    if task.algorithm.routing_replay == "rollout" and task.environment.enabled:
        return [
            f"{prefix}algorithm.routing_replay='rollout': not available with {prefix}environment (multi-turn "
            "trajectories carry no recorded routing); use 'off'"
        ]
    return []


def _staleness_problems(max_staleness: int, name: str, config: RLConfig) -> list[str]:
    """A staleness bound (`name`: rollout.max_staleness or tasks[i].max_staleness)."""
    rollout = config.rollout
    problems = Problems()
    problems.require(max_staleness >= 0, name, max_staleness, "must be 0 or more")
    if max_staleness > MAX_STALENESS:
        problems.append(
            f"{name}={max_staleness}: must be at most {MAX_STALENESS}: the producer runs up to N steps ahead, so "
            f"each unit of N holds one more RL step of rollouts ({rollout.prompts_per_step} prompts x "
            f"{rollout.group_size} samples) in memory, and the trainer keeps the adapters of the last N+1 versions "
            "on every rank to score lagging samples again (rollout.measure_version_gap)"
        )
    elif max_staleness >= config.steps >= 1:
        problems.append(
            f"{name}={max_staleness}: must be below steps={config.steps}: the producer runs at most steps-1 steps "
            "ahead, so a larger bound has no effect"
        )
    return problems


def async_native_problems(config: RLConfig, world_size: int) -> list[str]:
    """Asynchronous rollouts on the built-in engine generate on copies of the one training model's
    adapter, on threads beside the trainer's: one process, one adapter."""
    if config.rollout.engine != "native" or (world_size == 1 and not config.tasks):
        return []
    return [
        f"{fields.max_staleness}={task.max_staleness}: with rollout.engine='native' asynchronous rollouts run on one "
        f"process for a run without tasks (this one has {len(config.tasks)} task(s) on {world_size} process(es)); "
        "use rollout.engine=vllm, or max_staleness 0"
        for task, fields in tasks_and_fields(config)
        if task.max_staleness > 0
    ]


def _algorithm_problems(
    algorithm: AlgorithmConfig, max_staleness: int, fields: TaskFields, rollout: RolloutConfig
) -> list[str]:
    """A task's algorithm section against its staleness bound and the rollout settings, then the
    section's own rules."""
    where, loss = f"{fields.prefix}algorithm", algorithm.loss
    problems = Problems()
    if max_staleness > 0:
        problems.require(
            algorithm.recompute_old_logprobs,
            f"{where}.recompute_old_logprobs",
            algorithm.recompute_old_logprobs,
            f"{fields.max_staleness}={max_staleness} trains on samples of older adapter versions; the trainer's "
            "log-probs before the update are the proximal policy of the decoupled objective",
        )
    for problem in algorithm_problems(algorithm, rollout.group_size, where):
        problems.append(problem)
    problems.require(
        algorithm.recompute_old_logprobs or (rollout.top_p == 1 and rollout.top_k == 0),
        f"{where}.recompute_old_logprobs",
        algorithm.recompute_old_logprobs,
        f"must be true with rollout.top_p={rollout.top_p} / rollout.top_k={rollout.top_k}: the rollout log-probs are "
        "those of the truncated, renormalised distribution that sampled, the trainer's those of the untruncated "
        "policy, so taken as pi_old they would start every PPO ratio below 1",
    )
    problems.require(
        algorithm.routing_replay != "rollout" or rollout.engine == "native",
        f"{where}.routing_replay",
        algorithm.routing_replay,
        f"needs rollout.engine=native (rollout.engine={rollout.engine!r}): only the built-in "
        "engine records the experts it routes each token to",
    )
    problems.require(algorithm.minibatches >= 1, f"{where}.minibatches", algorithm.minibatches, "must be at least 1")
    problems.require(algorithm.ppo_epochs >= 1, f"{where}.ppo_epochs", algorithm.ppo_epochs, "must be at least 1")
    problems.require(
        0 <= algorithm.overlong_buffer <= rollout.max_new_tokens,
        f"{where}.overlong_buffer",
        algorithm.overlong_buffer,
        f"must be between 0 and rollout.max_new_tokens={rollout.max_new_tokens}",
    )
    problems.require(
        loss.kl_coef >= 0, f"{where}.loss.kl_coef", loss.kl_coef, "must be >= 0 (0 disables the KL penalty)"
    )
    problems.require(loss.importance_cap > 0, f"{where}.loss.importance_cap", loss.importance_cap, "must be > 0")
    for name, value, enabled in (
        ("importance_sampling", loss.importance_sampling, importance_sampling_for(loss, max_staleness) != "none"),
        ("icepop_band", loss.icepop_band, loss.icepop_band is not None),
    ):
        problems.require(
            not enabled or algorithm.recompute_old_logprobs,
            f"{where}.loss.{name}",
            value,
            f"needs {where}.recompute_old_logprobs=true: the correction compares the trainer's log-probs "
            "(pi_old) with the rollout's, which are the same numbers without the recompute",
        )
    problems += algorithm_section_problems(algorithm, where)
    return problems


def _lora_problems(
    lora: LoRAConfig | None, algorithm: AlgorithmConfig, prefix: str, rollout: RolloutConfig
) -> list[str]:
    problems = Problems()
    if lora is not None:
        problems.require(lora.alpha > 0, f"{prefix}lora.alpha", lora.alpha, "must be > 0")
        for key, alpha in lora.alpha_pattern.items():
            problems.require(alpha > 0, f"{prefix}lora.alpha_pattern[{key!r}]", alpha, "must be > 0")
        return problems
    needs = ["the PEFT adapter written at each checkpoint and at the end"]
    if algorithm.loss.kl_coef > 0:
        needs.append(
            f"{prefix}algorithm.loss.kl_coef={algorithm.loss.kl_coef} (the reference policy is the model with its "
            "adapter off)"
        )
    if rollout.engine == "vllm" and rollout.vllm.mode == "adapter":
        needs.append("rollout.vllm.mode='adapter' (vLLM applies the trained adapter)")
    problems.append(
        f"{prefix}lora=None (every weight trained, no adapter), but the run needs an adapter for: {'; '.join(needs)}"
    )
    return problems


def _reward_problems(reward: RewardConfig, prefix: str, task: TaskConfig, evaluates: bool) -> list[str]:
    """The reward section's own problems and, when its routing leaves some sources without terms,
    the sources of the task's data and (`evaluates`) held-out data, read now, before a model is
    loaded."""
    where = f"{prefix}reward"
    problems = reward_problems(reward, where)
    if reward.sources and reward.default_terms is None and not problems:
        for path, label in ((task.data.path, "data.path"), (task.eval_path if evaluates else "", "eval path")):
            if not path or not Path(path).exists():
                continue
            try:
                found = data_sources_of(dataclasses.replace(task.data, path=path))
            except (OSError, ValueError):  # the loading reports what is wrong with the file
                continue
            if unrouted := reward.unrouted_sources(found):
                problems.append(f"{label} {path!r}: {unrouted_message(unrouted, where)}")
    return problems


# ---- several tasks ------------------------------------------------------------------------------


def multi_task_problems(config: RLConfig) -> list[str]:
    """What a run with tasks needs of them together, and of the top-level settings they replace."""
    problems: list[str] = []
    names = [task.name for task in config.tasks]
    first = config.tasks[0].algorithm
    for i, task in enumerate(config.tasks):
        where = f"tasks[{i}]"
        if not TASK_NAME.fullmatch(task.name):
            problems.append(f"{where}.name={task.name!r}: must be letters, digits, '_' or '-' (it names a directory)")
        elif len(task.name) > TASK_NAME_MAX_CHARS:
            problems.append(
                f"{where}.name={task.name!r}: {len(task.name)} characters, at most {TASK_NAME_MAX_CHARS} "
                "(it names a directory)"
            )
        elif names.count(task.name) > 1:
            problems.append(f"{where}.name={task.name!r}: task names must be unique")
        if task.algorithm.ppo_epochs != first.ppo_epochs:
            problems.append(
                f"{where}.algorithm.ppo_epochs={task.algorithm.ppo_epochs}: every task must have "
                f"tasks[0]'s ({first.ppo_epochs}); a minibatch trains every task"
            )
        if task.algorithm.routing_replay != first.routing_replay:
            problems.append(
                f"{where}.algorithm.routing_replay={task.algorithm.routing_replay!r}: every task must have "
                f"tasks[0]'s ({first.routing_replay!r}); the tasks share one model"
            )
        if task.algorithm.minibatches != first.minibatches:
            problems.append(
                f"{where}.algorithm.minibatches={task.algorithm.minibatches}: every task must have "
                f"tasks[0]'s ({first.minibatches}); a minibatch trains every task"
            )
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


# ---- speculative decoding -------------------------------------------------------------------------


def speculative_problems(config: RLConfig) -> list[str]:
    """rollout.speculative against the engine, routing replay, the MTP layers and the draft model."""
    problems = Problems()
    rollout = config.rollout
    speculative = rollout.speculative
    if speculative.method != "off":
        problems.require(
            rollout.engine == "native",
            "rollout.speculative.method",
            speculative.method,
            f"needs rollout.engine=native (rollout.engine={rollout.engine!r}): speculative decoding is built into "
            "the native engine; set it to 'off' with vLLM",
        )
        problems.require(
            speculative.num_tokens >= 1,
            "rollout.speculative.num_tokens",
            speculative.num_tokens,
            "must be at least 1 (draft tokens per decode round)",
        )
        problems.require(
            config.algorithm.routing_replay == "off",
            "rollout.speculative.method",
            speculative.method,
            "cannot be combined with algorithm.routing_replay=rollout (the engine does not record routing under "
            "speculative decoding); set one of them off",
        )
    if speculative.method == "mtp":
        problems.extend(speculative_mtp_problems(config))
    problems.require(
        (speculative.method == "draft_model") == (speculative.draft_model_path is not None),
        "rollout.speculative.draft_model_path",
        speculative.draft_model_path,
        f"is needed with rollout.speculative.method=draft_model and only then (method={speculative.method!r})",
    )
    problems.require(
        (speculative.method == "draft_head") == (speculative.draft_head_path is not None),
        "rollout.speculative.draft_head_path",
        speculative.draft_head_path,
        f"is needed with rollout.speculative.method=draft_head and only then (method={speculative.method!r})",
    )
    problems.require(
        speculative.max_rows is None or speculative.method != "off",
        "rollout.speculative.max_rows",
        speculative.max_rows,
        "limits speculative decoding, which is off (rollout.speculative.method=off): set a method or leave it unset",
    )
    return problems
