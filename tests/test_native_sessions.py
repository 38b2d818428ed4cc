"""Kept sessions of the embedded rollout engine: a multi-turn episode that prefills only each turn's
new tokens gives what prefilling the whole trajectory every turn gives.

Both sides run the same math, so they are compared in float64 (fp64 models inside
`fp32_islands_in_fp64`), where what is left between them is float64 rounding."""

import random

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, RolloutStats

# Different lengths; the longest trajectories outgrow the tiny models' sliding windows of 8.
FIRST_PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
FAMILIES = [
    "qwen3",
    "qwen2",
    "llama",
    "glm4_moe",
    "gpt_oss",
    "deepseek_v3",
    "qwen3_5_text",
    "deepseek_v32",
    "glm_moe_dsa",
]
# The largest log-prob difference measured between kept and re-prefilled sessions is 1.5e-14 (the gated
# delta rule of Qwen3.5, which sums a trajectory's chunks in another order from a kept state), with
# AVX-512, AVX2 and scalar kernels alike.
LOGPROB_ATOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _model(tiny_checkpoint, model_type):
    model = build_model(tiny_checkpoint(model_type), LoRAConfig(rank=4, alpha=8), dtype=torch.float64).model
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    return model.eval()


def _episode(engine, sampling, turns, keep, seed=0, prompts=FIRST_PROMPTS):
    """`turns` turns of every trajectory in one call per turn, 5-40 random environment tokens appended
    after each. Returns each turn's samples and the prefill tokens each turn should take with kept
    sessions (the first turn: every prompt; then the tokens after each kept prefix)."""
    rng = random.Random(seed)
    vocab = engine.model.args.vocab_size
    trajectories = [list(p) for p in prompts]
    kept_lens = [0] * len(prompts)
    turn_samples, new_tokens = [], []
    for _ in range(turns):
        sessions = list(range(len(trajectories))) if keep else None
        samples = engine.generate(trajectories, sampling, sessions=sessions)
        new_tokens.append(sum(len(t) - k for t, k in zip(trajectories, kept_lens)))
        turn_samples.append(samples)
        for i, (trajectory, sample) in enumerate(zip(trajectories, samples)):
            kept_lens[i] = len(trajectory) + len(sample.completion_ids) - 1  # the last token is not kept
            trajectory += sample.completion_ids + [rng.randrange(vocab) for _ in range(rng.randint(5, 40))]
    return turn_samples, new_tokens


def _assert_same_turns(got, expected):
    for turn, (got_samples, expected_samples) in enumerate(zip(got, expected, strict=True)):
        assert [s.prompt_ids for s in got_samples] == [s.prompt_ids for s in expected_samples]
        assert [s.completion_ids for s in got_samples] == [s.completion_ids for s in expected_samples]
        for i, (a, b) in enumerate(zip(got_samples, expected_samples)):
            assert_close_reporting(a.logprobs, b.logprobs, LOGPROB_ATOL, f"turn {turn}, sample {i}: log-probs")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_episode_with_kept_sessions_equals_full_prefills(tiny_checkpoint, model_type):
    """Four greedy turns of three trajectories: the same tokens and log-probs with kept sessions as
    with every trajectory prefilled in full each turn, and only the new tokens prefilled."""
    model = _model(tiny_checkpoint, model_type)
    sampling = SamplingParams(max_new_tokens=6, temperature=0)
    full_engine, kept_engine = NativeRolloutEngine(model), NativeRolloutEngine(model)
    expected, full_prefills = _episode(full_engine, sampling, 4, keep=False)
    got, new_tokens = _episode(kept_engine, sampling, 4, keep=True)
    _assert_same_turns(got, expected)
    assert kept_engine.stats.prefill_tokens == sum(new_tokens)
    assert full_engine.stats.prefill_tokens == sum(len(s.prompt_ids) for turn in expected for s in turn)
    assert kept_engine.stats.reused_tokens == full_engine.stats.prefill_tokens - kept_engine.stats.prefill_tokens > 0
    assert kept_engine.stats.decode_tokens == full_engine.stats.decode_tokens == 4 * len(FIRST_PROMPTS) * 5
    # each session keeps its trajectory up to the last sampled token
    assert kept_engine.session_tokens == sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in got[-1])
    kept_engine.end_sessions([0, 1, "unknown"])
    assert kept_engine.session_tokens == len(got[-1][2].prompt_ids) + len(got[-1][2].completion_ids) - 1
    kept_engine.clear_sessions()
    assert kept_engine.session_tokens == 0


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text"])
def test_sampled_episode_with_kept_sessions_equals_full_prefills(tiny_checkpoint, model_type):
    """Seeded sampling at temperature 1 with stop tokens (rows that finish early, in blocks that
    decode on): the same tokens with and without kept sessions."""
    model = _model(tiny_checkpoint, model_type)
    stop_ids = tuple(range(0, model.args.vocab_size, 9))  # about one token in nine stops a row
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3, stop_token_ids=stop_ids)
    engines = NativeRolloutEngine(model, stop_check_interval=2), NativeRolloutEngine(model, stop_check_interval=2)
    expected, _ = _episode(engines[0], sampling, 4, keep=False, seed=1)
    got, new_tokens = _episode(engines[1], sampling, 4, keep=True, seed=1)
    _assert_same_turns(got, expected)
    assert engines[1].stats.prefill_tokens == sum(new_tokens)
    lengths = {len(s.completion_ids) for turn in got for s in turn}
    assert 8 in lengths and min(lengths) < 8  # rows stopped early beside rows that decoded on


