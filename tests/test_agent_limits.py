"""Environments within the run's limits: their rewards checked as reward functions' are, their
prompts and trajectories kept inside the model's context, and their calls abandoned and killed
when they overrun, so that a run that ends exits. The Qwen3 format on a scripted engine (every
episode answers "ok" each turn)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from archon.agents.environment import Environment, EnvStep, StopReason
from archon.agents.environment_worker import EnvironmentProcess
from archon.agents.episodes import EpisodeLimits, EpisodeRunner
from archon.agents.renderer import get_renderer
from archon.rollout.base import Sample, SamplingParams
from tests.agent_environments import Echo, Stuck, greedy_agent
from tests.test_renderers_qwen_llama import qwen3_tokenizer

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def renderer():
    return get_renderer("qwen3", qwen3_tokenizer(), enable_thinking=False)


class OkEngine:
    """Every sample is "ok" and the stop token (cut to max_new_tokens); records its prompts."""

    def __init__(self, renderer):
        self.renderer, self.prompts, self.requests = renderer, [], []

    def generate(self, prompts, sampling: SamplingParams, sessions=None):
        self.prompts += prompts
        self.requests += [(len(prompt), sampling.max_new_tokens) for prompt in prompts]
        ids = self.renderer.encode("ok") + [self.renderer.stop_token_ids[0]]
        ids, finish = (
            (ids, "stop") if len(ids) <= sampling.max_new_tokens else (ids[: sampling.max_new_tokens], "length")
        )
        return [
            Sample(i // sampling.n, prompts[i // sampling.n], list(ids), [-0.5] * len(ids), finish, 0, [0] * len(ids))
            for i in range(len(prompts) * sampling.n)
        ]


def run(renderer, make_env, rows, group_size=1, context_tokens=None, **limits):
    engine = OkEngine(renderer)
    runner = EpisodeRunner(renderer, make_env, lambda calls: [], None, EpisodeLimits(**limits), context_tokens)
    trajectories = runner.run(rows, group_size, SamplingParams(temperature=1.0), engine.generate, False)
    return trajectories, engine


def rewarding(reward):
    class Rewarding(Environment):
        def reset(self, row):
            return [{"role": "user", "content": "hi"}]

        def step(self, turn, tool_results):
            return EnvStep(reward=reward, done=True)

    return Rewarding


@pytest.mark.parametrize("reward", [math.nan, math.inf, -math.inf, "abc", None, True])
def test_a_reward_that_is_not_a_finite_number_ends_its_episode_naming_the_environment(renderer, reward):
    (t,), _ = run(renderer, rewarding(reward), [{}])
    assert t.stop_reason == StopReason.ENV_ERROR and "Rewarding.step" in t.error and repr(reward) in t.error
    assert t.reward == 0.0 and t.step_rewards == []


def test_a_reward_from_an_environment_process_is_checked_too(renderer):
    make_env = lambda: EnvironmentProcess("tests.agent_environments:Echo", Echo, 30.0)  # noqa: E731
    rows = [{"prompt": "a", "reward": math.nan, "steps": 1}, {"prompt": "b", "reward": 0.25, "steps": 2}]
    bad, good = run(renderer, make_env, rows)[0]
    assert bad.stop_reason == StopReason.ENV_ERROR and "Echo.step" in bad.error and "nan" in bad.error
    assert good.stop_reason == StopReason.DONE and good.reward == 0.5 and good.step_rewards == [0.25, 0.25]


def test_an_environment_process_loads_after_the_trainer_imported_setuptools(renderer):
    """Importing setuptools appends its vendored packages (an old typing_extensions) to sys.path; a
    worker keeps the trainer's order, so they stay behind site-packages and the environment loads."""
    import setuptools  # noqa: F401

    assert any(entry.endswith("_vendor") for entry in sys.path)
    make_env = lambda: EnvironmentProcess("tests.agent_environments:Echo", Echo, 30.0)  # noqa: E731
    (done,), _ = run(renderer, make_env, [{"prompt": "a", "reward": 0.25, "steps": 1}])
    assert done.stop_reason == StopReason.DONE, done.error


class GroupRewards(Environment):
    """group_rewards by row: raises, gives a wrong count, a NaN, or ranks the group."""

    def reset(self, row):
        self.row = row
        return [{"role": "user", "content": row["kind"]}]

    def step(self, turn, tool_results):
        return EnvStep(reward=0.5, done=True)

    @classmethod
    def group_rewards(cls, trajectories):
        kind = trajectories[0].messages[0]["content"]
        if kind == "raises":
            raise RuntimeError("no ranking today")
        if kind == "count":
            return [1.0]
        if kind == "nan":
            return [math.nan, 1.0]
        return [1.0, 0.0]


