"""The embedded rollout engine against step-by-step decoding through the full forward."""

import math

import pytest
import torch

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, sample_next_tokens

PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def _full_forward_logits(model, ids):
    ids = torch.tensor(ids)
    return model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))


def _lora_model(path):
    model = build_model(path, lora=LoRAConfig(rank=4, alpha=8)).model.eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe"])
def test_greedy_equals_stepwise_argmax(tiny_checkpoint, model_type):
    model = _lora_model(tiny_checkpoint(model_type))
    trainer = NativeRolloutEngine(model)
    samples = trainer.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, n=2))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    with torch.no_grad():
        for sample in samples:
            ids = list(sample.prompt_ids)
            for token, logprob in zip(sample.completion_ids, sample.logprobs):
                logits = _full_forward_logits(model, ids)[-1]
                assert token == int(logits.argmax())
                assert logprob == pytest.approx(float(torch.log_softmax(logits, -1)[token]), abs=1e-5)
                ids.append(token)
            assert sample.finish_reason == "length" and len(sample.completion_ids) == 8


def _truncated_logprob(logits, temperature, top_k, top_p, token):
    """log p(token) under softmax(logits / temperature) cut to the top_k largest, then to the
    fewest largest tokens whose mass reaches top_p, renormalised; one row, token by token."""
    probs = torch.softmax(logits.double() / temperature, -1)
    ranked = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[:top_k]
    kept, mass = [], 0.0
    total = sum(float(probs[i]) for i in ranked)
    for i in ranked:
        if mass >= top_p:
            break
        kept.append(i)
        mass += float(probs[i]) / total
    assert token in kept, "a token outside the truncated set was sampled"
    return math.log(float(probs[token]) / sum(float(probs[i]) for i in kept))


def test_sampled_logprobs_are_the_truncated_distributions(tiny_checkpoint):
    """With top-k/top-p the reported log-prob is the behaviour policy's: truncated, renormalised."""
    model = _lora_model(tiny_checkpoint("qwen3"))
    trainer = NativeRolloutEngine(model)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=50, n=3, seed=1)
    samples = trainer.generate(PROMPTS, sampling)
    truncated_somewhere = False
    with torch.no_grad():
        for sample in samples:
            ids = sample.prompt_ids + sample.completion_ids
            logits = _full_forward_logits(model, ids)[len(sample.prompt_ids) - 1 : -1]
            expected = [
                _truncated_logprob(row, 0.7, 50, 0.9, token) for row, token in zip(logits, sample.completion_ids)
            ]
            torch.testing.assert_close(torch.tensor(sample.logprobs), torch.tensor(expected, dtype=torch.float32), rtol=0, atol=1e-5)
            untruncated = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
            truncated_somewhere |= bool((untruncated - torch.tensor(sample.logprobs)).abs().max() > 1e-3)
    assert truncated_somewhere  # the check above would not see the convention otherwise
    again = trainer.generate(PROMPTS, sampling)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]
    again = trainer.generate(PROMPTS, sampling)
    assert [s.completion_ids for s in again] == [s.completion_ids for s in samples]


def test_stop_tokens_and_versions(tiny_checkpoint):
    model = _lora_model(tiny_checkpoint("qwen3"))
    trainer = NativeRolloutEngine(model)
    greedy = trainer.generate(PROMPTS[:1], SamplingParams(max_new_tokens=5, temperature=0))[0]
    stop = greedy.completion_ids[2]
    trainer.policy.publish(None, 3)  # what the in-process weight sync does
    stopped = trainer.generate(PROMPTS[:1], SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(stop,)))[0]
    first_stop = greedy.completion_ids.index(stop)
    assert stopped.completion_ids == greedy.completion_ids[: first_stop + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.version == 3 and greedy.version == 0
    assert stopped.token_versions == [3] * len(stopped.completion_ids)
    assert trainer.health()["adapter_version"] == 3
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        trainer.generate([[1], []], SamplingParams())


def test_top_k_and_top_p_truncate():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next_tokens(logits, SamplingParams(top_k=2), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    # softmax([2, 1, .5, -1]) = [.61, .22, .14, .03]: top_p 0.7 keeps the first two tokens
    draws = {int(sample_next_tokens(logits, SamplingParams(top_p=0.7), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    token, logprob = sample_next_tokens(logits, SamplingParams(temperature=0), g)
    assert int(token) == 0 and float(logprob) == pytest.approx(float(torch.log_softmax(logits, -1)[0, 0]))


def test_logprobs_equal_the_trainers(tiny_checkpoint):
    """Rollout log-probs equal Engine.logprobs on the same tokens (the old-policy recomputation)."""
    from archon.batch import PackedBatch
    from archon.trainer import Trainer, TrainerConfig

    trainer = Trainer(TrainerConfig(model_path=str(tiny_checkpoint("qwen3_moe")), lora=LoRAConfig(rank=4, alpha=8)))
    with torch.no_grad():
        for p in lora_parameters(trainer.model).values():
            p.normal_(0, 0.1)
    rollout = NativeRolloutEngine(trainer.model)
    samples = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.8, n=2, seed=3))
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    trainer = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout_lp = torch.tensor([lp for s in samples for lp in s.logprobs])
    torch.testing.assert_close(rollout_lp, trainer, rtol=0, atol=1e-5)
