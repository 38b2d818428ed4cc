"""Speculative decoding in the embedded engine (archon/rollout/speculative.py): greedy output equals
plain greedy decoding token for token, sampled output follows the target's distribution (a
chi-square test, which fails once the rejection step is broken), and the log-probs are the target's.

The equalities (speculative against plain greedy decoding, rollout log-probs against the trainer's,
drafts against the MTP layer over the whole sequence) run fp64 models inside
`fp32_islands_in_fp64`: what is left between the two sides is float64 rounding, and no argmax flips
on a near-tie that another CPU's fp32 arithmetic would round the other way."""

import pytest
import torch
from helpers import assert_close_reporting

from archon.build import build_model
from archon.lora import LoRAConfig
from archon.rollout import speculative
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, truncated_logprobs
from archon.rollout.speculative import DraftModelDrafter

PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
LOGPROB_ATOL = 1e-10  # measured at most 6.7e-15


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _model(path, **build_kwargs):
    return build_model(path, dtype=torch.float64, **build_kwargs).model.eval()


def _assert_same(got, expected):
    assert [(s.prompt_index, s.completion_ids, s.finish_reason) for s in got] == [
        (s.prompt_index, s.completion_ids, s.finish_reason) for s in expected
    ]
    for i, (a, b) in enumerate(zip(got, expected)):
        assert_close_reporting(a.logprobs, b.logprobs, LOGPROB_ATOL, f"sample {i} (prompt {a.prompt_index}): log-probs")


@pytest.mark.parametrize("model_type", ["qwen3", "deepseek_v3", "gpt_oss"])
def test_greedy_equals_plain_greedy(tiny_checkpoint, model_type):
    """With a draft model that is mostly wrong (another random model) and one that is always right
    (the target itself: every draft accepted), for 1 and 3 draft tokens, with stop tokens."""
    target = _model(tiny_checkpoint(model_type, seed=0))
    other = _model(tiny_checkpoint(model_type, seed=1))
    sampling = SamplingParams(max_new_tokens=10, temperature=0, n=2)
    plain = NativeRolloutEngine(target, max_batch_sequences=4).generate(PROMPTS, sampling)
    stop = plain[2].completion_ids[4]  # a token some sample emits mid-completion
    stopping = SamplingParams(max_new_tokens=10, temperature=0, n=2, stop_token_ids=(stop,))
    plain_stopping = NativeRolloutEngine(target, max_batch_sequences=4).generate(PROMPTS, stopping)
    assert any(s.finish_reason == "stop" for s in plain_stopping)
    for draft in (other, target):
        for k in (1, 3):
            engine = NativeRolloutEngine(target, max_batch_sequences=4, drafter=DraftModelDrafter(draft, k))
            _assert_same(engine.generate(PROMPTS, sampling), plain)
            stats = engine.stats
            assert stats.speculative_proposed > 0
            if draft is target:
                assert stats.speculative_accepted == stats.speculative_proposed
                # k + 1 tokens a round: the 9 decoded tokens of a sample in ceil(9 / (k + 1)) rounds
                assert stats.decode_steps <= 2 * -(-9 // (k + 1))
            else:
                assert stats.speculative_accepted < stats.speculative_proposed / 2
            _assert_same(engine.generate(PROMPTS, stopping), plain_stopping)


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


def _sampled_pair_test(target, draft, sampling, prompt, samples):
    """The p-value of the joint distribution of completion tokens 1 and 2 (the first round's
    emitted tokens; token 0 comes from the prefill) against the target's exact one."""
    V = target.output_weight.shape[0]
    engine = NativeRolloutEngine(target, max_batch_sequences=512, drafter=DraftModelDrafter(draft, 2))
    got = engine.generate([prompt] * (samples // sampling.n), sampling)
    with torch.no_grad():

        def dist(ids):
            ids_t = torch.tensor(ids)
            logits = target(ids_t, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))[-1:]
            return truncated_logprobs(logits, sampling)[0].exp().double()

        first = dist(prompt)
        exact = torch.zeros(V, V, V, dtype=torch.float64)
        for a in first.nonzero()[:, 0].tolist():
            second = dist(prompt + [a])
            for b in second.nonzero()[:, 0].tolist():
                exact[a, b] = first[a] * second[b] * dist(prompt + [a, b])
    pairs = exact.sum(dim=0).flatten()  # the marginal of (token 1, token 2)
    counts = torch.zeros(V * V)
    for s in got:
        counts[s.completion_ids[1] * V + s.completion_ids[2]] += 1
    return _chi_square_p_value(counts, pairs), engine.stats


def test_sampled_tokens_follow_the_target_distribution(tiny_checkpoint, monkeypatch):
    """4000 samples of tokens 1 and 2 over a vocabulary of 8 (temperature and top-k processed);
    accepting every draft instead of min(1, p/q) makes the same test fail. (A statistical test, not
    an equality: fp32 models, as served.)"""
    target = build_model(tiny_checkpoint("qwen3", seed=0, vocab_size=8)).model.eval()
    draft = build_model(tiny_checkpoint("qwen3", seed=1, vocab_size=8)).model.eval()
    sampling = SamplingParams(max_new_tokens=3, temperature=0.9, top_k=6, n=8, seed=0)
    p_value, stats = _sampled_pair_test(target, draft, sampling, [1, 2, 3], 4000)
    assert p_value > 1e-3
    assert 0.2 < stats.speculative_accepted / stats.speculative_proposed < 0.9  # both branches are exercised

    real = speculative.accept_sampled

    def accept_always(target_logprobs, drafts, draft_probs, accept_noise, correction_noise):
        return real(target_logprobs, drafts, draft_probs, torch.full_like(accept_noise, float("inf")), correction_noise)

    monkeypatch.setattr("archon.rollout.decode.accept_sampled", accept_always)
    broken, _ = _sampled_pair_test(target, draft, sampling, [1, 2, 3], 4000)
    assert broken < 1e-3


def test_logprobs_equal_the_trainers(tiny_checkpoint):
    """Every emitted token's rollout log-prob (drafted and accepted, or the target's own) is the
    trainer's log-prob of it, not the drafter's."""
    from helpers import randomise_lora

    from archon.batch import PackedBatch
    from archon.lora import lora_parameters
    from archon.trainer import Trainer, TrainerConfig

    config = TrainerConfig(
        model_path=str(tiny_checkpoint("deepseek_v3")), lora=LoRAConfig(rank=4, alpha=8), dtype="float64"
    )
    trainer = Trainer(config)
    randomise_lora(lora_parameters(trainer.model), 0.1)
    # a draft the target accepts often: the same weights without their LoRA factors
    draft = _model(tiny_checkpoint("deepseek_v3"))
    engine = NativeRolloutEngine(trainer.model, drafter=DraftModelDrafter(draft, 3))
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.8, n=2, seed=3))
    assert 0 < engine.stats.speculative_accepted < engine.stats.speculative_proposed
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    expected = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout_lp = [lp for s in samples for lp in s.logprobs]
    assert_close_reporting(rollout_lp, expected, LOGPROB_ATOL, "completion tokens: rollout against trainer log-probs")