def test_a_failing_group_rewards_ends_its_group_and_no_other(renderer):
    rows = [{"kind": kind} for kind in ("raises", "count", "nan", "ranks")]
    trajectories, _ = run(renderer, GroupRewards, rows, group_size=2)
    for g, needle in enumerate(("RuntimeError: no ranking today", "1 rewards for a group of 2", "nan")):
        for t in trajectories[2 * g : 2 * g + 2]:
            assert t.stop_reason == StopReason.ENV_ERROR and t.reward == 0.0
            assert "GroupRewards.group_rewards" in t.error and needle in t.error
    assert [t.reward for t in trajectories[6:]] == [1.0, 0.0]
    assert all(t.stop_reason == StopReason.DONE for t in trajectories[6:])
    assert all(math.isfinite(t.reward) for t in trajectories)


def long_reset(content: str):
    class LongReset(Environment):
        def reset(self, row):
            return [{"role": "user", "content": content}]

        def step(self, turn, tool_results):
            return EnvStep(done=True)

    return LongReset


def test_a_first_prompt_longer_than_the_context_ends_its_episode_before_any_prefill(renderer):
    words = " ".join(f"w{i}" for i in range(20_000))
    assert len(renderer.render_prompt([{"role": "user", "content": words}])) > 4096
    (t,), engine = run(renderer, long_reset(words), [{}], context_tokens=4096)
    assert t.stop_reason == StopReason.PROMPT_TOO_LONG and "4096" in t.error
    assert engine.prompts == [] and t.completion_ids == []

    start = time.monotonic()
    (t,), engine = run(renderer, long_reset("x" * 2**20), [{}], context_tokens=4096)  # a 1 MB message
    assert t.stop_reason == StopReason.PROMPT_TOO_LONG and engine.prompts == []
    assert time.monotonic() - start < 60  # tokenized once; nothing is prefilled


def test_trajectories_stay_inside_the_context(renderer):
    rows = [{"prompt": "hello", "steps": 100}]
    prompt = len(renderer.render_prompt([{"role": "user", "content": "hello"}]))
    (t,), engine = run(renderer, Echo, rows, context_tokens=prompt + 40, max_turns=50, max_turn_tokens=8)
    assert t.stop_reason == StopReason.TOKEN_BUDGET and 1 < t.num_turns < 50
    assert len(t.trajectory_ids) <= prompt + 40
    assert all(length + new <= prompt + 40 for length, new in engine.requests)  # no request asks past it


def test_a_stuck_environment_process_is_killed(renderer, tmp_path):
    pid_file = tmp_path / "pid"
    make_env = lambda: EnvironmentProcess("tests.agent_environments:Stuck", Stuck, 2.0)  # noqa: E731
    start = time.monotonic()
    (t,), _ = run(renderer, make_env, [{"prompt": "hi", "pid_file": str(pid_file)}], step_timeout_s=2.0)
    assert time.monotonic() - start < 30
    assert t.stop_reason == StopReason.TIMEOUT and "killed" in t.error
    (pid,) = map(int, pid_file.read_text().split())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_process_whose_in_process_environment_is_stuck_exits(tmp_path):
    """An Environment object run in this process: its stuck step and close are abandoned, and the
    process exits when its work is done, without waiting for them."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(REPO)!r}, {str(REPO / "tests")!r}]
        from tests.agent_environments import Stuck
        from tests.test_agent_limits import OkEngine, run
        from archon.agents.renderer import get_renderer
        from tests.test_renderers_qwen_llama import qwen3_tokenizer

        renderer = get_renderer("qwen3", qwen3_tokenizer(), enable_thinking=False)
        class StuckToTheEnd(Stuck):
            def close(self):
                import time
                time.sleep(3600)

        rows = [{{"prompt": "hi", "pid_file": {str(tmp_path / "pid")!r}}}]
        (t,), _ = run(renderer, StuckToTheEnd, rows, step_timeout_s=1.0)
        print(t.stop_reason.value)
        """
    )
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split()[-1] == "timeout"
    assert time.monotonic() - start < 100


