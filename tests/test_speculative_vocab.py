"""A draft model with a smaller vocabulary than the policy's (archon/rollout/speculative.py): it
never proposes a token past its vocabulary, and reads the policy's tokens past it (in a prompt, or
sampled) as token 0, so that greedy output still equals plain greedy decoding token for token and
the log-probs stay the policy's. fp64 models inside fp32_islands_in_fp64 (see
tests/test_speculative_decoding.py)."""

import pytest
import torch

from archon.build import build_model
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.speculative import DraftModelDrafter

pytestmark = pytest.mark.usefixtures("float64_math")
LOGPROB_ATOL = 1e-10  # float64 rounding: the speculative and plain paths differ by at most ~1e-14


def _model(path):
    return build_model(path, dtype=torch.float64).model.eval()


def test_a_draft_model_with_a_smaller_vocabulary(tiny_checkpoint):
    target = _model(tiny_checkpoint("qwen3", seed=0))
    vocab = target.output_weight.shape[0]
    draft = _model(tiny_checkpoint("qwen3", seed=1, vocab_size=vocab // 4))
    drafter = DraftModelDrafter(draft, 3)
    assert drafter.vocab_size == vocab // 4
    prompts = [[3, vocab - 1, 42, vocab // 2], [vocab - 2], list(range(vocab - 8, vocab))]
    proposed = []
    original = drafter.propose

    def recording(*args, **kwargs):
        drafts, probs = original(*args, **kwargs)
        proposed.append(drafts.clone())
        return drafts, probs

    drafter.propose = recording
    for sampling in (
        SamplingParams(max_new_tokens=12, temperature=0, n=2),
        SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=5),
    ):
        plain = NativeRolloutEngine(target, max_batch_sequences=8).generate(prompts, sampling)
        engine = NativeRolloutEngine(target, max_batch_sequences=8, drafter=drafter)
        got = engine.generate(prompts, sampling)
        assert engine.stats.speculative_proposed > 0
        if sampling.temperature == 0:
            assert [s.completion_ids for s in got] == [s.completion_ids for s in plain]
            for a, b in zip(got, plain):
                assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < LOGPROB_ATOL
    assert proposed and all(int(d.max()) < vocab // 4 for d in proposed)
