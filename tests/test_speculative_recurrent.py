"""Speculative decoding on models with recurrent (linear-attention) layers: after the verify forward
their states are rolled back to the tokens each row keeps (archon/rollout/recurrent_cache.py:
RecurrentRollback), so greedy output equals plain greedy decoding token for token, in float64,
with drafts that are partly accepted and partly rejected."""

import pytest
import torch

from archon.build import build_model
from archon.rollout import recurrent_cache
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.speculative import DraftModelDrafter

PROMPTS = [[3, 17, 42, 9, 25], [7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]  # distinct lengths
NEW_TOKENS = 12

pytestmark = pytest.mark.usefixtures("float64_math")


class OracleDrafter:
    """Drafts each row's plain greedy continuation (known from a plain run, found by the row's prompt
    length) with one draft made wrong, at a place that moves with the row's length: the rounds accept
    0 to k drafts, most of them some but not all."""

    needs_target_hidden = False

    def __init__(self, completions: dict[int, list[int]], num_tokens: int, vocab_size: int) -> None:
        self.completions, self.num_tokens, self.vocab_size = completions, num_tokens, vocab_size

    def begin(self, target_cache) -> None: ...

    def end(self) -> None: ...

    def prefill(self, prompts, adapters, budget) -> None: ...

    def start_rows(self, rows, slots, places, first_tokens) -> None: ...

    def release_rows(self, rows, slots, places) -> None: ...

    def propose(self, tokens, ngen, prompt_lens, live, row_tasks, num_slots, prefix_span, suffix_span, *rest):
        k = self.num_tokens
        drafts = []
        for length, generated in zip(prompt_lens.tolist(), ngen.tolist()):
            right = (self.completions[length][generated:] + [0] * k)[:k]
            wrong = generated % (k + 1)  # k: every draft right
            if wrong < k:
                right[wrong] = (right[wrong] + 1) % self.vocab_size
            drafts.append(right)
        return torch.tensor(drafts, device=ngen.device), None


@pytest.mark.parametrize("model_type", ["qwen3_next", "nemotron_h"])
def test_greedy_equals_plain_greedy_on_recurrent_layers(tiny_checkpoint, model_type, monkeypatch):
    """With partly rejected drafts (an oracle drafter made wrong at moving places; a random draft
    model), for 2 and 3 draft tokens; without the rollback the same run gives other tokens."""
    target = build_model(tiny_checkpoint(model_type, seed=0), dtype=torch.float64).model.eval()
    vocab = target.output_weight.shape[0]
    sampling = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0)
    plain = NativeRolloutEngine(target).generate(PROMPTS, sampling)
    completions = {len(p): s.completion_ids for p, s in zip(PROMPTS, plain)}
    assert len({tuple(c) for c in completions.values()}) > 1

    for k in (2, 3):
        engine = NativeRolloutEngine(target, drafter=OracleDrafter(completions, k, vocab))
        got = engine.generate(PROMPTS, sampling)
        assert [s.completion_ids for s in got] == [s.completion_ids for s in plain]
        for a, b in zip(got, plain):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-10  # measured at most 2.9e-14
        stats = engine.stats
        assert 0 < stats.speculative_accepted < stats.speculative_proposed

    other = build_model(tiny_checkpoint("qwen3", seed=1, vocab_size=vocab), dtype=torch.float64).model.eval()
    engine = NativeRolloutEngine(target, drafter=DraftModelDrafter(other, 3))
    assert [s.completion_ids for s in engine.generate(PROMPTS, sampling)] == [s.completion_ids for s in plain]

    monkeypatch.setattr(recurrent_cache.RecurrentRollback, "rewind", lambda self, kept: None)
    broken = NativeRolloutEngine(target, drafter=OracleDrafter(completions, 3, vocab)).generate(PROMPTS, sampling)
    assert [s.completion_ids for s in broken] != [s.completion_ids for s in plain]


def test_a_recurrent_draft_model_is_refused(tiny_checkpoint):
    recurrent = build_model(tiny_checkpoint("qwen3_next"), dtype=torch.float64).model.eval()
    with pytest.raises(ValueError, match="recurrent"):
        DraftModelDrafter(recurrent, 2)
