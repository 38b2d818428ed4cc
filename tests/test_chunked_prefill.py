"""Chunked prefill in the embedded rollout engine: a prefill over `prefill_chunk_tokens` runs as
several forwards, each continuing its prompts from the cache, and gives what the one-shot prefill
gives (tokens and log-probs), for attention, MLA, sinks with sliding windows and recurrent layers.

Both sides run the same math, so they are compared in float64 (fp64 models inside
`fp32_islands_in_fp64`), where what is left between them is float64 rounding."""

import random

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.rl.config import RLConfig, validate
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine

# Lengths around the tiny models' sliding window (8) and the gated delta rule's chunk (64).
PROMPT_LENGTHS = [23, 5, 70, 1, 12]
FAMILIES = ["qwen3", "qwen3_5_text", "deepseek_v3", "gpt_oss", "deepseek_v32", "glm_moe_dsa"]
# The largest log-prob difference measured between chunked and one-shot prefills is 5.8e-15.
LOGPROB_ATOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _prompts(vocab: int, lengths=PROMPT_LENGTHS, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def _model(tiny_checkpoint, model_type):
    model = build_model(tiny_checkpoint(model_type), LoRAConfig(rank=4, alpha=8), dtype=torch.float64).model
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    return model.eval()


def _assert_same_samples(got, expected):
    assert [(s.prompt_index, s.prompt_ids, s.completion_ids, s.finish_reason) for s in got] == [
        (s.prompt_index, s.prompt_ids, s.completion_ids, s.finish_reason) for s in expected
    ]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_close_reporting(a.logprobs, b.logprobs, LOGPROB_ATOL, f"sample {i} (prompt {a.prompt_index}): log-probs")


def _prefill_forward_tokens(model):
    """A hook that records the packed token count of every prefill forward; remove it when done."""
    tokens = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: None if kwargs["cache"].decoding else tokens.append(args[0].numel()), with_kwargs=True
    )
    return tokens, hook


@pytest.mark.parametrize("model_type", FAMILIES)
def test_chunked_prefill_equals_one_shot(tiny_checkpoint, model_type):
    """Five prompts of 1 to 70 tokens, two greedy samples each, in a table of two blocks (prompts
    admitted as blocks free up): a budget of 7 splits prompts mid-way and packs the ends of some with
    the starts of others, one of 32 packs several short prompts whole; both give the one-shot
    prefill's tokens and log-probs, first token included."""
    model = _model(tiny_checkpoint, model_type)
    prompts = _prompts(model.args.vocab_size)
    sampling = SamplingParams(max_new_tokens=5, temperature=0, n=2)
    one_shot = NativeRolloutEngine(model, max_batch_sequences=4)
    expected = one_shot.generate(prompts, sampling)
    assert one_shot.stats.max_prefill_forward_tokens > 32
    for budget in (7, 32):
        engine = NativeRolloutEngine(model, max_batch_sequences=4, prefill_chunk_tokens=budget)
        got = engine.generate(prompts, sampling)
        _assert_same_samples(got, expected)
        assert engine.stats.prefill_tokens == one_shot.stats.prefill_tokens == sum(PROMPT_LENGTHS)
        assert engine.stats.max_prefill_forward_tokens <= budget
        assert engine.stats.prefill_forwards > one_shot.stats.prefill_forwards
        assert engine.stats.decode_tokens == one_shot.stats.decode_tokens


