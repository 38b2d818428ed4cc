"""The embedded rollout engine against step-by-step decoding through the full forward.

Each test compares two computations of the same math (the engine's cached steps against full
forwards, one engine layout against another, archon against HF): both run in float64 (fp64 models
inside `fp32_islands_in_fp64`), where what is left between them is float64 rounding and a greedy
argmax cannot flip on a near-tie that another CPU's fp32 arithmetic would round the other way."""

import dataclasses
import math

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine, sample_next_tokens

PROMPTS = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
# The largest log-prob difference measured between two computations here is 1.5e-14 (AVX-512, AVX2
# and scalar kernels alike).
LOGPROB_ATOL = 1e-10


pytestmark = pytest.mark.usefixtures("float64_math")  # every test compares in float64


def _full_forward_logits(model, ids):
    ids = torch.tensor(ids)
    return model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))


def _fp64_model(path, **build_kwargs):
    return build_model(path, dtype=torch.float64, **build_kwargs).model


def _lora_model(path):
    model = _fp64_model(path, lora=LoRAConfig(rank=4, alpha=8))
    randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(0))
    return model.eval()


def _assert_greedy_steps_match_full_forward(model, samples) -> None:
    """Every generated token is the argmax of a full forward over the tokens before it, with that
    forward's log-prob."""
    with torch.no_grad():
        for i, sample in enumerate(samples):
            ids = list(sample.prompt_ids)
            for step, (token, logprob) in enumerate(zip(sample.completion_ids, sample.logprobs)):
                logits = _full_forward_logits(model, ids)[-1]
                assert token == int(logits.argmax()), (i, step)
                expected = torch.log_softmax(logits, -1)[token]
                assert_close_reporting(logprob, expected, LOGPROB_ATOL, f"sample {i}, step {step}: log-prob")
                ids.append(token)


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_moe", "deepseek_v32", "glm_moe_dsa"])
def test_greedy_equals_stepwise_argmax(tiny_checkpoint, model_type):
    model = _lora_model(tiny_checkpoint(model_type))
    trainer = NativeRolloutEngine(model)
    samples = trainer.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, n=2))
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1, 2, 2]
    _assert_greedy_steps_match_full_forward(model, samples)
    for sample in samples:
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


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3",
        "qwen3_moe",
        "olmo3",
        "olmo2",
        "minimax_m2",
        "qwen3_next",
        "deepseek_v32",
        "glm_moe_dsa",
        "kimi_linear",
        "gemma3_text",
    ],
)
def test_greedy_equals_hf_generate(tiny_checkpoint, model_type):
    """Greedy tokens equal HF generate's, for groups of 2 sharing a prompt prefix in a table
    refilled as groups finish."""
    from transformers import AutoConfig

    from archon.tools.align import hf_model_class

    path = tiny_checkpoint(model_type)
    # HF's grouped-GEMM experts have no fp64 kernel; its eager experts loop over them
    hf_model = (
        hf_model_class(AutoConfig.from_pretrained(path))
        .from_pretrained(path, dtype=torch.float64, experts_implementation="eager")
        .eval()
    )
    engine = NativeRolloutEngine(_fp64_model(path), max_batch_sequences=4)
    samples = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0, n=2))
    for sample in samples:
        prompt = sample.prompt_ids
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=8,
                do_sample=False,
                attention_mask=torch.ones(1, len(prompt)),
                pad_token_id=0,
                eos_token_id=None,
            )
        assert sample.completion_ids == out[0, len(prompt) :].tolist(), (sample.prompt_index, sample.completion_ids)