def test_tasks_sessions_and_chunked_prefill(tiny_checkpoint):
    """Greedy speculative decoding equals plain greedy decoding on a two-task model (the draft: the
    model itself, each row with its task's adapter), with chunked prefill and kept sessions over two
    turns; a seeded sampled generation is reproducible."""
    from helpers import randomise_lora

    from archon.lora import lora_parameters

    model = _model(
        tiny_checkpoint("qwen3"), task_loras={"a": LoRAConfig(rank=4, alpha=8), "b": LoRAConfig(rank=2, alpha=2)}
    )
    randomise_lora(lora_parameters(model), 0.2)
    other = _model(tiny_checkpoint("qwen3", seed=1))
    greedy = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    keys = [f"s{i}" for i in range(6)]

    def two_turns(engine):
        first = engine.generate(PROMPTS, greedy, adapters=[0, 1, 1], sessions=keys)
        follow_ups = [s.prompt_ids + s.completion_ids + [5, 6] for s in first[::2]]
        return first, engine.generate(follow_ups, greedy, adapters=[0, 1, 1], sessions=keys)

    plain = NativeRolloutEngine(model, max_batch_sequences=4, prefill_chunk_tokens=4)
    expected = two_turns(plain)
    assert plain.stats.reused_tokens > 0
    for draft in (model, other):
        engine = NativeRolloutEngine(
            model, max_batch_sequences=4, prefill_chunk_tokens=4, drafter=DraftModelDrafter(draft, 2)
        )
        got = two_turns(engine)
        for g, e in zip(got, expected):
            _assert_same(g, e)
        assert engine.stats.reused_tokens == plain.stats.reused_tokens
        accepted_all = engine.stats.speculative_accepted == engine.stats.speculative_proposed
        assert accepted_all == (draft is model)
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, n=2, seed=5)
    engine = NativeRolloutEngine(model, max_batch_sequences=4, drafter=DraftModelDrafter(other, 2))
    once = engine.generate(PROMPTS, sampled, adapters=[0, 1, 1])
    _assert_same(engine.generate(PROMPTS, sampled, adapters=[0, 1, 1]), once)


