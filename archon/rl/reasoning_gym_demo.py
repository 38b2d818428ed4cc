"""The reasoning-gym demo: a small Qwen3 with the character tokenizer warm-started by SFT on a
reasoning-gym task (spell_backward by default), then GRPO-LoRA with the task's own scorer as the
reward (`reward.function: reasoning_gym`) on prompts from `data.path: reasoning_gym:<task>?...`.

The warm start (archon.rl.demo) learns the answer format the reward reads: the prompt is the chat a
reasoning_gym source makes (the demo's short system prompt, then the question), rendered with the
character tokenizer's chat template as the run renders it, and the completion is
`<answer>...</answer>`. Its problems are those of `sft_data` without any whose question is also
one of `held_out`'s, the held-out problems the run evaluates on.
"""

from __future__ import annotations

from dataclasses import dataclass

from archon.rl.data import reasoning_gym

ANSWER_FORMAT = "<answer>{answer}</answer>"
"""The warm start's completions: the form archon.rl.data.reasoning_gym.extract_answer reads."""


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


def sft_rows(config: ReasoningGymDemoConfig, tokenizer) -> tuple[list[dict], list[dict], int]:
    """(the warm start's rows, the held-out rows, how many of sft_data's problems were left out for
    asking a held-out question). Rows: {"prompt": the chat rendered with the tokenizer's chat
    template and the generation prompt, "answer": the completion `<answer>...</answer>`,
    "operation": the task}."""

    def rows(path: str) -> list[dict]:
        source = reasoning_gym.parse_source(path)
        made = []
        for messages, entry in reasoning_gym.load_entries(source, config.system_prompt):
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            answer = ANSWER_FORMAT.format(answer=entry["answer"])
            made.append({"prompt": prompt, "answer": answer, "operation": source.task, "question": entry["question"]})
        return made

    held_out = rows(config.held_out)
    asked = {row["question"] for row in held_out}
    train = rows(config.sft_data)
    kept = [row for row in train if row["question"] not in asked]
    return kept, held_out, len(train) - len(kept)