def test_sampled_logprobs_are_the_truncated_distributions(tiny_checkpoint):
    """With top-k/top-p the reported log-prob is the behaviour policy's: truncated, renormalised."""
    model = _lora_model(tiny_checkpoint("qwen3"))
    trainer = NativeRolloutEngine(model)
    sampling = SamplingParams(max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=50, n=3, seed=1)
    samples = trainer.generate(PROMPTS, sampling)
    truncated_somewhere = False
    with torch.no_grad():
        for i, sample in enumerate(samples):
            ids = sample.prompt_ids + sample.completion_ids
            logits = _full_forward_logits(model, ids)[len(sample.prompt_ids) - 1 : -1]
            expected = [
                _truncated_logprob(row, 0.7, 50, 0.9, token) for row, token in zip(logits, sample.completion_ids)
            ]
            assert_close_reporting(sample.logprobs, expected, LOGPROB_ATOL, f"sample {i}: truncated log-probs")
            untruncated = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(sample.completion_ids)[:, None])[
                :, 0
            ]
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
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = {int(sample_next_tokens(logits, SamplingParams(top_k=2), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    # softmax([2, 1, .5, -1]) = [.61, .22, .14, .03]: top_p 0.7 keeps the first two tokens
    draws = {int(sample_next_tokens(logits, SamplingParams(top_p=0.7), g)[0]) for _ in range(200)}
    assert draws == {0, 1}
    token, logprob = sample_next_tokens(logits, SamplingParams(temperature=0), g)
    assert int(token) == 0
    assert_close_reporting(logprob, torch.log_softmax(logits, -1)[:, 0], 1e-15, "greedy log-prob")


def test_logprobs_equal_the_trainers(tiny_checkpoint):
    """Rollout log-probs equal Engine.logprobs on the same tokens (the old-policy recomputation)."""
    from archon.batch import PackedBatch
    from archon.trainer import Trainer, TrainerConfig

    config = TrainerConfig(
        model_path=str(tiny_checkpoint("qwen3_moe")), lora=LoRAConfig(rank=4, alpha=8), dtype="float64"
    )
    trainer = Trainer(config)
    randomise_lora(lora_parameters(trainer.model), 0.1)
    rollout = NativeRolloutEngine(trainer.model)
    samples = rollout.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0.8, n=2, seed=3))
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples], prompt_lens=[len(s.prompt_ids) for s in samples]
    )
    trainer_lp = trainer.logprobs(batch, temperature=0.8).logprobs[batch.loss_mask]
    rollout_lp = [lp for s in samples for lp in s.logprobs]
    assert_close_reporting(rollout_lp, trainer_lp, LOGPROB_ATOL, "completion tokens: rollout against trainer log-probs")


def _summary(samples):
    return [(s.prompt_index, s.completion_ids, s.finish_reason) for s in samples], [s.logprobs for s in samples]


def _assert_same_samples(got, expected):
    (got_tokens, got_lp), (exp_tokens, exp_lp) = _summary(got), _summary(expected)
    assert got_tokens == exp_tokens
    for i, (a, b) in enumerate(zip(got_lp, exp_lp)):
        assert_close_reporting(a, b, LOGPROB_ATOL, f"sample {i}: log-probs")


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_shared_prefix_equals_one_prefill_per_sample(tiny_checkpoint, model_type):
    """The G samples of a prompt read one prefill of it (a recurrent layer's state copied to each):
    the same tokens and log-probs as prefilling it once per sample, greedy and seeded sampling."""
    model = _lora_model(tiny_checkpoint(model_type))
    shared, unshared = NativeRolloutEngine(model), NativeRolloutEngine(model, share_prompt_prefix=False)
    for sampling in (
        SamplingParams(max_new_tokens=6, temperature=0, n=3),
        SamplingParams(max_new_tokens=6, temperature=1.0, top_p=0.95, n=3, seed=5),
    ):
        got = shared.generate(PROMPTS, sampling)
        _assert_same_samples(got, unshared.generate(PROMPTS, sampling))
    assert len({tuple(s.completion_ids) for s in got}) > 1  # the seeded samples of a group do differ


