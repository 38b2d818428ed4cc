"""The demo section of the config (`demo`): the built-in demos' settings, and the rules that keep a
run's other settings those its warm start was made for. What the demos do with them (the warm
start, the code-tool demo's tokenizer and conversations) is archon.demos."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from archon.rl.data import reasoning_gym
from archon.rl.data.tasks import ArithmeticTaskConfig

RENDERER = "qwen3"
TOOL = "python"
"""The demo's rendering: the Qwen3 chat format without reasoning, the python tool, no system message.
A run of the demo must use the same (demo_environment_problems)."""
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)


@dataclass
class CodeToolDemoConfig:
    """The code-tool demo's problems and the make-up of its warm start."""

    task: ArithmeticTaskConfig = field(
        default_factory=lambda: ArithmeticTaskConfig(
            operations=("*",),
            min_digits=3,
            max_digits=3,
            num_train=3000,
            num_held_out=200,
            prompt_format="What is {a} * {b}?",
        )
    )
    """The problems: their prompt_format must hold no digit but the operands'."""
    tool_fraction: float = 0.3
    """Of the warm start's conversations that offer the tool, the fraction that call it; the others
    write the product directly."""
    no_tool_fraction: float = 0.2
    """Of the warm start's conversations, the fraction that offer no tool (the product written directly)."""
    vocab_size: int = 640
    """The BPE tokenizer's vocabulary: 256 bytes, the special tokens, then merges."""

    def __post_init__(self) -> None:
        for name in ("tool_fraction", "no_tool_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"demo.code_tool.{name} must be in [0, 1], got {getattr(self, name)}")
        if re.search(r"\d", self.task.prompt_format.replace("{a}", "").replace("{b}", "")):
            raise ValueError(
                f"demo.code_tool.task.prompt_format {self.task.prompt_format!r} holds a digit besides the operands "
                "{a} and {b}; the tool call's code is read from the prompt's two numbers"
            )
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"demo.code_tool.vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (the bytes and the special "
                f"tokens), got {self.vocab_size}"
            )


def demo_environment_problems(environment) -> list[str]:
    """What keeps a run's environment section from being the one the demo's warm start was made for."""
    problems = []
    if environment.name != "tool_use":
        problems.append(f"environment.name={environment.name!r}: the code-tool demo runs the 'tool_use' environment")
    if set(environment.tools) - {TOOL}:
        problems.append(f"environment.tools={list(environment.tools)}: the code-tool demo offers {TOOL!r} or no tool")
    if environment.renderer not in (None, RENDERER) or environment.enable_thinking is not False:
        problems.append(
            f"environment.renderer={environment.renderer!r} with enable_thinking={environment.enable_thinking}: the "
            f"code-tool demo's model was warm-started in the {RENDERER!r} format with enable_thinking false"
        )
    if environment.system_prompt is not None:
        problems.append("environment.system_prompt: the code-tool demo's model was warm-started without one")
    return problems


@dataclass
class ReasoningGymDemoConfig:
    """The reasoning-gym demo's problems (kind "reasoning_gym"). The run's data.path must name the
    same task with the same settings as sft_data; its eval.path and data.system_prompt default to
    held_out and system_prompt (and must equal them if set)."""

    sft_data: str = "reasoning_gym:spell_backward?size=4000&seed=1000000&min_word_len=3&max_word_len=6"
    """The warm start's problems, a reasoning_gym source (reasoning_gym:<task>?size=N&seed=S&...)."""
    held_out: str = "reasoning_gym:spell_backward?size=200&seed=2000000&min_word_len=3&max_word_len=6"
    """The held-out problems the run evaluates on; those questions are kept out of the warm start."""
    system_prompt: str = "Answer inside <answer> </answer>."
    """The system message before each question (short: the character tokenizer spends a token a character)."""


def same_problems(source: str, other: str) -> bool:
    """Whether two reasoning_gym sources name the same task with the same task settings (size and
    seed aside)."""
    first, second = reasoning_gym.parse_source(source), reasoning_gym.parse_source(other)
    return (first.task, first.settings) == (second.task, second.settings)


def reasoning_gym_demo_problems(config: ReasoningGymDemoConfig, data, eval_path: str | None, tasks) -> list[str]:
    """What in the run's settings does not fit the reasoning-gym demo's warm start (data: the run's
    DataConfig)."""
    if tasks:
        return ["demo.kind reasoning_gym trains one task: set data.path, not tasks"]
    for name in ("sft_data", "held_out"):
        if not reasoning_gym.is_source(getattr(config, name)):
            return [
                f"demo.reasoning_gym.{name} must be a reasoning_gym source (reasoning_gym:<task>?size=N&seed=S), "
                f"got {getattr(config, name)!r}"
            ]
        if (problem := reasoning_gym.source_problem(getattr(config, name))) is not None:
            return [f"demo.reasoning_gym.{name}={getattr(config, name)!r}: {problem}"]
    if not same_problems(config.sft_data, config.held_out):
        return [
            f"demo.reasoning_gym.held_out {config.held_out!r} must name the task and settings of "
            f"demo.reasoning_gym.sft_data {config.sft_data!r} (only size and seed may differ)"
        ]
    try:
        fits = reasoning_gym.is_source(data.path) and same_problems(data.path, config.sft_data)
    except ValueError:  # a malformed source, which the data checks name
        return []
    if not fits:
        return [
            f"data.path {data.path!r}: the reasoning-gym demo trains on the problems it was warm-started on, "
            f"a reasoning_gym source of the task and settings of demo.reasoning_gym.sft_data {config.sft_data!r}"
        ]
    problems = []
    if eval_path is not None and eval_path != config.held_out:
        problems.append(
            f"eval.path {eval_path!r}: the reasoning-gym demo evaluates on demo.reasoning_gym.held_out "
            f"{config.held_out!r}, whose questions its warm start left out; leave eval.path unset"
        )
    if data.system_prompt is not None and data.system_prompt != config.system_prompt:
        problems.append(
            f"data.system_prompt {data.system_prompt!r}: the reasoning-gym demo's model was warm-started with "
            f"demo.reasoning_gym.system_prompt {config.system_prompt!r}; leave data.system_prompt unset"
        )
    return problems


@dataclass
class DemoConfig:
    """The built-in demo: a small Qwen3 model warm-started by SFT, on synthetic arithmetic (kind
    "arithmetic"), on 3-digit multiplication with the python tool (kind "code_tool") or on a
    reasoning-gym task (kind "reasoning_gym")."""

    kind: Literal["arithmetic", "code_tool", "reasoning_gym"] = "arithmetic"
    """arithmetic: a character tokenizer, `task` answered in one completion; code_tool: the Qwen3
    chat format, `code_tool`'s problems answered in episodes with the python sandbox
    (archon.demos.code_tool); reasoning_gym: a character tokenizer, `reasoning_gym`'s task
    answered inside <answer> </answer> (archon.demos.reasoning_gym)."""
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
    """Upper bound on SFT steps; the arithmetic warm start stops earlier at sft_target_accuracy, the
    code-tool one runs them all."""
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
    code_tool: CodeToolDemoConfig = field(default_factory=CodeToolDemoConfig)
    """The code-tool demo's problems and warm start (kind "code_tool"); `task` and the SFT's stop
    rule (sft_target_accuracy, sft_checks_at_target, sft_dev_examples) are the arithmetic demo's."""
    reasoning_gym: ReasoningGymDemoConfig = field(default_factory=ReasoningGymDemoConfig)
    """The reasoning-gym demo's problems (kind "reasoning_gym"; its warm start stops by the same rule
    as the arithmetic demo's, the task's problems being one "operation")."""