@pytest.fixture(scope="module")
def small_context_model(tmp_path_factory):
    """A tiny random Qwen3 of the Qwen3 test tokenizer with a 256-position context."""
    from archon.build import build_model
    from archon.tools.align import make_tiny_hf_checkpoint

    tokenizer = qwen3_tokenizer()
    path = make_tiny_hf_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("qwen3_256"),
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        max_position_embeddings=256,
    )
    return build_model(path, dtype=torch.float32).model.eval()


def test_agents_keep_the_runs_turn_limit_and_the_models_context(renderer, small_context_model):
    """200-turn agents that ask for 93 tokens a turn, on a 256-position model with 8-token turns and
    100-token trajectories: no turn samples more than 8, no session grows past the context, and the
    trajectories longer than 100 completion tokens are cut (and say so)."""
    from archon.agents.agent_episodes import AgentEpisodes
    from archon.rollout.native import NativeRolloutEngine

    engine = NativeRolloutEngine(small_context_model)
    limits = EpisodeLimits(max_turn_tokens=8, max_tokens=100)
    episodes = AgentEpisodes(greedy_agent, renderer, limits, timeout_s=300.0, context_tokens=256)
    trajectories = episodes.run([{"prompt": "Count."}, {"prompt": "Talk."}], 2, SamplingParams(temperature=1.0), engine)
    assert len(trajectories) == 4
    for t in trajectories:
        assert t.num_turns > 1
        runs, length = [], 0
        for sampled in t.sampled_mask + [False]:
            if sampled:
                length += 1
            elif length:
                runs, length = runs + [length], 0
        assert runs and max(runs) <= 8, runs
        assert len(t.completion_ids) <= 100 and len(t.trajectory_ids) <= 256
    assert any(t.cut for t in trajectories)
    assert all(t.to_sample(0).finish_reason == "length" for t in trajectories if t.cut)


def test_a_run_with_a_stuck_environment_ends_and_leaves_no_process(tmp_path):
    """A training run whose environment never answers its reset: each episode is abandoned after
    step_timeout_s, the run trains its steps and exits, and no environment process is left."""
    import json

    from archon.tools.align import make_tiny_hf_checkpoint

    tokenizer = qwen3_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        "qwen3",
        tmp_path / "model",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
    )
    tokenizer.save_pretrained(model_dir)
    pid_file = tmp_path / "pids"
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": f"{i}?", "answer": "1", "pid_file": str(pid_file), "stuck_in": "reset"}) + "\n"
            for i in range(4)
        )
    )
    args = [
        "--model.path", str(model_dir), "--data.path", str(data), "--data.answer-field", "answer",
        "--reward.function", "exact", "--reward.num-workers", "0", "--steps", "2", "--eval.every", "0",
        "--checkpoint.every", "0", "--rollout.group-size", "2", "--rollout.prompts-per-step", "2",
        "--environment.name", "tests.agent_environments:Stuck", "--environment.enable-thinking", "False",
        "--environment.limits.step-timeout-s", "2", "--environment.limits.max-turn-tokens", "4",
        "--logging.run-dir", str(tmp_path / "run"), "--logging.no-progress", "--logging.backends",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "grpo_lora.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert time.monotonic() - start < 400
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["stop_timeout"] for r in records if "stop_timeout" in r] == [1.0, 1.0]
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 8  # one process per episode: 2 steps x 2 prompts x 2 episodes
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_episodes_that_end_env_error_are_logged_with_their_reason(renderer, caplog):
    """stop_env_error counts them; the log says why (an endpoint that refuses every request, say,
    would otherwise fail every episode without a word)."""
    from types import SimpleNamespace

    from archon.rl.run.episodes import score_episodes

    trajectories, _ = run(renderer, rewarding(math.nan), [{}, {}])
    samples = [t.to_sample(i) for i, t in enumerate(trajectories)]
    no_answers = SimpleNamespace(metrics={}, rewards=torch.zeros(0), sums={})
    task = SimpleNamespace(name="agents", scorer=SimpleNamespace(score_batch=lambda *columns: no_answers))
    examples = [SimpleNamespace(prompt="", reference=None, data_source="", extra_info={}) for _ in samples]
    with caplog.at_level("WARNING", logger="archon.rl.run.episodes"):
        scores = score_episodes(task, examples, samples)
    assert scores.episode_sums["stop_env_error"] == 2.0
    assert "task 'agents': 2 of 2 episodes ended env_error; the first:" in caplog.text
    assert "Rewarding.step" in caplog.text
