"""The settings of an RLConfig checked together before anything is built: validate() fails with every
problem at once, each naming its field.

A task's own settings (data, eval path, reward, algorithm, lora, optim, max_staleness) are checked
by the same functions for each of `tasks` (fields named tasks[i].algorithm.loss.clip_low,
tasks[i].max_staleness) and for the top-level settings of a run without tasks (algorithm.loss.clip_low,
rollout.max_staleness); RLConfig.task_configs() gives the tasks, _TaskFields where they are.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archon import device as devices
from archon.agents.renderer import renderer_names
from archon.agents.setup import EnvironmentConfig, environment_factory
from archon.checkpoint.hf import check_model_dir, read_json_file
from archon.lora import LoRAConfig
from archon.optim import OptimConfig
from archon.parallel.activation_offload import check_activation_offload
from archon.rl.algorithms import ALGORITHMS, algorithm_problems, distills, importance_sampling_for
from archon.rl.config.demo import demo_environment_problems, reasoning_gym_demo_problems
from archon.rl.config.schema import AlgorithmConfig, RLConfig, RolloutConfig, TaskConfig, both_spellings_error
from archon.rl.data import data_path_problem, data_sources_of
from archon.rl.data.reasoning_gym import reasoning_gym_overlap
from archon.rl.logging.trackers import TRACKERS, unknown_tracker
from archon.rl.reward_fns import reward_function_problem
from archon.rl.rewards import TERM_NAME, RewardConfig, unrouted_message
from archon.rl.rewards.http import MAX_CHOICES, JudgeConfig, RewardServerConfig, judge_choices
from archon.rollout.vllm import merged_needs_collective, resolve_vllm_mode
from archon.rollout.vllm_server import max_position_embeddings

MAX_STALENESS = 64
"""The largest rollout.max_staleness (and tasks[i].max_staleness): one or two steps ahead already
hide the generation time (README, Asynchronous RL), samples many versions old are too far
off-policy for the truncated importance weights to correct, and each unit of the bound keeps one
more step of rollouts and one more adapter copy in memory."""

TASK_NAME = re.compile(r"[A-Za-z0-9_-]+")
TASK_NAME_MAX_CHARS = 100
"""A task's name is part of directory names (its served adapters' are archon-<session>-<name>-v<version>),
and file systems take at most 255 bytes a name."""

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
    world = _world_size() if world_size is None else world_size
    if _last_valid == (config, world):
        return
    problems = _problems(config, world)
    if problems:
        raise ValueError("invalid configuration:\n" + "\n".join(f"  {problem}" for problem in problems))
    _last_valid = (copy.deepcopy(config), world)


def _world_size() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _problems(config: RLConfig, world_size: int) -> list[str]:
    problems = _run_problems(config)
    for task, fields in _tasks_and_fields(config):
        problems += _task_problems(task, fields, config)
    if config.tasks:
        problems += _multi_task_problems(config)
    problems += _parallel_problems(config, world_size)
    problems += _model_problems(config)
    problems += _mtp_problems(config)
    problems += _speculative_problems(config)
    problems += _agent_problems(config, world_size)
    problems += _logging_problems(config)
    return problems


def _agent_problems(config: RLConfig, world_size: int) -> list[str]:
    """An agent function's requests reach the built-in engine whenever the agent makes them, so
    they cannot keep the forwards of several processes (or tasks) in step."""
    if config.rollout.engine != "native":
        return []
    return [
        f"{fields.prefix}environment.agent={task.environment.agent!r}: with rollout.engine=native it needs a run of "
        f"one task on one process (this one has {len(config.task_configs())} task(s) on {world_size}); use "
        "rollout.engine=vllm for more"
        for task, fields in _tasks_and_fields(config)
        if task.environment.agent is not None and (world_size > 1 or len(config.task_configs()) > 1)
    ]


class _Problems(list):
    """Problems found, one line each, `field=value: rule`."""

    def require(self, ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            self.append(f"{name}={value!r}: {rule}")


@dataclass(frozen=True)
class _TaskFields:
    """Where a task's settings are in the config, for the messages: tasks[i]'s own fields, or the
    top-level ones for the single task of a run without tasks."""

    prefix: str
    """Of the task's data, reward, algorithm, lora and optim fields: "tasks[i]." or ""."""
    eval_path: str
    """tasks[i].eval_path or eval.path."""
    max_staleness: str
    """tasks[i].max_staleness or rollout.max_staleness."""


