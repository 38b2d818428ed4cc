"""The draft head (archon/rollout/drafter.py) and the demo's shipped one (archon/demos/drafter.py):
greedy speculative output equals plain greedy decoding token for token (float64), sampled output
follows the target's distribution (a chi-square test on the demo base, which fails once the
rejection step is broken), the shipped head drafts the demo's held-out problems well, the command
that makes it writes a head that loads, and bad files are refused by name."""

import dataclasses
import json

import pytest
import torch
from test_speculative_decoding import _chi_square_p_value

from archon.build import build_model
from archon.demos import DEMO_CONFIG
from archon.demos import drafter as demo_drafter
from archon.demos.warm_start import prepare_demo
from archon.rl.config import load_config_file
from archon.rollout import speculative
from archon.rollout.base import SamplingParams
from archon.rollout.drafter import DraftHead, DraftHeadDrafter, distill_draft_head, load_draft_head, save_draft_head
from archon.rollout.native import NativeRolloutEngine

pytestmark = pytest.mark.usefixtures("float64_math")  # the equalities compare in float64

PROMPTS = [[3, 17, 42, 9, 25], [7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """(the demo's settings and seed, its files: the shipped warm start, its data)."""
    config = load_config_file(DEMO_CONFIG)
    settings = dataclasses.replace(config.demo, cache_dir=str(tmp_path_factory.mktemp("demo")))
    files = prepare_demo(settings, config.parallel, config.seed, rank=0, log=lambda *_: None)
    return settings, config.seed, files


@pytest.fixture(scope="module")
def demo_base(demo):
    """(the demo base in float64, its shipped draft head, the tokenizer, the held-out prompts' ids)."""
    from transformers import AutoTokenizer

    settings, seed, files = demo
    model = build_model(str(files.model_dir), dtype=torch.float64).model.eval().requires_grad_(False)
    head = load_draft_head(demo_drafter.packaged_drafter(settings, seed), model)
    tokenizer = AutoTokenizer.from_pretrained(files.model_dir)
    rows = [json.loads(line) for line in files.held_out_path.read_text().splitlines()]
    prompts = [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in rows]
    return model, head, tokenizer, prompts


def test_draft_head_greedy_equals_plain_greedy(tiny_checkpoint):
    """A random head (drafts partly right: its residual output scores the target's own next token
    again), 1 and 3 draft tokens, with a stop token: the tokens and log-probs are plain decoding's."""
    target = build_model(tiny_checkpoint("qwen3", seed=0, vocab_size=64), dtype=torch.float64).model.eval()
    sampling = SamplingParams(max_new_tokens=10, temperature=0, n=2)
    plain = NativeRolloutEngine(target).generate(PROMPTS, sampling)
    stop = plain[4].completion_ids[4]
    stopping = dataclasses.replace(sampling, stop_token_ids=(stop,))
    plain_stopping = NativeRolloutEngine(target).generate(PROMPTS, stopping)
    assert {s.finish_reason for s in plain_stopping} == {"stop", "length"}
    torch.manual_seed(0)
    head = DraftHead(target.embed_tokens.weight.shape[-1], 64).double().eval().requires_grad_(False)
    for k in (1, 3):  # samples that end at the stop token and samples that run to the length limit
        engine = NativeRolloutEngine(target, drafter=DraftHeadDrafter(target, head, k))
        got = engine.generate(PROMPTS, stopping)
        assert [(s.completion_ids, s.finish_reason) for s in got] == [
            (s.completion_ids, s.finish_reason) for s in plain_stopping
        ]
        for a, b in zip(got, plain_stopping):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-10  # measured at most 2.2e-15
        assert 0 < engine.stats.speculative_accepted < engine.stats.speculative_proposed


def _rejection_rate(target, head, sequences) -> float:
    """The mean over the completion positions of 1 - sum_x min(p(x), q(x)): the probability that a
    sampled first draft is rejected, q the head's distribution from the target's hidden state at
    t - 1 and token t, p the target's at t + 1 (temperature 1)."""
    rates = []
    for ids, prompt_len in sequences:
        tokens, n = torch.tensor(ids), len(ids)
        args = (tokens, torch.arange(n), torch.tensor([0, n]), n)
        with torch.no_grad():
            hidden, p = target(*args, return_hidden=True), torch.softmax(target(*args), dim=-1)  # row j: token j + 1
            for j in range(prompt_len - 1, n - 2):
                out = head(hidden[j : j + 1], tokens[j + 1 : j + 2], target.embed_tokens)
                q = torch.softmax(head.logits(out, target.output_weight), dim=-1)[0]
                rates.append(1 - float(torch.minimum(p[j + 1], q).sum()))
    return sum(rates) / len(rates)


def test_total_variation_phase_fits_the_rejection_rate(tiny_checkpoint):
    """distill_draft_head's second phase: its loss is the probability that a sampled draft is
    rejected, 1 - sum_x min(p, q) (computed here from the target's logits and the head), and its
    steps lower it from where the KL phase left the head (one batch of every entry, depth 1)."""
    target = build_model(tiny_checkpoint("qwen3", seed=0, vocab_size=64), dtype=torch.float64).model.eval()
    target.requires_grad_(False)
    sampling = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=0)
    samples = NativeRolloutEngine(target).generate(PROMPTS, sampling)
    sequences = [(s.prompt_ids + s.completion_ids, len(s.prompt_ids)) for s in samples]
    heads, losses = [], []
    for tv_steps in (0, 1, 20):
        torch.manual_seed(0)
        heads.append(DraftHead(target.embed_tokens.weight.shape[-1], 64).double())
        losses.append(
            distill_draft_head(target, sequences, heads[-1], 1, 20, 4096, 3e-3, 0, tv_steps, 3e-3, log=lambda *_: None)
        )
    after_kl = _rejection_rate(target, heads[0], sequences)
    assert abs(losses[1] - after_kl) < 1e-10  # the TV phase's first loss, before its first step
    assert _rejection_rate(target, heads[2], sequences) < after_kl - 0.01, after_kl


def test_shipped_demo_drafter_greedy(demo_base):
    """On the demo's 200 held-out problems (not trained on), greedy, 3 draft tokens (the depth the
    head was distilled for) and 2 (what benchmarks/rollout.py's speculative_demo cases use): plain
    greedy decoding's tokens; the first draft position is accepted for most rows. One problem a
    call, each call ends with its sample, and the rounds are fewer than plain decoding's steps (in
    one batch of 200 both take as many as the slowest row needs)."""
    model, head, tokenizer, prompts = demo_base
    sampling = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))
    plain_engine = NativeRolloutEngine(model)
    plain = plain_engine.generate(prompts, sampling)
    one_by_one = prompts[:16]
    plain_engine.stats.decode_steps = 0
    for prompt in one_by_one:
        plain_engine.generate([prompt], sampling)
    for k in (3, 2):
        drafter = DraftHeadDrafter(model, head, k)
        engine = NativeRolloutEngine(model, drafter=drafter)
        got = engine.generate(prompts, sampling)
        assert [s.completion_ids for s in got] == [s.completion_ids for s in plain], k
        by_position = drafter.acceptance_by_position()
        assert by_position[0] > 0.7, (k, by_position)  # measured 0.84 (float64 and float32 alike)
        engine.stats.decode_steps = 0
        for prompt in one_by_one:
            engine.generate([prompt], sampling)
        assert engine.stats.decode_steps < plain_engine.stats.decode_steps, (k, engine.stats, plain_engine.stats)


