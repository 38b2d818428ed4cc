"""The reasoning-gym demo: a small Qwen3 with the character tokenizer warm-started by SFT on a
reasoning-gym task (spell_backward by default), then GRPO-LoRA with the task's own scorer as the
reward (`reward.function: reasoning_gym`) on prompts from `data.path: reasoning_gym:<task>?...`.

The warm start (archon.demos.warm_start) learns the answer format the reward reads: the prompt is
the chat a reasoning_gym source makes (the demo's short system prompt, then the question), rendered
with the character tokenizer's chat template as the run renders it, and the completion is
`<answer>...</answer>`. Its problems are those of `sft_data` without any whose question is also
one of `held_out`'s, the held-out problems the run evaluates on.

The demo's settings and the checks that a run fits them are archon.rl.config.demo's.
"""

from __future__ import annotations

from archon.rl.config.demo import ReasoningGymDemoConfig
from archon.rl.data import reasoning_gym

ANSWER_FORMAT = "<answer>{answer}</answer>"
"""The warm start's completions: the form archon.rl.data.reasoning_gym.extract_answer reads."""


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
