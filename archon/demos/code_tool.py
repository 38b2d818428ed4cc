"""The code-tool demo: 3-digit multiplication, which a small model cannot do in its head but can
with the python tool. The model writes a call such as

    <tool_call>
    {"name": "python", "arguments": {"code": "print(123*456)"}}
    </tool_call><|im_end|>

reads the sandbox's output in the tool response, and answers with the number.

The model is a small Qwen3 with a byte-level BPE tokenizer made here: the Qwen3 special tokens, one
token per digit, and merges learnt from the demo's rendered conversations, so that the fixed text
(the tools preamble, the JSON punctuation, `print(`) takes few tokens. Its warm start
(archon.demos.warm_start) is an SFT on conversations built as the episode loop builds them, in the
Qwen3 chat format: the first messages rendered with the tools offered, the assistant's tool call,
the bridge to the sandbox's real output and the answer turn, with the loss on the assistant turns
only. Some of the conversations offered the tool answer without it (the product written directly),
so RL starts from a weak policy that calls the tool on some problems and is right when it does;
some are offered no tool at all, the format of the tool-less baseline.

The demo's settings (CodeToolDemoConfig) and the check that a run's environment is the one its
warm start was made for are archon.rl.config.demo's.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from archon.agents.environment import ToolUseEnvironment
from archon.agents.renderer import get_renderer
from archon.agents.sandbox import resolve_tool
from archon.agents.setup import build_episode_runner
from archon.agents.tools import ToolCall, ToolResult, ToolRunner
from archon.agents.trajectory import Trajectory
from archon.rl.config.demo import RENDERER, SPECIAL_TOKENS, TOOL, CodeToolDemoConfig
from archon.rl.reward_fns import exact_match_reward
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine

END_OF_TEXT, END_OF_TURN = "<|endoftext|>", "<|im_end|>"
TOKENIZER_FILE = "tokenizer.json"


# ---- the tokenizer ---------------------------------------------------------------------------------
def build_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (PreTrainedTokenizerFast) with the Qwen3 special tokens, each digit
    a token of its own, and the merges learnt from `texts` up to `vocab_size` tokens (no text: the
    bytes and the special tokens only)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\d"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    special = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
    # the special tokens are never merged with text: the corpus is the text between them
    backend.train_from_iterator((piece for text in texts for piece in special.split(text) if piece), trainer)
    return hf_tokenizer(backend)


def hf_tokenizer(backend):
    """The `tokenizers` tokenizer `backend` (or the path of its tokenizer.json) as a transformers
    tokenizer, <|im_end|> its EOS."""
    from transformers import PreTrainedTokenizerFast

    source = {"tokenizer_file": str(backend)} if isinstance(backend, (str, Path)) else {"tokenizer_object": backend}
    return PreTrainedTokenizerFast(
        **source,
        eos_token=END_OF_TURN,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[t for t in SPECIAL_TOKENS if t not in (END_OF_TURN, END_OF_TEXT)],
    )


def train_tokenizer(code_tool: CodeToolDemoConfig, conversations: list[dict]):
    """The demo's tokenizer: BPE merges learnt from `conversations` rendered in the demo's format."""
    bootstrap = build_tokenizer([], vocab_size=0)  # bytes only: it renders any text
    renderer = demo_renderer(bootstrap)
    texts = [bootstrap.decode(trajectory.trajectory_ids) for trajectory in sft_trajectories(renderer, conversations)]
    return build_tokenizer(texts, code_tool.vocab_size)


# ---- the warm start's conversations ----------------------------------------------------------------
def demo_renderer(tokenizer):
    return get_renderer(RENDERER, tokenizer, enable_thinking=False)


def operands(prompt: str) -> tuple[str, str]:
    numbers = re.findall(r"\d+", prompt)
    if len(numbers) != 2:
        raise ValueError(f"a code-tool demo prompt must hold two numbers, got {prompt!r}")
    return numbers[0], numbers[1]


def plan_conversations(code_tool: CodeToolDemoConfig, rows: list[dict], seed: int) -> list[dict]:
    """Each training row with how its warm-start conversation goes: {"row", "offered": the tool is
    offered, "code": the program it runs (None: the product is written directly)}."""
    rng = random.Random(f"archon-code-tool:{seed}")
    plans = []
    for row in rows:
        offered = rng.random() >= code_tool.no_tool_fraction
        uses_tool = offered and rng.random() < code_tool.tool_fraction
        a, b = operands(row["prompt"])
        plans.append({"row": row, "offered": offered, "code": f"print({a}*{b})" if uses_tool else None})
    return plans


def run_tool_calls(plans: list[dict], workers: int = 2) -> None:
    """Run each planned program in the python sandbox; its output goes to plan["output"]."""
    calling = [plan for plan in plans if plan["code"] is not None]
    with ToolRunner([resolve_tool(TOOL)], num_workers=workers) as runner:
        results = runner.call_many([ToolCall(TOOL, {"code": plan["code"]}) for plan in calling])
    for plan, result in zip(calling, results, strict=True):
        if result.status != "ok":
            raise RuntimeError(f"the sandbox failed on {plan['code']!r} ({result.status}): {result.content}")
        plan["output"] = result.content


def sft_trajectories(renderer, plans: list[dict]):
    """The planned conversations as trajectories, made as the episode loop makes them (the built-in
    environment's first messages and tool messages, the renderer's prompt and bridges), with the
    assistant turns as the sampled ids: the loss goes on them only."""
    tool = resolve_tool(TOOL)
    trajectories = []
    for plan in plans:
        environment = ToolUseEnvironment([tool] if plan["offered"] else [], None, "prompt")
        messages = environment.reset(plan["row"])
        tools = [t.schema() for t in environment.tools] or None
        trajectory = Trajectory(prompt_ids=renderer.render_prompt(messages, tools))
        if plan["code"] is not None:
            call = {"name": TOOL, "arguments": {"code": plan["code"]}}
            turn_ids = renderer.encode(f"<tool_call>\n{json.dumps(call)}\n</tool_call>{END_OF_TURN}")
            turn = renderer.parse_turn(turn_ids)
            if [c.name for c in turn.tool_calls] != [TOOL] or turn.parse_error is not None:
                raise ValueError(f"the {RENDERER!r} renderer does not read the demo's tool call back: {turn}")
            step = environment.step(turn, [ToolResult(plan["output"], "ok")])
            _add_sampled(trajectory, turn_ids)
            trajectory.add_environment(renderer.bridge(turn_ids, step.messages))
        _add_sampled(trajectory, renderer.encode(plan["row"]["answer"] + END_OF_TURN))
        trajectories.append(trajectory)
    return trajectories


def _add_sampled(trajectory, ids: list[int]) -> None:
    trajectory.add_sampled(ids, [0.0] * len(ids), [0] * len(ids))


# ---- held-out success in the episode loop ----------------------------------------------------------
def episode_success(
    model, device, tokenizer, rows: list[dict], environment, temperature: float = 0.0
) -> dict[str, float]:
    """Episodes of `rows` under `environment` (an EnvironmentConfig) on one process, greedy by default:
    {"success": the fraction answered exactly, "tool_calls": the fraction that called a tool,
    "tool_success": the fraction that called one and were right}."""
    engine = NativeRolloutEngine(model, device)
    runner, tool_runner = build_episode_runner(environment, tokenizer, RENDERER, "prompt")
    try:
        trajectories = runner.run(
            rows,
            1,
            SamplingParams(temperature=temperature),
            lambda prompts, sampling, sessions: engine.generate(prompts, sampling, sessions=sessions),
            keeps_sessions=True,
            end_sessions=engine.end_sessions,
        )
    finally:
        runner.close()
        tool_runner.close()
    right = [
        t.answer is not None and exact_match_reward("", t.answer, row["answer"]) == 1.0
        for t, row in zip(trajectories, rows)
    ]
    called = [t.num_tool_calls > 0 for t in trajectories]
    n = max(len(rows), 1)
    return {
        "success": sum(right) / n,
        "tool_calls": sum(called) / n,
        "tool_success": sum(r and c for r, c in zip(right, called)) / n,
    }