def test_group_of_samples_shares_a_kept_prefix(tiny_checkpoint):
    """A prompt with n=3 samples whose first key keeps the state of a prefix: one prefill of the rest
    for the group, the same samples as a full prefill, and each key then keeps its own sample."""
    model = _model(tiny_checkpoint, "qwen3_5_text")
    engine, reference = NativeRolloutEngine(model), NativeRolloutEngine(model)
    first = engine.generate([FIRST_PROMPTS[0]], SamplingParams(max_new_tokens=5, temperature=0), sessions=["a"])[0]
    prompt = first.prompt_ids + first.completion_ids + [9, 8, 7]
    sampling = SamplingParams(max_new_tokens=5, temperature=1.0, seed=4, n=3)
    engine.reset_stats()
    got = engine.generate([prompt], sampling, sessions=["a", "b", "c"])
    assert engine.stats == RolloutStats(
        prefill_tokens=4,
        reused_tokens=len(prompt) - 4,
        decode_tokens=12,
        prefill_forwards=1,
        max_prefill_forward_tokens=4,
        decode_steps=4,
    )
    expected = reference.generate([prompt], sampling)
    _assert_same_turns([got], [expected])
    assert len({tuple(s.completion_ids) for s in got}) > 1
    # each key continues its own sample
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    follow_ups = [s.prompt_ids + s.completion_ids + [5, 6] for s in got]
    engine.reset_stats()
    got = engine.generate(follow_ups, greedy, sessions=["a", "b", "c"])
    _assert_same_turns([got], [reference.generate(follow_ups, greedy)])
    assert engine.stats.prefill_tokens == 3 * 3


def test_mismatched_or_stale_kept_state_is_prefilled_in_full(tiny_checkpoint):
    """A prompt that does not continue its key's kept tokens, one that equals them (nothing left to
    prefill), and one after a new adapter version is published: each is prefilled in full, with the
    result of a generation without sessions."""
    model = _model(tiny_checkpoint, "qwen3")
    greedy = SamplingParams(max_new_tokens=5, temperature=0)
    engine, reference = NativeRolloutEngine(model), NativeRolloutEngine(model)
    first = engine.generate(FIRST_PROMPTS, greedy, sessions=["x", "y", "z"])
    changed = first[0].prompt_ids + first[0].completion_ids + [1, 2]
    changed[2] += 1  # an edit inside the kept tokens
    kept_tokens = first[1].prompt_ids + first[1].completion_ids[:-1]  # exactly what "y" keeps
    continued = first[2].prompt_ids + first[2].completion_ids + [3]
    prompts = [changed, kept_tokens, continued]
    engine.reset_stats()
    got = engine.generate(prompts, greedy, sessions=["x", "y", "z"])
    _assert_same_turns([got], [reference.generate(prompts, greedy)])
    assert engine.stats.prefill_tokens == len(changed) + len(kept_tokens) + 2
    engine.policy.publish(None, 1)  # the kept states were computed under version 0
    reference.policy.publish(None, 1)
    engine.reset_stats()
    prompts = [s.prompt_ids + s.completion_ids + [4] for s in got]
    _assert_same_turns(
        [engine.generate(prompts, greedy, sessions=["x", "y", "z"])], [reference.generate(prompts, greedy)]
    )
    assert engine.stats.reused_tokens == 0 and engine.stats.prefill_tokens == sum(map(len, prompts))


def test_eviction_under_a_token_bound_keeps_results_right(tiny_checkpoint):
    """With room for about two trajectories, the least recently used sessions are evicted and
    prefilled in full next turn: the same samples, fewer reused tokens, the bound held."""
    model = _model(tiny_checkpoint, "qwen3")
    sampling = SamplingParams(max_new_tokens=6, temperature=0)
    bounded = NativeRolloutEngine(model, max_session_tokens=100)
    expected, _ = _episode(NativeRolloutEngine(model), sampling, 3, keep=False)
    unbounded = NativeRolloutEngine(model)
    _episode(unbounded, sampling, 3, keep=True)
    got, _ = _episode(bounded, sampling, 3, keep=True)
    _assert_same_turns(got, expected)
    assert 0 < bounded.session_tokens <= 100
    assert 0 < bounded.stats.reused_tokens < unbounded.stats.reused_tokens


def test_sessions_of_the_wrong_length_are_refused(tiny_checkpoint):
    engine = NativeRolloutEngine(_model(tiny_checkpoint, "qwen3"))
    with pytest.raises(ValueError, match=r"sessions has 3 keys for 3 prompts x sampling.n=2"):
        engine.generate(FIRST_PROMPTS, SamplingParams(max_new_tokens=2, n=2), sessions=[0, 1, 2])
    with pytest.raises(ValueError, match=r"sessions repeats a key"):
        engine.generate(FIRST_PROMPTS, SamplingParams(max_new_tokens=2), sessions=[0, 1, 0])
    with pytest.raises(ValueError, match=r"max_session_tokens must be >= 0"):
        NativeRolloutEngine(engine.model, max_session_tokens=-1)