def test_continuous_batching_refills_finished_blocks(tiny_checkpoint):
    """With a table of 2 blocks for 6 prompts and a stop token that ends some groups at once, a
    finished block is refilled while the other decodes on: fewer decode steps than fixed batches of
    2 groups would take, and the same samples as one table holding every prompt."""
    model = _lora_model(tiny_checkpoint("qwen3"))
    greedy = SamplingParams(max_new_tokens=8, temperature=0, n=2)
    stop = NativeRolloutEngine(model).generate(PROMPTS[:1], greedy)[0].completion_ids[0]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0], [5, 6, 7, 8]]
    sampling = SamplingParams(max_new_tokens=8, temperature=0, n=2, stop_token_ids=(stop,))
    expected = NativeRolloutEngine(model).generate(prompts, sampling)
    group_lengths = [len(s.completion_ids) for s in expected[::2]]
    assert group_lengths[0] == 1 and max(group_lengths) == 8, group_lengths

    steps = []  # (tokens in the forward, whether it is a decode step)
    engine = NativeRolloutEngine(model, max_batch_sequences=4, stop_check_interval=1)
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: steps.append((args[0].numel(), kwargs["cache"].decoding)), with_kwargs=True
    )
    try:
        got = engine.generate(prompts, sampling)
    finally:
        hook.remove()
    _assert_same_samples(got, expected)
    decode_rows = [t for t, decoding in steps if decoding]
    assert max(decode_rows) <= 4  # never more rows than the table's 2 blocks x 2
    fixed_batches = sum(max(group_lengths[i : i + 2]) - 1 for i in range(0, len(group_lengths), 2))
    assert len(decode_rows) < fixed_batches, (len(decode_rows), fixed_batches)


def test_on_the_cpu_a_call_stops_when_its_samples_end(tiny_checkpoint):
    """On the CPU the done flags are read after every decode step (the default interval): a call
    whose samples all end at a stop token takes as many decode steps as its longest sample needs,
    where reading them every 8 steps runs to the length limit; the same tokens either way."""
    model = _lora_model(tiny_checkpoint("qwen3"))
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    plain = NativeRolloutEngine(model).generate(PROMPTS[:1], greedy)[0].completion_ids
    end = next(i for i in range(2, 8) if plain[i] not in plain[:i])  # a token the sample first emits there
    sampling = dataclasses.replace(greedy, stop_token_ids=(plain[end],))
    every_step, every_8 = NativeRolloutEngine(model), NativeRolloutEngine(model, stop_check_interval=8)
    assert every_step.stop_check_interval == 1
    got = every_step.generate(PROMPTS[:1], sampling)
    assert got[0].finish_reason == "stop" and got[0].completion_ids == plain[: end + 1], (got[0], plain)
    assert every_step.stats.decode_steps == end  # the first token comes from the prefill
    _assert_same_samples(every_8.generate(PROMPTS[:1], sampling), got)
    assert every_8.stats.decode_steps == 8


def test_sinks_and_sliding_windows_decode_equals_full_forward(tiny_checkpoint):
    """GPT-OSS: sink logits and a window of 3 (shorter than the prompts), over a shared prompt
    prefix and each sample's own tokens, give the full forward's greedy tokens and log-probs."""
    model = _fp64_model(
        tiny_checkpoint(
            "gpt_oss",
            num_hidden_layers=3,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            sliding_window=3,
            num_key_value_heads=1,
        )
    ).eval()
    samples = NativeRolloutEngine(model).generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=0, n=2))
    _assert_greedy_steps_match_full_forward(model, samples)