def _pair_p_value(model, drafter, sampling, prompt, samples):
    """The p-value of the joint distribution of completion tokens 1 and 2 (the first round's
    emitted tokens; token 0 comes from the prefill) against the target's exact one, whose cells
    below 1e-6 are left out (their mass is checked to be under 1e-4)."""
    engine = NativeRolloutEngine(model, max_batch_sequences=1024, drafter=drafter)
    got = engine.generate([prompt] * (samples // sampling.n), sampling)
    V = model.output_weight.shape[0]

    def next_probs(sequences):
        lens = torch.tensor([len(s) for s in sequences])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)])
        tokens = torch.tensor([t for s in sequences for t in s])
        positions = torch.cat([torch.arange(n) for n in lens.tolist()])
        with torch.no_grad():
            logits = model(tokens, positions, cu, int(lens.max()), logits_rows=cu[1:] - 1)
        return torch.softmax(logits.double() / sampling.temperature, dim=-1)

    first = next_probs([prompt])[0]
    firsts = (first > 1e-6).nonzero()[:, 0].tolist()
    second = next_probs([prompt + [a] for a in firsts])  # [A, V]
    pairs = [(i, b) for i, a in enumerate(firsts) for b in (second[i] > 1e-6).nonzero()[:, 0].tolist()]
    third = next_probs([prompt + [firsts[i], b] for i, b in pairs])  # [P, V]
    exact = torch.zeros(V, V, dtype=torch.float64)  # tokens 1 and 2
    for (i, b), p_c in zip(pairs, third):
        exact[b] += first[firsts[i]] * second[i, b] * p_c
    assert 1 - exact.sum() < 1e-4
    counts = torch.zeros(V * V)
    for s in got:
        counts[s.completion_ids[1] * V + s.completion_ids[2]] += 1
    return _chi_square_p_value(counts, exact.flatten() / exact.sum()), engine.stats


