"""The rules of the sections archon.rl takes from the layers below it, which those layers cannot
check themselves: the optimizer (archon.optim's OptimConfig: the run's step count) and the
multi-turn environment (archon.agents' EnvironmentConfig: the renderers, the agent function)."""

from __future__ import annotations

import math

from archon.agents.renderer import renderer_names
from archon.agents.setup import EnvironmentConfig, environment_factory
from archon.optim import OptimConfig
from archon.rl.problems import Problems
from archon.rl.reward_fns import reward_function_problem


def optim_problems(optim: OptimConfig, prefix: str, steps: int) -> list[str]:
    """AdamW's settings, which torch checks only in part and only once the trainer is built; a NaN or
    infinite value would turn every adapter weight into NaN at the first update."""
    where = f"{prefix}optim"
    problems = Problems()
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


def environment_problems(environment: EnvironmentConfig, prefix: str) -> list[str]:
    """A multi-turn task's environment, tools, chat format and limits."""
    if not environment.enabled:
        return []
    where = f"{prefix}environment"
    problems = Problems()
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
