"""Single-process engine tests: the chunked log-prob head, scoring, micro-batch normalisation,
full-parameter training, LR schedule, packed batches.

The comparisons of two computations of the same math (the chunked head against full logits, the
trainer's log-probs against a full forward, micro-batches against the whole batch) run in float64
inside `fp32_islands_in_fp64`, where what is left between the two sides is float64 rounding."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora
from memory_tracking import PeakAllocated

from archon.batch import PackedBatch
from archon.build import build_model
from archon.head import label_logprobs
from archon.lora import LoRAConfig, is_lora_param, lora_parameters
from archon.optim import OptimConfig, lr_multiplier
from archon.parallel.grad import clip_grad_norm, grad_norm
from archon.rl.losses import aggregate_token_losses
from archon.trainer import LossContext, NonFiniteError, Trainer, TrainerConfig


def _batch(vocab: int, lens=(9, 17, 4, 23, 12), prompt_lens=(3, 5, 1, 8, 2), seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    adv = torch.randn(len(lens), generator=g).tolist()
    return PackedBatch.from_sequences(seqs, prompt_lens=prompt_lens, advantages=adv)


def _engine(path, lora=LoRAConfig(rank=4, alpha=8.0), **kw) -> Trainer:
    kw.setdefault("optim", OptimConfig(lr=1e-2))
    return Trainer(TrainerConfig(str(path), lora=lora, device="cpu", **kw))


FP64_TOL = 1e-10
"""Absolute tolerance of log-probs, entropies, losses and gradients compared in float64; the largest
difference measured is 1.1e-14 (a gradient of the chunked head)."""


def _reference_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float):
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    lp = log_p.gather(-1, labels[:, None])[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)
    return lp, entropy


# ---- chunked head -------------------------------------------------------------------------------


@pytest.mark.parametrize("train_weight", [False, True], ids=["frozen-unembedding", "trained-unembedding"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_matches_full_logits(temperature, train_weight, float64_math):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = (torch.randn(50, 16, generator=g, dtype=torch.float64) / 2).requires_grad_(train_weight)
    labels = torch.randint(0, 50, (37,), generator=g)
    w_lp, w_ent = torch.randn(37, generator=g, dtype=torch.float64), torch.randn(37, generator=g, dtype=torch.float64)

    lp, ent = label_logprobs(hidden, weight, labels, temperature, chunk_size=8, with_entropy=True)
    (lp * w_lp + ent * w_ent).sum().backward()

    h64, w64 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref_lp, ref_ent = _reference_logprobs(h64 @ w64.t(), labels, temperature)
    (ref_lp * w_lp + ref_ent * w_ent).sum().backward()
    assert_close_reporting(lp, ref_lp.detach(), FP64_TOL, "label log-probs")
    assert_close_reporting(ent, ref_ent.detach(), FP64_TOL, "entropies")
    pairs = [("hidden", hidden.grad, h64.grad)] + ([("unembedding", weight.grad, w64.grad)] if train_weight else [])
    for name, got, want in pairs:
        assert got.dtype == torch.float64, name
        assert_close_reporting(got, want, FP64_TOL, f"gradient of the {name}")
    assert train_weight or weight.grad is None


def _peak_bytes(T: int, V: int, D: int, chunked: bool) -> int:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(T, D, generator=g, requires_grad=True)
    weight = torch.randn(V, D, generator=g) / math.sqrt(D)
    labels = torch.randint(0, V, (T,), generator=g)
    with PeakAllocated() as tracker:
        if chunked:
            lp, _ = label_logprobs(hidden, weight, labels, chunk_size=256)
        else:
            lp = torch.log_softmax((hidden @ weight.t()).float(), -1).gather(-1, labels[:, None])[:, 0]
        lp.sum().backward()
    return tracker.peak


def test_chunked_head_peak_memory_is_bounded_as_tokens_grow():
    V, D = 4096, 32
    small, large = _peak_bytes(512, V, D, True), _peak_bytes(4096, V, D, True)
    full_logits_bytes = 4096 * V * 4
    # What grows with T is O(T x D) (the hidden-state gradient, per-token vectors), not O(T x V).
    assert large <= small + 4096 * D * 4 * 4, (small, large)
    assert large < full_logits_bytes / 4, (large, full_logits_bytes)
    # The tracker does see a full [T, V] logits tensor when one is made.
    assert _peak_bytes(4096, V, D, False) >= full_logits_bytes


def test_head_rejects_bad_arguments():
    h, w, y = torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long)
    with pytest.raises(ValueError, match="temperature"):
        label_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        label_logprobs(h, w, y, chunk_size=0)


# ---- scoring --------------------------------------------------------------------------------------


def test_logprobs_match_full_forward(qwen3_path, float64_math):
    trainer = _engine(qwen3_path, micro_batch_tokens=30, head_chunk_size=7, dtype="float64")
    randomise_lora(lora_parameters(trainer.model), 0.2)
    batch = _batch(trainer.loaded.args.vocab_size)
    out = trainer.logprobs(batch, temperature=0.8, with_entropy=True)
    with torch.no_grad():
        logits = trainer.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
    ref_lp, ref_ent = _reference_logprobs(logits, batch.labels, 0.8)
    mask = batch.loss_mask
    assert_close_reporting(out.logprobs[mask], ref_lp[mask], FP64_TOL, "completion tokens: log-probs")
    assert_close_reporting(out.entropy[mask], ref_ent[mask], FP64_TOL, "completion tokens: entropies")
    assert bool((out.logprobs[~mask] == 0).all()) and bool((out.entropy[~mask] == 0).all())


def test_adapter_off_scores_the_base_model(qwen3_path, float64_math):
    trainer = _engine(qwen3_path, dtype="float64")
    randomise_lora(lora_parameters(trainer.model), 0.2)
    base = _engine(qwen3_path, lora=None, dtype="float64")
    batch = _batch(trainer.loaded.args.vocab_size)
    reference = trainer.logprobs(batch, use_adapter=False).logprobs
    policy = trainer.logprobs(batch).logprobs
    assert_close_reporting(
        reference, base.logprobs(batch).logprobs, FP64_TOL, "log-probs, adapter off against the base model"
    )
    assert (policy - reference).abs().max() > 1e-3  # the adapter is back on afterwards
    with pytest.raises(ValueError, match="use_adapter=False needs a LoRA model"):
        base.logprobs(batch, use_adapter=False)


# ---- training -------------------------------------------------------------------------------------


def _aggregation_loss(aggregation: str):
    def loss_fn(batch, logprobs, ctx):
        loss = aggregate_token_losses(
            -logprobs * batch.advantages,
            batch.loss_mask,
            batch.cu_seqlens,
            aggregation,
            ctx,
            max_response_length=20,
        )
        return loss, {"lp_mean": logprobs.detach().sum() / batch.loss_mask.sum()}

    return loss_fn


@pytest.fixture(scope="module")
def engines_by_budget(qwen3_path):
    """Engines with the same non-zero adapter: one micro-batch per batch, and many."""
    engines = {}
    for budget in (10_000, 24):
        trainer = _engine(qwen3_path, micro_batch_tokens=budget, dtype="float64")
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_b" in name:
                    p.normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        engines[budget] = trainer
    return engines


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_micro_batches_accumulate_to_the_whole_batch_loss(engines_by_budget, aggregation, float64_math):
    batch = _batch(256)
    loss_fn = _aggregation_loss(aggregation)
    results = []
    for budget, trainer in engines_by_budget.items():
        metrics = trainer.forward_backward(batch, loss_fn)
        grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((metrics, grads))
    (one, grads_one), (many, grads_many) = results
    assert one["micro_batches"] == 1 and many["micro_batches"] == len(batch.split_by_tokens(24)) > 2
    assert_close_reporting(many["loss"], one["loss"], FP64_TOL, f"{aggregation}: loss")
    for name, g in grads_one.items():
        assert_close_reporting(grads_many[name], g, FP64_TOL, f"{aggregation}: gradient of {name}")
    assert_close_reporting(many["lp_mean"], one["lp_mean"], FP64_TOL, f"{aggregation}: mean log-prob")
    # The whole-batch value is what the aggregation means: recompute it in one go, with the
    # batch's own counts as normaliser.
    lp = engines_by_budget[10_000].logprobs(batch).logprobs
    direct = aggregate_token_losses(
        -lp * batch.advantages,
        batch.loss_mask,
        batch.cu_seqlens,
        aggregation,
        LossContext.for_batch(batch.loss_mask, batch.cu_seqlens),
        max_response_length=20,
    )
    assert_close_reporting(
        one["loss"], direct.item(), FP64_TOL, f"{aggregation}: loss against the aggregation in one go"
    )


def test_train_step_reports_and_updates_only_the_adapter(qwen3_path):
    trainer = _engine(qwen3_path, optim=OptimConfig(lr=5e-2, max_grad_norm=1.0))
    base_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not is_lora_param(n)}
    batch = _batch(256)
    loss_fn = _aggregation_loss("token_mean")
    metrics = [trainer.train_step(batch, loss_fn) for _ in range(3)]
    keys = (
        "loss",
        "grad_norm",
        "lr",
        "skipped",
        "tokens",
        "sequences",
        "total_tokens",
        "micro_batches",
        "optimizer_steps",
        "lp_mean",
    )
    for key in keys:
        assert key in metrics[-1], key
    assert metrics[-1]["optimizer_steps"] == 3 and trainer.optimizer_steps == 3
    assert [m["skipped"] for m in metrics] == [0.0, 0.0, 0.0]
    assert metrics[0]["tokens"] == batch.num_loss_tokens and metrics[0]["total_tokens"] == batch.num_tokens
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert all(p.dtype == torch.float32 for p in trainer.trainable)
    assert {id(p) for g in trainer.optimizer.param_groups for p in g["params"]} == {id(p) for p in trainer.trainable}
    for name, p in trainer.model.named_parameters():
        if not is_lora_param(name):
            assert torch.equal(p, base_before[name]), name


def _adapter_and_optimizer(trainer: Trainer) -> dict[str, torch.Tensor]:
    state = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if p.requires_grad}
    for name, p in trainer.model.named_parameters():
        for key, value in trainer.optimizer.state.get(p, {}).items():
            state[f"{name}/{key}"] = torch.as_tensor(value).clone()
    return state


@pytest.mark.parametrize("fault", ["nan_loss", "inf_loss", "nan_gradient"])
def test_non_finite_update_is_skipped(qwen3_path, fault):
    """A NaN/inf loss, or a finite loss with a NaN gradient: no AdamW update, no optimizer-state
    change, counted as skipped; the next finite step trains as usual."""
    trainer = _engine(qwen3_path, optim=OptimConfig(lr=5e-2, max_grad_norm=1.0))
    batch = _batch(256)
    good = _aggregation_loss("token_mean")

    def broken(mb, logprobs, ctx):
        loss, metrics = good(mb, logprobs, ctx)
        if fault == "nan_gradient":  # d/dx sqrt(0 * x) = inf * 0: the value stays finite
            return loss + torch.sqrt(0.0 * logprobs.sum()), metrics
        return loss * (float("nan") if fault == "nan_loss" else float("inf")), metrics

    trainer.train_step(batch, good)
    before = _adapter_and_optimizer(trainer)
    metrics = trainer.train_step(batch, broken)
    assert metrics["skipped"] == 1.0 and trainer.optimizer_steps == 1
    assert not math.isfinite(metrics["loss"] if fault != "nan_gradient" else metrics["grad_norm"])
    after = _adapter_and_optimizer(trainer)
    assert before.keys() == after.keys()
    for key, value in before.items():
        assert torch.equal(value, after[key]), key
    assert all(p.grad is None for p in trainer.trainable)
    metrics = trainer.train_step(batch, good)
    assert metrics["skipped"] == 0.0 and trainer.optimizer_steps == 2 and math.isfinite(metrics["loss"])
    assert any(not torch.equal(v, _adapter_and_optimizer(trainer)[k]) for k, v in before.items())


def test_checkpoint_and_export_refuse_non_finite_tensors(qwen3_path, tmp_path):
    from archon.checkpoint.resume import CheckpointManager

    trainer = _engine(qwen3_path)
    trainer.train_step(_batch(256), _aggregation_loss("token_mean"))
    manager = CheckpointManager(tmp_path / "ckpts")
    trainer.save_checkpoint(manager, 1)
    listing = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    name, param = next((n, p) for n, p in trainer.model.named_parameters() if n.endswith("lora_b.weight"))
    with torch.no_grad():
        param[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match=f"checkpoint for step 2: '{name}'"):
        trainer.save_checkpoint(manager, 2)
    with pytest.raises(NonFiniteError, match=f"PEFT adapter .*'{name}'"):
        trainer.export_peft(tmp_path / "adapter")
    with torch.no_grad():
        param[0, 0] = 0.0
    state = next(iter(trainer.optimizer.state.values()))
    state["exp_avg"].view(-1)[0] = float("inf")
    with pytest.raises(NonFiniteError, match="optimizer state 'exp_avg' of"):
        trainer.save_checkpoint(manager, 2)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == listing


def test_full_parameter_training(qwen3_path):
    trainer = _engine(qwen3_path, lora=None, optim=OptimConfig(lr=1e-3))
    assert len(trainer.trainable) == len(list(trainer.model.parameters()))
    batch = _batch(256)
    before = trainer.model.output_weight.detach().clone()
    losses = [trainer.train_step(batch, _aggregation_loss("token_mean"))["loss"] for _ in range(3)]
    assert losses[-1] < losses[0]
    assert not torch.equal(trainer.model.output_weight, before)


def test_loss_context_normalizers():
    from archon.rl.losses import aggregation_normalizer
    from archon.trainer import loss_counts

    ctx = LossContext(global_tokens=torch.tensor(40.0), global_sequences=torch.tensor(3.0))
    assert aggregation_normalizer("token_mean", ctx).item() == 40.0
    assert aggregation_normalizer("seq_mean_token_mean", ctx).item() == 3.0
    assert aggregation_normalizer("seq_mean_token_sum_norm", ctx).item() == 3.0
    with pytest.raises(ValueError, match="unknown aggregation 'mean'"):
        aggregation_normalizer("mean", ctx)
    # the counts: 3 + 0 + 2 loss tokens; the second sequence has none, so 2 sequences count
    mask = torch.tensor([0, 1, 1, 1, 0, 0, 0, 1, 1], dtype=torch.bool)
    assert loss_counts(mask, torch.tensor([0, 4, 6, 9])).tolist() == [5.0, 2.0]


def test_gradient_clipping():
    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2, 2))]
    params[0].grad = torch.tensor([3.0, 0.0, 0.0])
    params[1].grad = torch.tensor([[0.0, 4.0], [0.0, 0.0]])
    assert grad_norm(params).item() == pytest.approx(5.0)
    assert clip_grad_norm(params, 1.0).item() == pytest.approx(5.0)
    assert grad_norm(params).item() == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm(params, None).item() == pytest.approx(1.0, rel=1e-5)


def test_float64_gradients_keep_float64_in_their_norm(tmp_path):
    """Squares of float64 gradients, plain and sharded (DTensor), are summed in float64: a norm
    summed in float32 is off by about 1e-8 relative here, one in float64 by under 1e-15."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(2)]
    expected = math.sqrt(sum(float((x * x).sum()) for x in grads))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        plain = torch.nn.Parameter(torch.zeros(1000, dtype=torch.float64))
        sharded = torch.nn.Parameter(distribute_tensor(torch.zeros(1000, dtype=torch.float64), mesh, [Shard(0)]))
        plain.grad = grads[0].clone()
        sharded.grad = distribute_tensor(grads[1].clone(), mesh, [Shard(0)])
        norm = grad_norm([plain, sharded])
    finally:
        dist.destroy_process_group()
    assert norm.dtype == torch.float64
    assert abs(norm.item() - expected) / expected < 1e-15, (norm.item(), expected)


