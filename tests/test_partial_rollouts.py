"""Partial rollouts on the built-in engine: an adapter update published while a generation runs
in another thread takes effect between decode steps, and every token carries the version that
sampled it, with that version's log-prob (the trainer's, scored under each version)."""

import threading

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.lora import LoRAConfig, lora_parameters
from archon.rl.rollouts import rollout_batch
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, _Generation

PROMPTS = [[3, 17, 42, 9, 250], [7, 8]]
NEW_TOKENS = 100
PUBLISH_AFTER = (30, 65)
"""The decode steps after which versions 1 and 2 are published."""


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


@pytest.fixture(scope="module")
def trainer(qwen3_path):
    from archon.trainer import Trainer, TrainerConfig

    config = TrainerConfig(
        model_path=str(qwen3_path), lora=LoRAConfig(rank=4, alpha=8.0), device="cpu", dtype="float64"
    )
    return Trainer(config)


def _versions(model) -> dict[int, dict[str, torch.Tensor]]:
    """Adapter versions 0, 1, 2, each drawn afresh for every LoRA factor of every layer: after an
    update every cached key, value and prefix differs under the new version, so a token's log-prob
    equals the trainer's full forward under its version only if the engine computed the context
    again under it."""
    params = lora_parameters(model)
    versions = {}
    for version in (0, 1, 2):
        factors = {n: p.detach().clone() for n, p in params.items()}
        randomise_lora(factors, 0.5, torch.Generator().manual_seed(version), lora_b_scale=0.3)
        versions[version] = factors
    return versions


def _generate_across_publishes(
    engine: NativeRolloutEngine, versions, sampling: SamplingParams, monkeypatch, publish_after=PUBLISH_AFTER
):
    """Generate in another thread; after decode steps (speculative rounds with a drafter)
    `publish_after` the generation waits while this thread publishes versions 1 and 2 (events, not a
    clock), then goes on. Under update_policy 'finish' the version stays 0 until the end."""
    started_on = engine.policy.version
    reached = [threading.Event() for _ in publish_after]
    published = [threading.Event() for _ in publish_after]
    decode, steps = _Generation._decode, [0]

    def decode_then_hold(self, busy):
        decode(self, busy)
        steps[0] += 1
        if steps[0] in publish_after:
            k = publish_after.index(steps[0])
            reached[k].set()
            assert published[k].wait(60)

    monkeypatch.setattr(_Generation, "_decode", decode_then_hold)
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("samples", engine.generate(PROMPTS, sampling)))
    thread.start()
    for k, version in enumerate((1, 2)):
        assert reached[k].wait(120)
        engine.update_adapter(version, versions[version])
        expected = version - 1 if engine.update_policy == "continue" else started_on
        assert engine.policy.version == expected, "applied while a decode step could run"
        published[k].set()
    thread.join(120)
    assert engine.policy.version == 2
    return result["samples"]


def test_a_publish_during_generation_applies_between_decode_steps_with_exact_logprobs(trainer, monkeypatch):
    engine = NativeRolloutEngine(trainer.model)
    versions = _versions(trainer.model)
    engine.update_adapter(0, versions[0])  # no generation running: applied at once
    assert engine.policy.version == 0
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=3)
    samples = _generate_across_publishes(engine, versions, sampling, monkeypatch)

    a, b = 1 + PUBLISH_AFTER[0], PUBLISH_AFTER[1] - PUBLISH_AFTER[0]  # the first token comes from the prefill
    assert len(samples) == 4
    for sample in samples:
        assert sample.token_versions == [0] * a + [1] * b + [2] * (NEW_TOKENS - a - b)
        assert sample.version == 0
    _assert_logprobs_of_each_tokens_version(engine, trainer, samples, versions)


def test_under_finish_a_publish_during_generation_waits_for_its_end(trainer, monkeypatch):
    """update_policy='finish' (the built-in engine's asynchronous lanes under rollout.update_policy
    finish): the generation ends on the version it started with, and the last publish applies
    once it has ended."""
    engine = NativeRolloutEngine(trainer.model, update_policy="finish")
    versions = _versions(trainer.model)
    engine.update_adapter(0, versions[0])
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=3)
    samples = _generate_across_publishes(engine, versions, sampling, monkeypatch)
    assert all(s.token_versions == [0] * NEW_TOKENS for s in samples)
    torch.testing.assert_close(dict(lora_parameters(trainer.model)), versions[2], rtol=0, atol=0)
    _assert_logprobs_of_each_tokens_version(engine, trainer, samples, {0: versions[0]})
    with pytest.raises(ValueError, match="update_policy must be 'finish' or 'continue', got 'later'"):
        NativeRolloutEngine(trainer.model, update_policy="later")


