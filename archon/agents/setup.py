"""A task's multi-turn setup from its configuration: the environment, the renderer, the tools."""

from __future__ import annotations

from dataclasses import dataclass, field

from archon.agents.agent_episodes import AgentEpisodes
from archon.agents.environment import Environment, ToolUseEnvironment
from archon.agents.environment_worker import EnvironmentProcess
from archon.agents.episodes import EpisodeLimits, EpisodeRunner
from archon.agents.renderer import default_renderer_name, get_renderer
from archon.agents.sandbox import resolve_tool
from archon.agents.tools import ToolRunner
from archon.workers import import_function

TOOL_USE = "tool_use"
"""The built-in environment's name (ToolUseEnvironment)."""


@dataclass
class EnvironmentConfig:
    """Multi-turn episodes for a task. Unset (`name` empty): one prompt, one completion."""

    name: str = ""
    """"tool_use" (the built-in ToolUseEnvironment: offers `tools`, ends at the first turn without a
    tool call, whose content the task's reward function scores), or "module:Class" of an
    archon.agents.Environment subclass made with no arguments (its `tools` are offered)."""
    tools: tuple[str, ...] = ()
    """The built-in environment's tools: "python" (the code sandbox) or "module:function"."""
    system_prompt: str | None = None
    """The built-in environment's system message."""
    renderer: str | None = None
    """The chat format (archon.agents.renderer); default: the model family's."""
    enable_thinking: bool | None = None
    """The renderer's thinking switch, for the formats that have one (false: the generation prompt
    closes an empty reasoning block); None: the format's default."""
    agent: str | None = None
    """"module:function" of an agent written against an OpenAI client, `agent(base_url, row) ->
    reward`, in place of an environment: its episodes run on an OpenAI-compatible endpoint served
    from the rollout engine (archon.agents.openai_server), which records the tokens they train on.
    With the built-in engine, a run of one task on one process."""
    agent_timeout_s: float = 600.0
    """Seconds an agent's episode may take."""
    limits: EpisodeLimits = field(default_factory=EpisodeLimits)
    tool_timeout_s: float = 10.0
    tool_max_output_chars: int = 2048
    tool_memory_mb: int = 1024
    tool_workers: int = 2

    @property
    def enabled(self) -> bool:
        return bool(self.name) or self.agent is not None


def environment_factory(config: EnvironmentConfig, prompt_field: str):
    """(make_env, tools) for the configured environment: the built-in one runs in this process; a
    "module:Class" runs in a worker process per episode (EnvironmentProcess), which a call past
    limits.step_timeout_s kills."""
    if config.name == TOOL_USE:
        tools = [resolve_tool(spec) for spec in config.tools]
        return (lambda: ToolUseEnvironment(tools, config.system_prompt, prompt_field)), tools
    if config.tools:
        raise ValueError(f"environment.tools is for the built-in {TOOL_USE!r} environment; {config.name} sets its own")
    if ":" not in config.name:
        raise ValueError(f'environment.name {config.name!r} is neither {TOOL_USE!r} nor "module:Class"')
    module_name, _, attr = config.name.partition(":")
    cls = import_function(module_name, attr, f"environment.name {config.name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"environment.name {config.name!r} is not an archon.agents.environment.Environment subclass")
    timeout_s = config.limits.step_timeout_s
    return (lambda: EnvironmentProcess(config.name, cls, timeout_s)), list(cls.tools)


def renderer_options(config: EnvironmentConfig) -> dict:
    return {} if config.enable_thinking is None else {"enable_thinking": config.enable_thinking}


def build_episode_runner(config: EnvironmentConfig, tokenizer, model_type: str, prompt_field: str):
    """(EpisodeRunner, ToolRunner) of a task, or (AgentEpisodes, None) for an agent function;
    close the ToolRunner when the run ends."""
    renderer = get_renderer(config.renderer or default_renderer_name(model_type), tokenizer, **renderer_options(config))
    if config.agent is not None:
        module_name, _, attr = config.agent.partition(":")
        agent_fn = import_function(module_name, attr, f"environment.agent {config.agent!r}")
        return AgentEpisodes(agent_fn, renderer, config.limits, config.agent_timeout_s), None
    make_env, tools = environment_factory(config, prompt_field)
    tool_runner = ToolRunner(
        tools,
        timeout_s=config.tool_timeout_s,
        max_output_chars=config.tool_max_output_chars,
        memory_mb=config.tool_memory_mb,
        num_workers=config.tool_workers,
    )
    runner = EpisodeRunner(renderer, make_env, tool_runner.call_many, [tool.schema() for tool in tools], config.limits)
    return runner, tool_runner