def _tasks_and_fields(config: RLConfig) -> list[tuple[TaskConfig, _TaskFields]]:
    if not config.tasks:
        return [(config.task_configs()[0], _TaskFields("", "eval.path", "rollout.max_staleness"))]
    return [
        (task, _TaskFields(f"tasks[{i}].", f"tasks[{i}].eval_path", f"tasks[{i}].max_staleness"))
        for i, task in enumerate(config.tasks)
    ]


# ---- the run's shared settings ------------------------------------------------------------------


def _run_problems(config: RLConfig) -> list[str]:
    rollout = config.rollout
    problems = _Problems()
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
    problems.require(
        rollout.update_policy != "continue" or any(task.max_staleness > 0 for task in config.task_configs()),
        "rollout.update_policy",
        rollout.update_policy,
        "switches requests in flight to a newly published adapter version, and versions are published while "
        "rollouts are generated only in asynchronous RL: set rollout.max_staleness (or a task's max_staleness) "
        "to 1 or more, or leave rollout.update_policy at 'finish'",
    )
    evaluation, checkpoint = config.eval, config.checkpoint
    problems.require(evaluation.every >= 0, "eval.every", evaluation.every, "must be >= 0 (0 disables evaluation)")
    problems.require(evaluation.max_prompts >= 0, "eval.max_prompts", evaluation.max_prompts, "must be >= 0")
    problems.require(
        evaluation.max_new_tokens is None or evaluation.max_new_tokens >= 1,
        "eval.max_new_tokens",
        evaluation.max_new_tokens,
        "must be at least 1 (None: rollout.max_new_tokens)",
    )
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


def _logging_problems(config: RLConfig) -> list[str]:
    """Trackers named right, the deprecated logging.tensorboard not contradicting logging.backends,
    the sample tables' cadence and size."""
    logging = config.logging
    problems = _Problems()
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


# ---- a task's own settings ----------------------------------------------------------------------