def test_sampled_groups_with_chunked_prefill_equal_one_shot(tiny_checkpoint):
    """Seeded sampling at temperature 1 with top-k, three samples per prompt, every prompt admitted
    at once: one token per forward, and a budget of 10, draw the one-shot prefill's samples."""
    model = _model(tiny_checkpoint, "qwen3")
    prompts = _prompts(model.args.vocab_size, seed=1)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=50, seed=5, n=3)
    expected = NativeRolloutEngine(model).generate(prompts, sampling)
    assert len({tuple(s.completion_ids) for s in expected}) > len(prompts)  # the samples of a group differ
    for budget in (1, 10):
        engine = NativeRolloutEngine(model, prefill_chunk_tokens=budget)
        _assert_same_samples(engine.generate(prompts, sampling), expected)
        assert engine.stats.prefill_forwards == -(-sum(PROMPT_LENGTHS) // budget)  # every forward full but the last


def test_forwards_pack_prompts_up_to_the_budget(tiny_checkpoint):
    """Prompts of 3, 2 and 10 tokens under a budget of 4: [3 + 1], [1 + 3], [4], [3] tokens per
    forward, as the hook on the model sees them and as the stats report."""
    model = _model(tiny_checkpoint, "qwen3")
    prompts = _prompts(model.args.vocab_size, lengths=[3, 2, 10])
    sampling = SamplingParams(max_new_tokens=3, temperature=0, n=2)
    engine = NativeRolloutEngine(model, prefill_chunk_tokens=4)
    tokens, hook = _prefill_forward_tokens(model)
    try:
        got = engine.generate(prompts, sampling)
    finally:
        hook.remove()
    assert tokens == [4, 4, 4, 3]
    assert engine.stats.prefill_forwards == 4 and engine.stats.max_prefill_forward_tokens == 4
    _assert_same_samples(got, NativeRolloutEngine(model).generate(prompts, sampling))


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "gpt_oss"])
def test_continued_session_prefills_in_chunks(tiny_checkpoint, model_type):
    """A second turn that continues each sample's kept state (keys/values, or the recurrent state)
    prefills its 30 new tokens in forwards of at most 6, and gives the samples of a one-shot prefill
    of the whole trajectory."""
    model = _model(tiny_checkpoint, model_type)
    vocab = model.args.vocab_size
    prompts = _prompts(vocab, lengths=[12, 3, 20])
    sampling = SamplingParams(max_new_tokens=4, temperature=0)
    engine = NativeRolloutEngine(model, prefill_chunk_tokens=6)
    first = engine.generate(prompts, sampling, sessions=[0, 1, 2])
    extra = _prompts(vocab, lengths=[10, 10, 10], seed=2)
    follow_ups = [s.prompt_ids + s.completion_ids + e for s, e in zip(first, extra)]
    engine.reset_stats()
    tokens, hook = _prefill_forward_tokens(model)
    try:
        got = engine.generate(follow_ups, sampling, sessions=[0, 1, 2])
    finally:
        hook.remove()
    reference = NativeRolloutEngine(model)
    _assert_same_samples(got, reference.generate(follow_ups, sampling))
    # each kept state holds its trajectory up to the last sampled token, which is prefilled with the new ones
    assert engine.stats.reused_tokens == sum(len(s.prompt_ids) + len(s.completion_ids) - 1 for s in first)
    assert engine.stats.prefill_tokens == 3 * 11
    assert tokens == [6] * 5 + [3] and engine.stats.prefill_forwards == 6


def test_multi_task_prompts_prefill_in_chunks(tiny_checkpoint):
    """On a model with two task adapters, forwards that pack pieces of prompts of both tasks route
    each token to its prompt's adapter: the samples of the one-shot prefill."""
    task_loras = {"a": LoRAConfig(rank=4, alpha=8), "b": LoRAConfig(rank=2, alpha=2)}
    model = build_model(tiny_checkpoint("qwen3"), task_loras=task_loras, dtype=torch.float64).model
    randomise_lora(lora_parameters(model), 0.2)
    model.eval()
    prompts = _prompts(model.args.vocab_size)
    sampling = SamplingParams(max_new_tokens=4, temperature=0, n=2)
    adapters = [0, 1, 1, 0, 1]
    expected = NativeRolloutEngine(model).generate(prompts, sampling, adapters=adapters)
    assert expected != NativeRolloutEngine(model).generate(prompts, sampling, adapters=[0] * 5)  # the adapters matter
    _assert_same_samples(
        NativeRolloutEngine(model, prefill_chunk_tokens=9).generate(prompts, sampling, adapters=adapters), expected
    )


class _EngineWithAPeerOfLongerPrefills(NativeRolloutEngine):
    """What the round agreement reports when another rank of the sync group prefills in three more
    forwards than this rank at every round where anyone prefills."""

    def _agree(self, prefill_forwards, decode_steps, unfinished):
        return (prefill_forwards + 3 if prefill_forwards else 0), decode_steps, unfinished


def test_a_rank_with_fewer_prefill_forwards_keeps_in_step(tiny_checkpoint):
    """Under a sync group the ranks run as many forwards as the rank with the most prefill chunks:
    a rank with fewer runs one-token forwards after its own, and its samples are those it generates
    alone."""
    model = _model(tiny_checkpoint, "qwen3")
    prompts = _prompts(model.args.vocab_size)
    sampling = SamplingParams(max_new_tokens=3, temperature=0, n=2)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        alone = NativeRolloutEngine(model, max_batch_sequences=4, prefill_chunk_tokens=8)
        expected = alone.generate(prompts, sampling)
        alone_forwards = len(forwards)
        peer = _EngineWithAPeerOfLongerPrefills(model, max_batch_sequences=4, prefill_chunk_tokens=8)
        got = peer.generate(prompts, sampling)
    finally:
        hook.remove()
    _assert_same_samples(got, expected)
    prefill_rounds = 3  # two blocks of the five prompts: admitted 2, then 2, then 1
    assert len(forwards) - alone_forwards == alone_forwards + 3 * prefill_rounds
    assert peer.stats.prefill_forwards == alone.stats.prefill_forwards


def test_bad_chunk_budgets_are_refused(tiny_checkpoint):
    model = _model(tiny_checkpoint, "qwen3")
    for bad in (0, -4):
        with pytest.raises(ValueError, match=rf"prefill_chunk_tokens must be >= 1 or None .*got {bad}"):
            NativeRolloutEngine(model, prefill_chunk_tokens=bad)
    config = RLConfig()
    validate(config, world_size=1)  # None: one forward per prefill
    config.rollout.prefill_chunk_tokens = 0
    with pytest.raises(ValueError, match=r"rollout.prefill_chunk_tokens=0: must be at least 1"):
        validate(config, world_size=1)