def _assert_logprobs_of_each_tokens_version(engine, trainer, samples, versions) -> None:
    """Each token's rollout log-prob is the trainer's under the version that sampled it (the
    trainer scores the samples under each version in turn, published through the engine)."""
    advantages = torch.zeros(len(samples), dtype=torch.float64)  # fp64: the batch keeps the fp64 log-probs
    batch = rollout_batch(samples, advantages, trainer_version=max(versions))
    scored = {}
    for version, factors in versions.items():
        engine.update_adapter(version, factors)
        scored[version] = trainer.logprobs(batch, 1.0).logprobs
    token_version = max(versions) - batch.extras["version_lag"]
    for version in versions:
        at = batch.loss_mask & (token_version == version)
        assert int(at.sum()) > 0
        # float64 on both sides: float64 rounding is left (far below 1e-10)
        assert_close_reporting(batch.rollout_logprobs[at], scored[version][at], 1e-10, f"tokens of version {version}")
        # the versions differ where it is measured, so a token tagged with the wrong one would show
        for other in versions:
            if other != version:
                assert float((scored[other][at] - batch.rollout_logprobs[at]).abs().max()) > 1e-3


def test_a_publish_between_speculative_rounds_tags_each_emitted_token(trainer, qwen3_path, monkeypatch):
    """With a drafter, a round emits 1 to k+1 tokens; an update applies between rounds, and every
    token a round emits carries the version that verified it, with that version's log-prob."""
    from archon.build import build_model
    from archon.rollout.speculative import DraftModelDrafter

    # the base without the adapter: often right
    draft = build_model(qwen3_path, seed=1, dtype=torch.float64).model.eval()
    engine = NativeRolloutEngine(trainer.model, drafter=DraftModelDrafter(draft, 3))
    versions = _versions(trainer.model)
    engine.update_adapter(0, versions[0])
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, n=2, seed=4)
    samples = _generate_across_publishes(engine, versions, sampling, monkeypatch, publish_after=(6, 12))
    for sample in samples:
        runs = [v for i, v in enumerate(sample.token_versions) if i == 0 or sample.token_versions[i - 1] != v]
        assert runs == [0, 1, 2], sample.token_versions
        # rounds 1..6 emit 7 to 6 * 4 + 1 tokens of version 0 (the first token comes from the prefill)
        assert 7 <= sample.token_versions.count(0) <= 25
    _assert_logprobs_of_each_tokens_version(engine, trainer, samples, versions)


def test_an_update_between_generations_applies_at_once(trainer):
    engine = NativeRolloutEngine(trainer.model)
    versions = _versions(trainer.model)
    engine.update_adapter(5, versions[1])
    assert engine.policy.version == 5
    torch.testing.assert_close(dict(lora_parameters(trainer.model)), versions[1], rtol=0, atol=0)
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, temperature=1.0, seed=0))
    assert all(s.token_versions == [5] * 4 and s.version == 5 for s in samples)
    with pytest.raises(ValueError, match="no LoRA parameter"):
        engine.update_adapter(6, {"layers.0.nothing.lora_A": torch.zeros(1)})


def test_a_lease_is_superseded_by_a_publish_or_a_pending_swap():
    """What a streaming request under 'continue' watches: a new version, or a merged publish
    waiting (exclusive) for the requests in flight; the publish waits for a replaced name's leases."""
    from archon.rollout.policy import ServedPolicy

    policy = ServedPolicy("a", 1)
    with policy.lease() as (name, version):
        assert not policy.superseded(version)
        policy.publish("b", 2)
        assert policy.superseded(version)
        assert not policy.wait_released({"a"}, 0.01)  # this lease still holds it
    assert policy.wait_released({"a"}, 0.01) and policy.take_unused() == ["a"]

    merged = ServedPolicy(None, 3)
    released = threading.Event()

    def request():
        with merged.lease() as (_, version):
            while not merged.superseded(version):  # the swap below waits for this lease
                released.wait(0.001)
        released.set()

    thread = threading.Thread(target=request)
    thread.start()
    while merged.in_flight() == 0:
        thread.join(0.001)
    with merged.exclusive():  # returns once the request saw it was superseded and let go
        assert released.wait(5) and merged.in_flight() == 0
        merged.publish(None, 4)
    thread.join(5)
