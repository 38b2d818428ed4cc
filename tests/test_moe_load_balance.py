"""MoE load balancing: the auxiliary loss against HF's load_balancing_loss_func, its place in the
training loss, and the aux-loss-free correction-bias update checked by hand."""

from __future__ import annotations

import parallel_cases as cases
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_reporting

from archon.batch import PackedBatch
from archon.load_balance import MoEConfig, Router, update_correction_biases
from archon.lora import LoRAConfig, is_lora_param
from archon.precision import fp32_islands_in_fp64
from archon.trainer import Trainer

# Both sides of every comparison here run in float64: what is left is float64 rounding
FLOAT64_TOL = 1e-10


def _batch(vocab: int) -> PackedBatch:
    return cases.make_batch(vocab)


@pytest.mark.parametrize("model_type, overrides", [("qwen3_moe", dict(mlp_only_layers=[])), ("gpt_oss", {})])
def test_aux_loss_equals_hf_load_balancing_loss(tiny_checkpoint, lora_model, model_type, overrides):
    """Pooled over two MoE layers, as HF pools them."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    from archon.load_balance import load_balance_loss, routers

    loaded = lora_model(tiny_checkpoint(model_type, **overrides), LoRAConfig(rank=4))
    model = loaded.model.double().train()  # float64 on both sides: only float64 rounding is left
    layer_routers = routers(model)
    assert len(layer_routers) >= 2
    logits = []

    def record_logits(router, args, out):  # the router logits HF's function takes
        bias = router.bias if model_type == "gpt_oss" else None
        logits.append(F.linear(args[0], router.weight, bias))

    for router in layer_routers:
        router.register_forward_hook(record_logits)
    batch = _batch(model.args.vocab_size)
    with fp32_islands_in_fp64():
        model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
        top_k = layer_routers[0].top_k
        want = load_balancing_loss_func(tuple(logits), layer_routers[0].routing.num_experts, top_k)
        got = load_balance_loss(layer_routers)
    assert got.dtype == want.dtype == torch.float64
    assert_close_reporting(got, want, FLOAT64_TOL, f"{model_type} aux loss against HF's")
    assert got.requires_grad


def test_aux_loss_coefficient_adds_its_gradient(tiny_checkpoint, float64_math):
    """One micro-batch: the LoRA gradient with aux_loss_coef c is the plain one plus c times the
    gradient of the aux loss (the reported moe_aux_loss) of the same forward."""
    from archon.load_balance import load_balance_loss

    path = tiny_checkpoint("qwen3_moe")
    vocab = 256
    batch = _batch(vocab)
    coef = 0.5
    grads, metrics = {}, {}
    for c in (0.0, coef):
        config = cases.engine_config(path, micro_batch_tokens=10_000, moe=MoEConfig(aux_loss_coef=c), dtype="float64")
        trainer = Trainer(config)
        cases.set_lora_values(trainer, seed=1)
        batch.old_logprobs = trainer.logprobs(batch).logprobs
        metrics[c] = trainer.forward_backward(batch, cases.loss_fn, with_entropy=True)
        grads[c] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if is_lora_param(n)}
    # The aux loss's own gradient, from a forward with the same parameters.
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.model.train()
    trainer.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen, return_hidden=True)
    aux = load_balance_loss(trainer.routers)
    aux.backward()
    assert_close_reporting(metrics[0.0]["moe_aux_loss"], aux.item(), FLOAT64_TOL, "moe_aux_loss reported at c=0")
    assert_close_reporting(metrics[coef]["moe_aux_loss"], aux.item(), FLOAT64_TOL, f"moe_aux_loss reported at c={coef}")
    assert_close_reporting(
        metrics[coef]["loss"], metrics[0.0]["loss"] + coef * aux.item(), FLOAT64_TOL, "loss with the aux term"
    )
    changed = 0
    for name, p in trainer.model.named_parameters():
        if not is_lora_param(name):
            continue
        aux_grad = p.grad if p.grad is not None else torch.zeros_like(grads[0.0][name])
        assert_close_reporting(
            grads[coef][name], grads[0.0][name] + coef * aux_grad, FLOAT64_TOL, f"gradient of {name}"
        )
        changed += int(aux_grad.abs().max() > 0)
    assert changed > 0
    assert metrics[0.0]["moe_load_imbalance"] >= 1.0


def test_correction_bias_update_by_hand():
    class Biased(Router):
        def __init__(self):
            super().__init__(4)
            self.register_buffer("bias", torch.tensor([0.1, 0.0, -0.2, 0.0]))

        @property
        def correction_bias(self):
            return self.bias

    router = Biased()
    router.routing.step_counts = torch.tensor([5.0, 1.0, 3.0, 3.0])  # mean 3
    update_correction_biases([router], rate=0.01)
    torch.testing.assert_close(router.bias, torch.tensor([0.09, 0.01, -0.2, 0.0]))


def test_trainer_updates_correction_biases_from_the_step_loads(tiny_checkpoint):
    path = tiny_checkpoint("glm4_moe")
    rate = 0.01
    trainer = Trainer(cases.engine_config(path, moe=MoEConfig(bias_update_rate=rate)))
    batch = _batch(256)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    before = [r.correction_bias.clone() for r in trainer.routers]
    metrics = trainer.train_step(batch, cases.loss_fn, with_entropy=True)
    for router, bias in zip(trainer.routers, before, strict=True):
        counts = router.routing.step_counts
        # every real token chose top_k experts once in each MoE layer
        assert counts.sum().item() == batch.num_tokens * router.top_k
        torch.testing.assert_close(router.correction_bias, bias + rate * torch.sign(counts.mean() - counts))
    assert metrics["moe_load_imbalance"] > 1.0


def test_balancing_is_off_by_default_and_checked(tiny_checkpoint):
    assert MoEConfig() == MoEConfig(aux_loss_coef=0.0, bias_update_rate=0.0)
    with pytest.raises(ValueError, match=r"moe.aux_loss_coef=-1"):
        MoEConfig(aux_loss_coef=-1)
    with pytest.raises(ValueError, match=r"moe.bias_update_rate=0.01 but the routers of Qwen3Model"):
        Trainer(cases.engine_config(tiny_checkpoint("qwen3_moe"), moe=MoEConfig(bias_update_rate=0.01)))
    with pytest.raises(ValueError, match=r"moe.aux_loss_coef=0.1 but Qwen3Model has no MoE routers"):
        Trainer(cases.engine_config(tiny_checkpoint("qwen3"), moe=MoEConfig(aux_loss_coef=0.1)))


def test_no_router_keeps_a_graph_after_a_checkpointed_step(tiny_checkpoint):
    """Activation checkpointing recomputes the routers inside the backward pass: their records of
    that recomputation must not keep its graph (the blocks' activations) past the step."""
    from archon.parallel import ParallelConfig

    trainer = Trainer(cases.engine_config(tiny_checkpoint("qwen3_moe"), ParallelConfig(activation_checkpoint="full")))
    batch = _batch(256)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    metrics = trainer.train_step(batch, cases.loss_fn, with_entropy=True)
    assert metrics["moe_aux_loss"] > 0 and trainer.routers
    for router in trainer.routers:
        kept = router.routing.probs_sum
        assert kept is None or kept.grad_fn is None, "a router record holds an autograd graph"