def test_lr_schedule():
    warm = OptimConfig(lr=1.0, warmup_steps=3)
    assert [lr_multiplier(s, warm) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cosine = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=0, total_steps=10, min_lr_ratio=0.1)
    assert lr_multiplier(0, cosine) == pytest.approx(1.0)
    assert lr_multiplier(5, cosine) == pytest.approx(0.55)
    assert lr_multiplier(10, cosine) == pytest.approx(0.1)
    linear = OptimConfig(lr=1.0, schedule="linear", total_steps=4)
    assert [lr_multiplier(s, linear) for s in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    with pytest.raises(ValueError, match="total_steps"):
        OptimConfig(schedule="cosine", total_steps=0)
    # Unset total_steps is the run's length, filled in by for_run.
    unset = OptimConfig(lr=1.0, schedule="cosine", warmup_steps=2, min_lr_ratio=0.1)
    assert unset.total_steps is None and unset.for_run(12).total_steps == 12
    assert OptimConfig(total_steps=30, schedule="linear").for_run(12).total_steps == 30
    with pytest.raises(ValueError, match="run's 2 steps.*warmup_steps=2"):
        unset.for_run(2)
    with pytest.raises(ValueError, match="total_steps"):
        lr_multiplier(5, unset)


# ---- build and batches ----------------------------------------------------------------------------


def test_build_model_single_process_contract(qwen3_path):
    plain = build_model(qwen3_path)
    assert all(p.requires_grad for p in plain.model.parameters())
    lora = build_model(qwen3_path, lora=LoRAConfig(rank=4))
    for name, p in lora.model.named_parameters():
        assert p.requires_grad == is_lora_param(name), name
        if name.endswith("lora_b.weight"):
            assert bool((p == 0).all()), name
        elif name.endswith("lora_a.weight"):
            bound = 1 / math.sqrt(p.shape[-1])
            assert 0 < p.abs().max() <= bound, name
    torch.testing.assert_close(plain.model.output_weight, lora.model.output_weight, atol=0, rtol=0)


def test_packed_batch_layout():
    batch = PackedBatch.from_sequences([[5, 6, 7, 8], [9, 10, 11]], prompt_lens=[2, 1], advantages=[1.0, -2.0])
    assert batch.cu_seqlens.tolist() == [0, 4, 7]
    assert batch.positions.tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert batch.labels[batch.loss_mask].tolist() == [7, 8, 10, 11]
    assert batch.loss_mask.tolist() == [False, True, True, False, True, True, False]
    assert batch.advantages.tolist() == [1.0] * 4 + [-2.0] * 3
    parts = PackedBatch.from_sequences([[1] * 5, [2] * 3, [3] * 9, [4] * 2]).split_by_tokens(8)
    assert [p.seq_lens for p in parts] == [[5, 3], [9], [2]]
    assert parts[1].tokens.tolist() == [3] * 9


def test_packed_batch_errors_name_the_field():
    good = PackedBatch.from_sequences([[1, 2, 3]])
    with pytest.raises(ValueError, match="PackedBatch.labels"):
        PackedBatch(good.tokens, good.positions, good.cu_seqlens, good.labels[:2], good.loss_mask)
    with pytest.raises(ValueError, match="cu_seqlens"):
        PackedBatch(good.tokens, good.positions, torch.tensor([0, 2]), good.labels, good.loss_mask)
    with pytest.raises(ValueError, match="advantages"):
        PackedBatch.from_sequences([[1, 2]], advantages=[1.0, 2.0])