def test_shipped_demo_drafter_sampled_distribution(demo, monkeypatch):
    """2000 samples at temperature 1 of a held-out problem: the joint frequencies of completion
    tokens 1 and 2 fit the target's exact distribution (chi-square, p > 1e-3); accepting every draft
    instead of min(1, p / q) makes the same test fail. Statistical, not an equality: the float32
    model and head, as served."""
    settings, seed, files = demo
    model = build_model(str(files.model_dir)).model.eval().requires_grad_(False)
    head = load_draft_head(demo_drafter.packaged_drafter(settings, seed), model)
    prompt = [33, 28, 19, 32, 27, 37]  # "94+83=", the first held-out problem
    sampling = SamplingParams(max_new_tokens=3, temperature=1.0, n=8, seed=0)
    p_value, stats = _pair_p_value(model, DraftHeadDrafter(model, head, 2), sampling, prompt, 2000)
    assert p_value > 1e-3
    assert 0.2 < stats.speculative_accepted / stats.speculative_proposed < 0.95  # both branches are exercised

    real = speculative.accept_sampled

    def accept_always(target_logprobs, drafts, draft_probs, accept_noise, correction_noise):
        return real(target_logprobs, drafts, draft_probs, torch.full_like(accept_noise, float("inf")), correction_noise)

    monkeypatch.setattr("archon.rollout.decode.accept_sampled", accept_always)
    broken, _ = _pair_p_value(model, DraftHeadDrafter(model, head, 2), sampling, prompt, 2000)
    assert broken < 1e-3, broken


def test_the_command_writes_a_head_that_loads(demo, tmp_path):
    """python -m archon.demos.drafter on a few prompts and steps: the head lands under its settings'
    digest, with them in its metadata, and drafts for the demo base."""
    settings, seed, files = demo
    args = ["--head.num-prompts", "64", "--head.steps", "5", "--head.tv-steps", "3", "--head.batch-size", "32"]
    path = demo_drafter.main([*args, "--held-out-samples", "1", "--out-dir", str(tmp_path)])
    head_settings = demo_drafter.DraftHeadSettings(num_prompts=64, steps=5, tv_steps=3, batch_size=32)
    assert path == tmp_path / f"{demo_drafter.drafter_key(settings, seed, head_settings)}.safetensors"
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert json.loads(f.metadata()["settings"])["head"] == dataclasses.asdict(head_settings)
    model = build_model(str(files.model_dir)).model.eval()
    head = load_draft_head(path, model)
    sampling = SamplingParams(max_new_tokens=5, temperature=0)
    assert NativeRolloutEngine(model, drafter=DraftHeadDrafter(model, head, 2)).generate([[33, 28]], sampling)
    assert demo_drafter.packaged_drafter(settings, seed).exists()  # the demo's is shipped


def test_bad_draft_head_files_are_refused(tmp_path, tiny_checkpoint):
    model = build_model(tiny_checkpoint("qwen3", seed=0)).model.eval()
    dim = model.embed_tokens.weight.shape[-1]
    with pytest.raises(FileNotFoundError, match="missing.safetensors"):
        load_draft_head(tmp_path / "missing.safetensors", model)
    save_draft_head(DraftHead(dim + 8, 16), tmp_path / "wide.safetensors", {})
    with pytest.raises(ValueError, match=f"hidden size {dim + 8}"):
        load_draft_head(tmp_path / "wide.safetensors", model)
    with pytest.raises(ValueError, match="draft_head_path"):
        speculative.build_drafter(speculative.SpeculativeConfig(method="draft_head"), model, "cpu")