def test_fsdp_and_tp_ranks_stay_in_lockstep(tiny_checkpoint, tmp_path):
    """Under FSDP x2 (ranks with different prompts, one with none; a multi-turn episode with kept
    sessions) and TP x2, each rank's samples equal one process's, with blocks refilled at different
    times on each rank."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    worker = Path(__file__).parent / "native_rollout_worker.py"
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(worker),
        str(out),
        str(tiny_checkpoint("qwen3")),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    for rank, results in enumerate(json.loads(out.read_text())):
        for layout, figures in results.items():
            assert figures["tokens_equal"], f"rank {rank}, {layout}: tokens differ ({figures})"
            assert figures["logprob_max_abs"] <= LOGPROB_ATOL, (
                f"rank {rank}, {layout}: {figures} against atol {LOGPROB_ATOL}"
            )
    assert json.loads(out.read_text())[1]["fsdp2_one_rank_idle"]["samples"] == 0
    assert all(results["fsdp2_sessions"]["reused_tokens"] > 0 for results in json.loads(out.read_text()))


def test_static_decode_shapes_equal_the_eager_step(tiny_checkpoint):
    """The decode step CUDA graphs capture (every row of the table, the whole cache read under
    masks, one shape for every step) gives the eager step's greedy samples, with blocks refilled;
    off CUDA the engine decodes eagerly whatever cuda_graphs says."""
    from archon.rollout.native import _Generation, _Group

    model = _lora_model(tiny_checkpoint("qwen3"))
    stop = NativeRolloutEngine(model).generate(PROMPTS[:1], SamplingParams(max_new_tokens=3, temperature=0))[0]
    sampling = SamplingParams(max_new_tokens=6, temperature=0, n=2, stop_token_ids=(stop.completion_ids[1],))
    groups = [_Group(i, p, 2) for i, p in enumerate(PROMPTS)]
    engine = NativeRolloutEngine(model, max_batch_sequences=4, stop_check_interval=1)
    runs = []
    for static in (False, True):
        generation = _Generation(engine, groups, sampling, None)
        assert not generation.static_decode  # CPU
        generation.static_decode = static
        with torch.no_grad():
            runs.append(generation.run())
    _assert_same_samples(runs[1], runs[0])


def test_rollout_benchmark_quick_mode(monkeypatch):
    """benchmarks/rollout.py on a tiny model: it runs, HF's greedy tokens equal the native engine's
    (the script fails otherwise), and it reports every case, the shared/unshared pair and the engine
    without prepacked linears."""
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
        engines = ("native", "hf", "native_unpacked")
        report = bench.main(bench.BenchArgs(quick=True, engines=engines, repeats=1, threads=1))
    finally:
        torch.set_num_threads(threads)
    rows = {(r["case"], r["engine"]) for r in report["rows"]}
    assert rows == {(c, e) for c in ("greedy", "sampled", "long") for e in engines} | {
        ("sampled", "native_unshared"),
        ("long", "native_unshared"),
    }
    assert all("prepacking_speedup" in comparison["ratios"] for comparison in report["comparisons"].values())
    assert all(r["tokens_per_s"] > 0 and r["of_bandwidth_limit"] > 0 for r in report["rows"])


def test_groups_larger_than_the_table_are_refused_or_split(tiny_checkpoint):
    """A prompt's n samples share one prefix slot, so n > max_batch_sequences is a clear error rather
    than a table larger than asked for (on every rank alike, prompts or none: ranks in lockstep
    fail together); without prefix sharing each sample is its own block and the table keeps its
    size."""
    model = _lora_model(tiny_checkpoint("qwen3"))
    sampling = SamplingParams(max_new_tokens=3, temperature=0, n=3)
    with pytest.raises(ValueError, match=r"sampling.n=3 exceeds max_batch_sequences=2"):
        NativeRolloutEngine(model, max_batch_sequences=2).generate(PROMPTS, sampling)
    rows = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(args[0].numel()) if kwargs["cache"].decoding else None, with_kwargs=True
    )
    try:
        got = NativeRolloutEngine(model, max_batch_sequences=2, share_prompt_prefix=False).generate(PROMPTS, sampling)
    finally:
        hook.remove()
    assert max(rows) <= 2
    _assert_same_samples(got, NativeRolloutEngine(model).generate(PROMPTS, sampling))
    with pytest.raises(ValueError, match=r"sampling.n=3 exceeds max_batch_sequences=2"):
        NativeRolloutEngine(model, max_batch_sequences=2).generate([], sampling)
    assert NativeRolloutEngine(model, max_batch_sequences=3).generate([], sampling) == []


class _EngineWithABusierPeer(NativeRolloutEngine):
    """What the round agreement reports when another rank of the sync group still has a prompt to
    prefill and two decode steps to run after this rank is done."""

    peer_done = False

    def _agree(self, prefill_forwards, decode_steps, unfinished):
        if not unfinished and not self.peer_done:
            self.peer_done = True
            return 1, 2, 1
        return prefill_forwards, decode_steps, unfinished


def test_idle_forwards_of_a_multi_task_model(tiny_checkpoint):
    """A rank with nothing left to do runs one-token forwards while a peer prefills and decodes;
    on a multi-task model those forwards too route their token to an adapter. The rank's samples
    are those it generates alone."""
    model = _fp64_model(
        tiny_checkpoint("qwen3"), task_loras={"a": LoRAConfig(rank=4, alpha=8), "b": LoRAConfig(rank=2, alpha=2)}
    )
    randomise_lora(lora_parameters(model), 0.2)
    sampling = SamplingParams(max_new_tokens=4, temperature=0, n=2)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        alone = NativeRolloutEngine(model).generate(PROMPTS, sampling, adapters=[0, 1, 1])
        alone_forwards = len(forwards)
        got = _EngineWithABusierPeer(model).generate(PROMPTS, sampling, adapters=[0, 1, 1])
    finally:
        hook.remove()
    _assert_same_samples(got, alone)
    assert len(forwards) - alone_forwards == alone_forwards + 3  # one idle prefill, two idle decode steps


@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5_text", "glm_moe_dsa"])
def test_rows_start_new_samples_as_soon_as_theirs_end(tiny_checkpoint, model_type):
    """Seeded samples of two tasks (each sample draws its noise from its own generator, whatever row
    and step it runs in) with stop tokens that end some samples of a group early: in a table of one
    group's rows, a row whose sample ended starts the next one at once, so the generation takes fewer
    decode steps than refilling the table group by group would (each group for as many steps as its
    longest sample), and the samples are those of a table holding every sample at once."""
    task_loras = {"a": LoRAConfig(rank=4, alpha=8), "b": LoRAConfig(rank=2, alpha=2)}
    model = _fp64_model(tiny_checkpoint(model_type), task_loras=task_loras)
    randomise_lora(lora_parameters(model), 0.2)
    prompts = PROMPTS + [[5, 6, 7, 8], [60, 61], [9, 9, 9]]
    adapters = [0, 1, 0, 1, 1, 0]
    free = SamplingParams(max_new_tokens=8, temperature=1.0, n=4, seed=3)
    drawn = [
        t for s in NativeRolloutEngine(model).generate(prompts, free, adapters=adapters) for t in s.completion_ids[1:]
    ]
    stops = torch.bincount(torch.tensor(drawn)).topk(8).indices  # the 8 tokens drawn most often
    sampling = dataclasses.replace(free, stop_token_ids=tuple(stops.tolist()))

    expected = NativeRolloutEngine(model).generate(prompts, sampling, adapters=adapters)  # one row per sample
    lengths = [len(s.completion_ids) for s in expected]
    groups = [lengths[i : i + 4] for i in range(0, len(lengths), 4)]
    assert any(min(g) < max(g) for g in groups), groups  # some samples end before their group's last

    rows = []
    hook = model.register_forward_pre_hook(
        lambda _, args, kwargs: rows.append(args[0].numel()) if kwargs["cache"].decoding else None, with_kwargs=True
    )
    engine = NativeRolloutEngine(model, max_batch_sequences=4, stop_check_interval=1)
    try:
        got = engine.generate(prompts, sampling, adapters=adapters)
    finally:
        hook.remove()
    _assert_same_samples(got, expected)
    assert max(rows) <= 4 and engine.stats.decode_steps == len(rows)
    group_by_group = sum(max(g) - 1 for g in groups)
    assert engine.stats.decode_steps < group_by_group, (engine.stats.decode_steps, group_by_group)