def test_generations_above_max_rows_decode_one_token_per_step(tiny_checkpoint):
    """speculative_max_rows: a generation of more rows than it (prompts times samples) runs plain
    decode steps, no drafts proposed; one of at most that many speculates; the tokens and log-probs
    are plain decoding's either way."""
    from archon.rollout.speculative import SpeculativeConfig

    target = _model(tiny_checkpoint("qwen3", seed=0))
    sampling = SamplingParams(max_new_tokens=6, temperature=0, n=2)
    plain = NativeRolloutEngine(target).generate(PROMPTS, sampling)
    engine = NativeRolloutEngine(target, drafter=DraftModelDrafter(target, 2), speculative_max_rows=4)
    _assert_same(engine.generate(PROMPTS, sampling), plain)  # 3 prompts x 2 samples: 6 rows
    assert engine.stats.speculative_proposed == 0 and engine.stats.decode_steps == 5
    _assert_same(engine.generate(PROMPTS[:2], sampling), [s for s in plain if s.prompt_index < 2])  # 4 rows
    assert engine.stats.speculative_proposed > 0
    with pytest.raises(ValueError, match="speculative_max_rows must be >= 1"):
        NativeRolloutEngine(target, drafter=DraftModelDrafter(target, 2), speculative_max_rows=0)
    with pytest.raises(ValueError, match="rollout.speculative.max_rows must be >= 1"):
        SpeculativeConfig(method="draft_model", max_rows=0)


def test_sessions_continue_in_generations_the_mtp_drafter_sits_out(deepseek_mtp):
    """An MTP drafter's entries come from the prefill of whole prompts, so a generation that drafts
    continues no kept session; one past speculative_max_rows decodes plainly and continues them."""
    from archon.rollout.speculative import MTPDrafter

    model = _model(deepseek_mtp, mtp=True)
    greedy = SamplingParams(max_new_tokens=4, temperature=0)
    keys = ["a", "b", "c"]
    for limit, reused in ((3, False), (2, True)):  # the 3 prompts are 3 rows
        engine = NativeRolloutEngine(model, drafter=MTPDrafter(model, 2), speculative_max_rows=limit)
        first = engine.generate(PROMPTS, greedy, sessions=keys)
        follow_ups = [p + s.completion_ids + [5] for p, s in zip(PROMPTS, first)]
        engine.generate(follow_ups, greedy, sessions=keys)
        assert (engine.stats.reused_tokens > 0) == reused, (limit, engine.stats.reused_tokens)
        assert (engine.stats.speculative_proposed > 0) == (not reused)


def test_refused_where_it_cannot_run(tiny_checkpoint):
    model = _model(tiny_checkpoint("qwen3_moe"))
    with pytest.raises(ValueError, match="routing"):
        NativeRolloutEngine(model, record_routing=True, drafter=DraftModelDrafter(model, 2))
    with pytest.raises(ValueError, match="one process"):
        NativeRolloutEngine(model, sync_group=object(), drafter=DraftModelDrafter(model, 2))
    with pytest.raises(ValueError, match="num_tokens"):
        DraftModelDrafter(model, 0)