def _task_problems(task: TaskConfig, fields: _TaskFields, config: RLConfig) -> list[str]:
    return [
        *_staleness_problems(task.max_staleness, fields.max_staleness, config),
        *_algorithm_problems(task.algorithm, task.max_staleness, fields, config.rollout),
        *_lora_problems(task.lora, task.algorithm, fields.prefix, config.rollout),
        *_optim_problems(task.optim, fields.prefix, config.steps),
        *_reward_problems(task.reward, fields.prefix, task, evaluates=bool(config.eval.every)),
        *_environment_problems(task.environment, fields.prefix),
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
    problems = _Problems()
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
    if max_staleness > 0:
        problems.require(
            rollout.engine == "vllm",
            "rollout.engine",
            rollout.engine,
            f"{name}={max_staleness} generates while the trainer trains, which needs rollout servers "
            "(engine=vllm); the native engine runs on the training model and is synchronous",
        )
    return problems


def _algorithm_problems(
    algorithm: AlgorithmConfig, max_staleness: int, fields: _TaskFields, rollout: RolloutConfig
) -> list[str]:
    where, loss = f"{fields.prefix}algorithm", algorithm.loss
    spec = ALGORITHMS[algorithm.name]
    problems = _Problems()
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
    if loss.icepop_band is not None:
        low, high = loss.icepop_band
        problems.require(
            0 < low <= 1 <= high,
            f"{where}.loss.icepop_band",
            loss.icepop_band,
            "must be (low, high) with 0 < low <= 1 <= high (the band of pi_old / mu ratios kept)",
        )
    if loss.clip_ratio_c is not None:
        problems.require(
            loss.clip_ratio_c > 1,
            f"{where}.loss.clip_ratio_c",
            loss.clip_ratio_c,
            "must be > 1 (None disables dual clip)",
        )
        problems.require(
            spec.dual_clip,
            f"{where}.loss.clip_ratio_c",
            loss.clip_ratio_c,
            f"dual clip bounds the PPO clipped objective, which {where}.name={algorithm.name!r} does not use",
        )
    problems.require(
        loss.entropy_coef >= 0,
        f"{where}.loss.entropy_coef",
        loss.entropy_coef,
        "must be >= 0 (0 disables the entropy bonus)",
    )
    if loss.kl_cap is not None:
        problems.require(loss.kl_cap > 0, f"{where}.loss.kl_cap", loss.kl_cap, "must be > 0 (None: no cap)")
        problems.require(
            loss.kl_estimator == "k3",
            f"{where}.loss.kl_cap",
            loss.kl_cap,
            f"caps the k3 estimator, but {where}.loss.kl_estimator={loss.kl_estimator!r}",
        )
        problems.require(
            loss.kl_coef > 0,
            f"{where}.loss.kl_cap",
            loss.kl_cap,
            f"has no effect with {where}.loss.kl_coef=0 (no KL penalty)",
        )
    if algorithm.distillation_weight is not None:
        problems.require(
            distills(algorithm),
            f"{where}.distillation_weight",
            algorithm.distillation_weight,
            f"weights a teacher's advantage, but neither {where}.teacher_path nor {where}.teachers is set",
        )
        problems.require(
            algorithm.distillation_weight > 0,
            f"{where}.distillation_weight",
            algorithm.distillation_weight,
            "must be > 0 (None: the teacher's advantage alone)",
        )
    sources = [teacher.data_source for teacher in algorithm.teachers]
    for i, teacher in enumerate(algorithm.teachers):
        problems.require(
            bool(teacher.data_source),
            f"{where}.teachers[{i}].data_source",
            teacher.data_source,
            f"must name a data source (the rows' data_source); the teacher of rows without one is {where}.teacher_path",
        )
        problems.require(
            sources.index(teacher.data_source) == i,
            f"{where}.teachers[{i}].data_source",
            teacher.data_source,
            f"already has a teacher ({where}.teachers[{sources.index(teacher.data_source)}]); one teacher a source",
        )
        problems.require(bool(teacher.path), f"{where}.teachers[{i}].path", teacher.path, "must be a model directory")
    problems.require(
        algorithm.max_skipped_steps >= 1,
        f"{where}.max_skipped_steps",
        algorithm.max_skipped_steps,
        "must be at least 1",
    )
    return problems


def _lora_problems(
    lora: LoRAConfig | None, algorithm: AlgorithmConfig, prefix: str, rollout: RolloutConfig
) -> list[str]:
    problems = _Problems()
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


def _optim_problems(optim: OptimConfig, prefix: str, steps: int) -> list[str]:
    """AdamW's settings, which torch checks only in part and only once the trainer is built; a NaN or
    infinite value would turn every adapter weight into NaN at the first update."""
    where = f"{prefix}optim"
    problems = _Problems()
    try:
        optim.for_run(steps)
    except ValueError as e:
        problems.append(f"{where}.warmup_steps={optim.warmup_steps}: {e}")
    problems.require(math.isfinite(optim.lr) and optim.lr >= 0, f"{where}.lr", optim.lr, "must be a finite number >= 0")
    for i, beta in enumerate(optim.betas):
        problems.require(0 <= beta < 1, f"{where}.betas[{i}]", beta, "must be in [0, 1)")
    problems.require(
        math.isfinite(optim.eps) and optim.eps > 0, f"{where}.eps", optim.eps, "must be a finite number > 0"
    )
    problems.require(
        math.isfinite(optim.weight_decay) and optim.weight_decay >= 0,
        f"{where}.weight_decay",
        optim.weight_decay,
        "must be a finite number >= 0",
    )
    problems.require(
        optim.max_grad_norm is None or (math.isfinite(optim.max_grad_norm) and optim.max_grad_norm >= 0),
        f"{where}.max_grad_norm",
        optim.max_grad_norm,
        "must be a finite number >= 0 (None or 0 only measures the norm)",
    )
    return problems


def _reward_problems(
    reward: RewardConfig, prefix: str, task: TaskConfig | None = None, evaluates: bool = False
) -> list[str]:
    """The reward's function or terms, its routing by data_source and, when routing leaves some
    sources without terms, the sources of the task's data and (`evaluates`) held-out data, read
    now, before a model is loaded."""
    where = f"{prefix}reward"
    if not reward.terms:
        problems = _Problems()
        if (problem := reward_function_problem(reward.function)) is not None:
            problems.append(f"{where}.function={reward.function!r}: {problem}")
    else:
        problems = _reward_term_problems(reward, where)
        problems.require(
            reward.function == RewardConfig.function,
            f"{where}.function",
            reward.function,
            "is not used when reward.terms is set (make it one of the terms)",
        )
    names = {term.name for term in reward.term_configs()}
    for source, terms in reward.sources.items():
        for name in terms:
            problems.require(
                name in names,
                f"{where}.sources[{source!r}]",
                list(terms),
                f"names no term {name!r} (the terms: {sorted(names)})",
            )
    for name in reward.default_terms or ():
        problems.require(
            name in names,
            f"{where}.default_terms",
            list(reward.default_terms),
            f"names no term {name!r} (the terms: {sorted(names)})",
        )
    problems.require(
        reward.default_terms is None or reward.sources,
        f"{where}.default_terms",
        None if reward.default_terms is None else list(reward.default_terms),
        "only applies with reward.sources (without it every term scores every sample)",
    )
    if task is not None and reward.sources and reward.default_terms is None and not problems:
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


def _reward_term_problems(reward: RewardConfig, where: str) -> _Problems:
    problems = _Problems()
    seen = set()
    for i, term in enumerate(reward.terms):
        at = f"{where}.terms[{i}]"
        problems.require(
            bool(TERM_NAME.fullmatch(term.name)),
            f"{at}.name",
            term.name,
            "must be letters, digits, _ . or - (it names the term's metrics)",
        )
        problems.require(term.name not in seen, f"{at}.name", term.name, "is the name of an earlier term")
        seen.add(term.name)
        problems.require(math.isfinite(term.weight), f"{at}.weight", term.weight, "must be a finite number")
        if term.kind in ("function", "group"):
            if (problem := reward_function_problem(term.function)) is not None:
                problems.append(f"{at}.function={term.function!r}: {problem}")
        elif term.kind == "server":
            problems += _http_problems(term.server, f"{at}.server", term.server.url, "url")
        else:
            problems += _judge_problems(term.judge, f"{at}.judge")
    return problems


def _http_problems(config: RewardServerConfig | JudgeConfig, at: str, url: str, url_name: str) -> list[str]:
    problems = _Problems()
    problems.require(
        urllib.parse.urlsplit(url).scheme in ("http", "https") and bool(urllib.parse.urlsplit(url).netloc),
        f"{at}.{url_name}",
        url,
        "must be an http:// or https:// URL",
    )
    problems.require(config.timeout_s > 0, f"{at}.timeout_s", config.timeout_s, "must be positive")
    problems.require(config.retries >= 0, f"{at}.retries", config.retries, "must be 0 or more")
    problems.require(config.backoff_s >= 0, f"{at}.backoff_s", config.backoff_s, "must be 0 or more")
    problems.require(config.concurrency >= 1, f"{at}.concurrency", config.concurrency, "must be 1 or more")
    problems.require(
        not config.api_key_env or bool(os.environ.get(config.api_key_env)),
        f"{at}.api_key_env",
        config.api_key_env,
        "names an environment variable that is not set",
    )
    if isinstance(config, RewardServerConfig):
        problems.require(config.batch_size >= 1, f"{at}.batch_size", config.batch_size, "must be 1 or more")
    return problems


def _judge_problems(judge: JudgeConfig, at: str) -> list[str]:
    problems = _Problems(_http_problems(judge, at, judge.base_url, "base_url"))
    problems.require(bool(judge.model), f"{at}.model", judge.model, "must name the model the endpoint serves")
    problems.require(judge.max_tokens >= 1, f"{at}.max_tokens", judge.max_tokens, "must be 1 or more")
    if not judge.prompt:
        problems.append(f"{at}.prompt is not set: the rubric, with {{prompt}}, {{completion}} and {{reference}}")
    else:
        try:
            judge.prompt.format(prompt="", completion="", reference="")
        except (KeyError, IndexError, ValueError) as e:
            problems.append(
                f"{at}.prompt: {type(e).__name__}: {e} (the template may use {{prompt}}, {{completion}} "
                "and {reference}; write a literal brace twice)"
            )
    low, high = judge.score_range
    problems.require(
        math.isfinite(low) and math.isfinite(high) and low < high,
        f"{at}.score_range",
        list(judge.score_range),
        "must be two finite numbers, the lowest first",
    )
    if judge.score_regex:
        try:
            re.compile(judge.score_regex)
        except re.error as e:
            problems.append(f"{at}.score_regex={judge.score_regex!r}: not a regular expression: {e}")
    if judge.structured_output == "choice":
        problems.require(
            0 < len(judge_choices(judge)) <= MAX_CHOICES,
            f"{at}.score_range",
            list(judge.score_range),
            f"with structured_output=choice must hold 1 to {MAX_CHOICES} integers (the choices)",
        )
    return problems


def _environment_problems(environment: EnvironmentConfig, prefix: str) -> list[str]:
    """A multi-turn task's environment, tools, chat format and limits."""
    if not environment.enabled:
        return []
    where = f"{prefix}environment"
    problems = _Problems()
    if environment.agent is not None:
        if environment.name or environment.tools:
            problems.append(
                f"{where}.agent={environment.agent!r}: an agent function runs its own episodes; leave "
                f"{where}.name and {where}.tools unset"
            )
        elif ":" not in environment.agent:
            problems.append(f'{where}.agent={environment.agent!r}: must be "module:function"')
        elif (problem := reward_function_problem(environment.agent)) is not None:
            problems.append(f"{where}.agent={environment.agent!r}: {problem}")
        problems.require(
            environment.agent_timeout_s > 0, f"{where}.agent_timeout_s", environment.agent_timeout_s, "must be > 0"
        )
    else:
        try:
            environment_factory(environment, "prompt")
        except Exception as exc:  # noqa: BLE001 - an environment or tool that cannot be set up is reported, not raised
            problems.append(f"{where}.name={environment.name!r}, tools={list(environment.tools)!r}: {exc}")
    if environment.renderer is not None and environment.renderer not in renderer_names():
        problems.append(f"{where}.renderer={environment.renderer!r}: unknown; registered renderers: {renderer_names()}")
    limits = environment.limits
    for name in ("max_turns", "max_tokens", "max_turn_tokens"):
        problems.require(
            getattr(limits, name) >= 1, f"{where}.limits.{name}", getattr(limits, name), "must be at least 1"
        )
    problems.require(
        limits.max_tool_calls >= 0, f"{where}.limits.max_tool_calls", limits.max_tool_calls, "must be >= 0"
    )
    for name in ("step_timeout_s", "tool_timeout_s"):
        value = getattr(limits, name) if name == "step_timeout_s" else environment.tool_timeout_s
        field_name = f"{where}.limits.{name}" if name == "step_timeout_s" else f"{where}.{name}"
        problems.require(value > 0, field_name, value, "must be > 0")
    for name in ("tool_max_output_chars", "tool_memory_mb", "tool_workers"):
        problems.require(
            getattr(environment, name) >= 1, f"{where}.{name}", getattr(environment, name), "must be at least 1"
        )
    return problems


def _file_problems(task: TaskConfig, fields: _TaskFields, model_path: str, student: dict | None) -> list[str]:
    """A task's files, with a model to train (model.path): its training and held-out prompts, and the
    config.json of its teacher."""
    problems = []
    data_path = f"{fields.prefix}data.path"
    if not task.data.path:
        problems.append(
            f"{data_path} is not set: it is required with model.path (a .jsonl, .parquet or datasets directory)"
        )
    elif (problem := data_path_problem(task.data.path)) is not None:
        problems.append(f"{data_path}={task.data.path!r}: {problem}")
    if task.eval_path and (problem := data_path_problem(task.eval_path)) is not None:
        problems.append(f"{fields.eval_path}={task.eval_path!r}: {problem}")
    elif task.eval_path and (overlap := reasoning_gym_overlap(task.data.path, task.eval_path)) is not None:
        problems.append(f"{fields.eval_path}={task.eval_path!r}: {overlap}")
    teachers = [(task.algorithm.teacher_path, f"{fields.prefix}algorithm.teacher_path")]
    teachers += [
        (t.path, f"{fields.prefix}algorithm.teachers[{i}].path") for i, t in enumerate(task.algorithm.teachers)
    ]
    for teacher_path, where in teachers:
        if not teacher_path:
            continue
        teacher = _read_model_config(teacher_path, where)
        if teacher is None:
            problems.append(f"{where}={teacher_path!r}: no config.json there; expected an HF model directory")
        elif student is not None and teacher.get("vocab_size") != student.get("vocab_size"):
            problems.append(
                f"{where}={teacher_path!r}: the teacher's vocabulary has {teacher.get('vocab_size')} tokens and the "
                f"student's (model.path={model_path!r}) {student.get('vocab_size')}; distillation compares "
                "log-probs of the same token ids, so they must share a vocabulary"
            )
    return problems


# ---- several tasks ------------------------------------------------------------------------------


def _multi_task_problems(config: RLConfig) -> list[str]:
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


# ---- the processes and the model files ----------------------------------------------------------


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


# The config fields that count a checkpoint's MTP layers (DeepSeek-V3 and Qwen3-Next; Qwen3.5).
_MTP_CONFIG_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def _mtp_problems(config: RLConfig) -> list[str]:
    """model.mtp and algorithm.mtp_loss_weight against each other, the tasks, context parallelism and
    the checkpoint's config."""
    problems = _Problems()
    trained = []
    for task, fields in _tasks_and_fields(config):
        weight = task.algorithm.mtp_loss_weight
        name = f"{fields.prefix}algorithm.mtp_loss_weight"
        problems.require(math.isfinite(weight) and weight >= 0, name, weight, "must be a finite number >= 0")
        if weight > 0:
            trained.append(f"{name}={weight!r}")
            problems.require(
                not config.tasks, name, weight, "training the MTP layer is not supported with several tasks"
            )
            problems.require(
                config.model.mtp != "skip", name, weight, "trains the MTP layer, which model.mtp='skip' leaves unloaded"
            )
            problems.require(
                config.parallel.cp == 1,
                name,
                weight,
                f"is not supported with context parallelism (parallel.cp="
                f"{config.parallel.cp}): the MTP layer reads the token after each position; set parallel.cp to 1",
            )
    if config.model.path is None:
        problems.require(config.model.mtp != "load", "model.mtp", config.model.mtp, "the demo model has no MTP layers")
        problems += [f"{name}: the demo model has no MTP layers to train; set model.path" for name in trained]
        return problems
    if config.model.mtp == "skip" or not (config.model.mtp == "load" or trained):
        return problems
    student = _read_model_config(config.model.path, "model.path")
    if student is None:
        return problems
    text = student.get("text_config") or student
    if not any(isinstance(text.get(f), int) and text.get(f) > 0 for f in _MTP_CONFIG_FIELDS):
        asked = "model.mtp='load'" if config.model.mtp == "load" else trained[0]
        problems.append(
            f"{asked}: {Path(config.model.path) / 'config.json'} declares no multi-token-prediction layers "
            f"({' or '.join(_MTP_CONFIG_FIELDS)}), so the checkpoint has none to load"
        )
    return problems


def _speculative_problems(config: RLConfig) -> list[str]:
    """rollout.speculative against the engine, routing replay, the MTP layers and the draft model."""
    problems = _Problems()
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
        problems.extend(_speculative_mtp_problems(config))
    problems.require(
        (speculative.method == "draft_model") == (speculative.draft_model_path is not None),
        "rollout.speculative.draft_model_path",
        speculative.draft_model_path,
        f"is needed with rollout.speculative.method=draft_model and only then (method={speculative.method!r})",
    )
    return problems


def _speculative_mtp_problems(config: RLConfig) -> list[str]:
    """rollout.speculative.method=mtp drafts with the model's MTP layer: one must be loaded."""
    name, value = "rollout.speculative.method", "mtp"
    if config.model.mtp == "skip":
        return [f"{name}={value!r}: drafts with the MTP layer, which model.mtp='skip' leaves unloaded"]
    if config.model.path is None:
        return [f"{name}={value!r}: the demo model has no MTP layer to draft with; set model.path"]
    student = _read_model_config(config.model.path, "model.path")
    if student is None:
        return []
    text = student.get("text_config") or student
    if any(isinstance(text.get(f), int) and text.get(f) > 0 for f in _MTP_CONFIG_FIELDS):
        return []
    return [
        f"{name}={value!r}: {Path(config.model.path) / 'config.json'} declares no multi-token-prediction layers "
        f"({' or '.join(_MTP_CONFIG_FIELDS)}) to draft with; use method=draft_model"
    ]


def _read_model_config(directory: str, field_name: str) -> dict | None:
    """The config.json of an HF checkpoint directory, or None when there is none (the model loader
    reports a missing checkpoint); an unreadable file is an error naming it."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_json_file(path, "model config")
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None


def _vllm_mode_problems(config: RLConfig, model_config: dict) -> list[str]:
    """The servers' mode (rollout.vllm.mode, or the family's) against the transport and the
    staleness bound, before any server is launched."""
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


def _model_problems(config: RLConfig) -> list[str]:
    if config.model.path is None:  # the demo builds its model later
        if config.demo.kind == "code_tool":
            return [
                problem for task in config.task_configs() for problem in demo_environment_problems(task.environment)
            ]
        if config.demo.kind == "reasoning_gym":
            return reasoning_gym_demo_problems(config.demo.reasoning_gym, config.data, config.eval.path, config.tasks)
        return []
    problems = []
    try:
        check_model_dir(config.model.path, "model.path")
    except (OSError, ValueError) as e:
        problems.append(str(e))
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
    for task, fields in _tasks_and_fields(config):
        problems += _file_problems(task, fields, config.model.path, student)
    return problems
