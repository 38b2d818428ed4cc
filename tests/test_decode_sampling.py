"""The decode step's draw (archon/rollout/sampling.py, draw_tokens): two-stage inversion of the
cumulative distribution. Its draws follow the distribution (a chi-square test that rejects the same
draws against a slightly different distribution), a token of probability 0 is never drawn, even at
the ends of the uniform range, and the engine's sampled tokens follow the model's truncated
distribution token after token."""

import torch

from archon.build import build_model
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.sampling import draw_tokens, processed_logprobs, truncated_logprobs


def _chi_square_p_value(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit, cells with expected count < 5 pooled into one."""
    n = counts.sum()
    expected = expected_probs.double() * n
    small = expected < 5
    observed = torch.cat([counts[~small].double(), counts[small].sum().double()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    statistic = ((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum()
    dof = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


def _probs(vocab: int, seed: int) -> torch.Tensor:
    """A distribution over `vocab` tokens spread over three orders of magnitude, with zeros (tokens
    a top-k / top-p cut removed)."""
    g = torch.Generator().manual_seed(seed)
    probs = torch.exp(torch.randn(vocab, generator=g, dtype=torch.float64) * 2)
    probs[torch.randperm(vocab, generator=g)[: vocab // 4]] = 0
    return probs / probs.sum()


def test_draws_follow_the_distribution():
    """37 tokens: blocks of 7, the last one padded; 40,000 draws in one call (one row each)."""
    probs = _probs(37, seed=0)
    n = 40_000
    g = torch.Generator().manual_seed(1)
    tokens = draw_tokens(probs.float().expand(n, -1), torch.rand(n, 2, generator=g, dtype=torch.float64))
    counts = torch.bincount(tokens, minlength=37)
    assert counts[probs == 0].sum() == 0
    assert _chi_square_p_value(counts, probs) > 1e-3
    # the same draws against a distribution that moves 2% of the mass between two likely tokens
    shifted = probs.clone()
    top = probs.argsort(descending=True)[:2]
    shifted[top[0]] -= 0.02
    shifted[top[1]] += 0.02
    assert _chi_square_p_value(counts, shifted) < 1e-3


def test_zero_mass_is_never_drawn_at_the_ends_of_the_uniform_range():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    largest = 1 - 2.0**-53
    for u, expected in (((0.0, 0.0), [1, 5]), ((largest, largest), [3, 5]), ((0.0, largest), [1, 5])):
        uniforms = torch.tensor([u, u], dtype=torch.float64)
        assert draw_tokens(probs, uniforms).tolist() == expected, u
    # a vocabulary whose blocks divide it, all mass on its last token
    probs = torch.zeros(1, 16)
    probs[0, 15] = 1.0
    assert draw_tokens(probs, torch.tensor([[largest, 0.0]], dtype=torch.float64)).tolist() == [15]


def test_engine_samples_follow_the_model(tiny_checkpoint):
    """The engine's tokens 0 and 1 of 3,000 samples of one prompt (token 0 drawn from the prefill's
    logits, token 1 by a decode step) against the model's exact joint distribution of the two, at
    temperature 0.9 with a top-k cut, over a vocabulary of 8."""
    model = build_model(tiny_checkpoint("qwen3", seed=0, vocab_size=8)).model.eval()
    sampling = SamplingParams(max_new_tokens=2, temperature=0.9, top_k=6, n=8, seed=0)
    prompt = [1, 2, 3]
    engine = NativeRolloutEngine(model, max_batch_sequences=512)
    samples = engine.generate([prompt] * 375, sampling)
    with torch.no_grad():

        def dist(ids):
            logits = model(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))[-1:]
            return truncated_logprobs(logits, sampling)[0].exp().double()

        first = dist(prompt)
        exact = torch.stack([first[a] * dist(prompt + [a]) for a in range(8)]).flatten()  # [8 * 8]
    counts = torch.zeros(64)
    for s in samples:
        counts[s.completion_ids[0] * 8 + s.completion_ids[1]] += 1
    assert counts[exact == 0].sum() == 0
    assert _chi_square_p_value(counts, exact) > 1e-3
    # the same counts against the joint distribution without the top-k cut
    uncut = SamplingParams(temperature=0.9)
    with torch.no_grad():

        def uncut_dist(ids):
            logits = model(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))[-1:]
            return truncated_logprobs(logits, uncut)[0].exp().double()

        uncut_first = uncut_dist(prompt)
        uncut_exact = torch.stack([uncut_first[a] * uncut_dist(prompt + [a]) for a in range(8)]).flatten()
    assert _chi_square_p_value(counts, uncut_exact) < 1e-3


def test_a_float64_model_samples_with_float64_logprobs(tiny_checkpoint):
    """A float64 run (`--model.dtype float64`, no fp32 islands) samples and tags its tokens with
    float64 log-probs equal to the model's own (the sampler once cast them to float32, and the
    engine refused to store them in its float64 buffer)."""
    model = build_model(tiny_checkpoint("qwen3", seed=0), dtype=torch.float64).model.eval()
    prompt = [1, 2, 3]
    for sampling in (
        SamplingParams(max_new_tokens=3, temperature=0.7, top_p=0.9, seed=0),
        SamplingParams(max_new_tokens=3),
    ):
        sample = NativeRolloutEngine(model).generate([prompt], sampling)[0]
        ids = prompt + list(sample.completion_ids)
        with torch.no_grad():
            logits = model(torch.tensor(ids), torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))
        assert logits.dtype == torch.float64
        want = processed_logprobs(logits[len(prompt) - 1 : -1], sampling)
        want = want.gather(-1, torch.tensor(sample.completion_ids)[:, None])[:, 0]
        got = torch.tensor(sample.logprobs, dtype=torch.float64)
        # token 0 comes from the prefill, the same float64 computation as this forward; later tokens
        # from decode steps, whose fp32 islands (norm statistics, softmax) round otherwise: measured
        # 1.8e-7 here, bound 1e-6. A float32 cast of the sampled log-probs moves token 0 too (~1e-7).
        assert (got[0] - want[0]).abs().item() <= 1e-12, (sampling, got, want)
        assert (got - want).abs().max().item() <= 1e-6, (sampling, got, want)