def test_rl_run_with_a_draft_model(tmp_path):
    """The RL loop with rollout.speculative (the policy's own base checkpoint as its draft model):
    it trains, and logs the acceptance rate of each step (every draft accepted at the first step,
    whose adapter is still zero)."""
    import json

    from test_grpo_recipe import _args, write_tiny_setup

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun

    root = write_tiny_setup(tmp_path / "setup")
    args = _args(root, tmp_path / "run", steps=2) + [
        "--rollout.speculative.method",
        "draft_model",
        "--rollout.speculative.num-tokens",
        "2",
        "--rollout.speculative.draft-model-path",
        str(root / "model"),
    ]
    run = RLRun(parse_config(args))
    assert run.native.drafter is not None
    run.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rates = [r["speculative_acceptance"] for r in records[1:]]
    assert rates[0] == 1.0 and all(0 <= rate <= 1 for rate in rates)

    # rollout.speculative.max_rows below the step's batch: plain decoding, no acceptance logged
    limited = _args(root, tmp_path / "limited", steps=1) + args[-6:] + ["--rollout.speculative.max-rows", "1"]
    run = RLRun(parse_config(limited))
    assert run.native.speculative_max_rows == 1
    run.run()
    records = [json.loads(line) for line in (tmp_path / "limited" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) > 1 and not any("speculative_acceptance" in r for r in records)


@pytest.fixture(scope="module")
def deepseek_mtp(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint with one (random) MTP layer."""
    from helpers import add_mtp_weights

    from archon.tools.align import make_tiny_hf_checkpoint

    path = make_tiny_hf_checkpoint("deepseek_v3", tmp_path_factory.mktemp("deepseek_v3_mtp") / "hf", seed=0)
    return add_mtp_weights(path, "num_nextn_predict_layers")


def _mtp_oracle_drafts(model, sequence: list[int], k: int) -> list[int]:
    """The k tokens the MTP layer drafts after `sequence`, from whole-sequence forwards without a
    cache (model.mtp_logits): depth 0 pairs the target's hidden state at each position with the next
    token; a chained depth replaces the last entry's pair by the previous depth's hidden state and
    draft, one position further."""
    T = len(sequence)
    tokens = torch.tensor(sequence)
    hidden = model(tokens, torch.arange(T), torch.tensor([0, T]), T, return_hidden=True)
    entries_hidden, entries_next = hidden[: T - 1], tokens[1:]  # entries 0..T-2: (h_t, x_{t+1})
    drafts = []
    for _ in range(k):
        n = entries_hidden.shape[0]
        logits, out = model.mtp_logits(entries_hidden, entries_next, torch.arange(n), torch.tensor([0, n]), n)
        drafts.append(int(logits[-1].argmax()))
        entries_hidden = torch.cat([entries_hidden, out[-1:]])
        entries_next = torch.cat([entries_next, torch.tensor(drafts[-1:])])
    return drafts


def _near_bigram(model, scale: float) -> None:
    """Make the MTP layer often right: the decoder blocks' outputs (the target's and the MTP
    layer's) scaled by `scale`, so the target's next token depends mostly on the current one, and
    the MTP layer made to apply the target's own last norm and head to the next token's embedding,
    so it predicts the token after next as the target would."""
    layer = model.mtp[0]
    dim = layer.norm.weight.shape[0]
    with torch.no_grad():
        for block in [*model.layers, layer.block]:
            for name, param in block.named_parameters():
                if name.endswith(("o_proj.weight", "down_proj", "down_proj.weight")):
                    param.mul_(scale)
        layer.projection.weight.zero_()
        layer.projection.weight[:, :dim] = torch.eye(dim)
        layer.embedding_norm.weight.fill_(1.0)
        layer.norm.weight.copy_(model.norm.weight)


def test_mtp_drafter(deepseek_mtp):
    """The MTP drafter (DeepSeek-V3's MTP layer): greedy output equals plain greedy decoding, and
    every round's drafts are those of the MTP layer run over the whole sequence without a cache
    (k = 1 and a chained k = 3, with chunked prefill and rows that start samples mid-generation),
    on a model whose MTP layer is often right (some drafts accepted, some not)."""
    from archon.rollout.speculative import MTPDrafter

    model = _model(deepseek_mtp, mtp=True)
    assert len(model.mtp) == 1
    _near_bigram(model, 0.05)
    sampling = SamplingParams(max_new_tokens=8, temperature=0, n=2)
    plain = NativeRolloutEngine(model, max_batch_sequences=4).generate(PROMPTS, sampling)
    for k in (1, 3):
        drafter = MTPDrafter(model, k)
        rounds = []
        propose = drafter.propose

        def recording(tokens, ngen, *args, **kwargs):
            drafts, probs = propose(tokens, ngen, *args, **kwargs)
            rounds.append((tokens.clone(), ngen.clone(), args[0].clone(), ~args[1], drafts.clone()))
            return drafts, probs

        drafter.propose = recording
        engine = NativeRolloutEngine(model, max_batch_sequences=4, prefill_chunk_tokens=4, drafter=drafter)
        got = engine.generate(PROMPTS, sampling)
        _assert_same(got, plain)
        assert 0.2 < engine.stats.speculative_accepted / engine.stats.speculative_proposed < 0.9
        checked = 0
        with torch.no_grad():
            for tokens, ngen, prompt_lens, done, drafts in rounds:
                for row in (~done).nonzero()[:, 0].tolist():
                    # the row's prompt: the sample whose completion starts with its tokens
                    generated = tokens[row, : int(ngen[row])].tolist()
                    prompt = next(
                        s.prompt_ids
                        for s in got
                        if s.completion_ids[: len(generated)] == generated
                        and len(s.prompt_ids) == int(prompt_lens[row])
                    )
                    assert drafts[row].tolist() == _mtp_oracle_drafts(model, prompt + generated, k)
                    checked += 1
        assert checked >= 8
    with pytest.raises(ValueError, match="multi-token-prediction"):
        MTPDrafter(_model(deepseek_mtp), 2)


def test_mtp_drafter_from_the_config_and_trainer_logprobs(deepseek_mtp):
    """rollout.speculative.method=mtp on a Trainer built with its MTP layers: sampled tokens' log-probs
    equal the trainer's (with a LoRA adapter on the target; the MTP layer has none)."""
    from helpers import randomise_lora

    from archon.batch import PackedBatch
    from archon.lora import lora_parameters
    from archon.rollout.speculative import MTPDrafter, SpeculativeConfig, build_drafter
    from archon.trainer import Trainer, TrainerConfig

    lora = LoRAConfig(rank=4, alpha=8, experts=False)
    trainer = Trainer(TrainerConfig(model_path=str(deepseek_mtp), lora=lora, mtp=True, dtype="float64"))
    _near_bigram(trainer.model, 0.05)
    randomise_lora(lora_parameters(trainer.model), 0.02)
    drafter = build_drafter(SpeculativeConfig(method="mtp", num_tokens=2), trainer.model, trainer.device)
    assert isinstance(drafter, MTPDrafter)
    engine = NativeRolloutEngine(trainer.model, drafter=drafter)
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.7, n=2, seed=1))
    assert 0 < engine.stats.speculative_accepted < engine.stats.speculative_proposed
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    expected = trainer.logprobs(batch, temperature=0.7).logprobs[batch.loss_mask]
    rollout_lp = [lp for s in samples for lp in s.logprobs]
    assert_close_reporting(rollout_lp, expected, LOGPROB_ATOL, "completion tokens: rollout against trainer log-probs")


def test_rollout_benchmark_speculative_cases(monkeypatch):
    """benchmarks/rollout.py --cases speculative --quick: every case runs with each drafter (the
    greedy tokens with either drafter equal those without: the script fails otherwise)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "rollout.py"
    spec = importlib.util.spec_from_file_location("rollout_benchmark", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        report = bench.main(bench.BenchArgs(quick=True, cases=("speculative",), repeats=1, threads=1))
    finally:
        torch.set_num_threads(threads)
    rows = {(r["case"], r["drafter"]) for r in report["rows"]}
    assert rows == {
        (f"speculative_{c}", d)
        for c in ("greedy_b1", "greedy_b8", "sampled_b1", "sampled_b8")
        for d in ("off", "mtp", "draft_model")
    }
    assert all(r["tokens_per_s"] > 0 for r in report["rows"])
    assert all(0 <= r["acceptance"] <= 1 for r in report["rows"] if r["drafter"] != "off")


def test_rl_run_with_the_mtp_drafter(tmp_path):
    """The RL loop with rollout.speculative.method=mtp on a DeepSeek-V3 checkpoint with an MTP layer
    (model.mtp=auto loads it), trained beside the policy (algorithm.mtp_loss_weight): the engine drafts
    with the layer and each step logs its acceptance rate."""
    import json

    from helpers import add_mtp_weights
    from test_grpo_recipe import _args

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, build_char_tokenizer, write_jsonl
    from archon.rollout.speculative import MTPDrafter
    from archon.tools.align import make_tiny_hf_checkpoint

    tokenizer = build_char_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        "deepseek_v3", tmp_path / "model", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id
    )
    add_mtp_weights(model_dir, "num_nextn_predict_layers")
    tokenizer.save_pretrained(model_dir)
    train, held_out = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=16, num_held_out=4))
    write_jsonl(train, tmp_path / "train.jsonl")
    write_jsonl(held_out, tmp_path / "held_out.jsonl")
    args = _args(tmp_path, tmp_path / "run", steps=2) + [
        "--rollout.speculative.method",
        "mtp",
        "--rollout.speculative.num-tokens",
        "2",
        "--algorithm.mtp-loss-weight",
        "1.0",
        "--lora.no-experts",
    ]
    run = RLRun(parse_config(args))
    assert isinstance(run.native.drafter, MTPDrafter)
    run.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 <= r["speculative_acceptance"] <= 1 for r in records[1:])
    assert all("mtp_loss" in r for r in records[1:])
