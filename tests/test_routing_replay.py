"""MoE routing replay: every router takes replayed expert ids with its own gate weights at them, the
built-in engine records the ids it routed to, and the trainer scoring a rollout with them gives the
sampler's log-probs even where the two route differently on their own."""

from __future__ import annotations

import json

import parallel_cases as cases
import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close_reporting

from archon.build import build_model
from archon.models.common import moe
from archon.models.common.moe import (
    SigmoidGroupTopKRouter,
    SoftmaxTopKRouter,
    TopKSoftmaxRouter,
    moe_routers,
    recorded_routing,
    replayed_routing,
    take_recorded,
)
from archon.rl.rollouts import rollout_batch
from archon.rollout.base import SamplingParams
from archon.rollout.native import ROUTED_EXPERTS, NativeRolloutEngine
from archon.spec import supported_model_types
from archon.trainer import ROUTED_EXPERTS_EXTRA, Trainer

E, K, DIM, T = 8, 2, 16, 12


def _router(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind.startswith("softmax_topk"):
        router = SoftmaxTopKRouter(DIM, E, K, norm_topk_prob=kind.endswith("norm"))
    elif kind == "topk_softmax":
        router = TopKSoftmaxRouter(DIM, E, K, bias=True)
        torch.nn.init.normal_(router.bias)
    else:
        n_group = 4 if kind == "sigmoid_grouped" else 1
        router = SigmoidGroupTopKRouter(DIM, E, K, n_group, min(2, n_group), True, 2.5)
        router.e_score_correction_bias.normal_(0.0, 0.1)
    torch.nn.init.normal_(router.weight)
    return router


def _gate_weights_by_hand(kind: str, router, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The family's gate weights of the experts `ids` [T, k], from the router's formula."""
    if kind.startswith("softmax_topk"):
        w = torch.softmax(x @ router.weight.T, dim=-1).gather(1, ids)
        return w / w.sum(-1, keepdim=True) if kind.endswith("norm") else w
    if kind == "topk_softmax":
        return torch.softmax((x @ router.weight.T + router.bias).gather(1, ids), dim=-1)
    w = torch.sigmoid(x @ router.weight.T).gather(1, ids)
    return w / w.sum(-1, keepdim=True) * 2.5


ROUTER_KINDS = ["softmax_topk", "softmax_topk_norm", "topk_softmax", "sigmoid", "sigmoid_grouped"]


@pytest.mark.parametrize("kind", ROUTER_KINDS)
def test_router_takes_replayed_ids_with_its_own_gate_weights(kind):
    router = _router(kind).eval()
    x = torch.randn(T, DIM, generator=torch.Generator().manual_seed(1))
    own_weights, own_ids = router(x)

    router.replayed_experts = own_ids.clone()
    same_weights, same_ids = router(x)
    assert torch.equal(same_ids, own_ids)
    torch.testing.assert_close(same_weights, own_weights, rtol=0, atol=0)

    # the two experts each token would rank last: never its own choice
    probs = torch.softmax(x @ router.weight.T, dim=-1)
    other = probs.topk(K, dim=-1, largest=False).indices
    replay = other.clone()
    replay[::3] = -1  # these tokens route on their own
    router.replayed_experts = replay
    weights, ids = router(x)
    expected_ids = torch.where(replay >= 0, other, own_ids)
    assert torch.equal(ids, expected_ids)
    assert not torch.equal(ids, own_ids)
    torch.testing.assert_close(weights, _gate_weights_by_hand(kind, router, x, expected_ids), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(weights[::3], own_weights[::3])

    # the load-balance statistics count the replayed assignment
    router.train()
    router(x)
    assert torch.equal(router.routing.counts, torch.bincount(expected_ids.reshape(-1), minlength=E).float())


def test_router_rejects_replayed_ids_of_another_shape():
    router = _router("softmax_topk").eval()
    router.replayed_experts = torch.zeros(T, K + 1, dtype=torch.long)
    with pytest.raises(ValueError, match=r"replayed expert ids have shape \(12, 3\).*\(12, 2\)"):
        router(torch.randn(T, DIM))


OVERRIDES = {"qwen3_moe": dict(mlp_only_layers=[])}
DENSE_TYPES = {
    "falcon_h1",
    "gemma3",
    "gemma3_text",
    "glm4",
    "llama",
    "olmo2",
    "olmo3",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_5_text",
}


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_moe_family_honours_replayed_ids(tiny_checkpoint, model_type):
    """Replaying the ids the model routes to on its own gives its logits; other ids change them."""
    model = build_model(tiny_checkpoint(model_type, **OVERRIDES.get(model_type, {}))).model.eval()
    layers = moe_routers(model)
    if model_type in DENSE_TYPES:
        assert not layers, f"{model_type} is listed as dense but has MoE routers"
        return  # nothing to replay: a dense family routes nothing
    assert layers, f"{model_type} has no MoE router"
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.args.vocab_size, (10,), generator=g)
    args = (tokens, torch.arange(10), torch.tensor([0, 10]), 10)
    with torch.no_grad(), recorded_routing(model):
        own = model(*args)
        ids = take_recorded(layers)
    assert ids.shape == (10, len(layers), layers[0].top_k)
    with torch.no_grad(), replayed_routing(model, ids.to(torch.int16)):
        torch.testing.assert_close(model(*args), own, rtol=0, atol=0)
    shifted = (ids + 1) % layers[0].routing.num_experts
    with torch.no_grad(), replayed_routing(model, shifted):
        assert (model(*args) - own).abs().max() > 1e-4


def test_replayed_routing_names_the_layer_count(tiny_checkpoint):
    model = build_model(tiny_checkpoint("qwen3_moe", mlp_only_layers=[])).model
    with pytest.raises(ValueError, match="the model has 2 MoE layers"):
        with replayed_routing(model, torch.zeros(4, 3, 2, dtype=torch.long)):
            pass


@pytest.fixture
def noisy_sampler_routing(monkeypatch):
    """While on, each router's own top-k is chosen from its logits plus N(0, 0.5^2) noise (the
    sampler's kernels routing near-ties otherwise); the gate weights stay the router's formula at
    the chosen ids. Returns a switch."""
    state = {"on": False, "generator": torch.Generator().manual_seed(123)}
    inputs = {}
    choose = moe.choose_experts

    def noisy_choose(router, own_indices):
        if state["on"]:
            logits = F.linear(inputs[router], router.weight)
            logits = logits + 0.5 * torch.randn(logits.shape, generator=state["generator"])
            own_indices = logits.topk(own_indices.shape[1], dim=-1).indices
        return choose(router, own_indices)

    monkeypatch.setattr(moe, "choose_experts", noisy_choose)

    def attach(model):
        for router in moe_routers(model):
            router.register_forward_pre_hook(lambda module, args: inputs.__setitem__(module, args[0]))

    return state, attach


def _rollout(trainer, noisy, attach, **engine_kwargs):
    attach(trainer.model)
    engine = NativeRolloutEngine(trainer.model, max_batch_sequences=4, record_routing=True, **engine_kwargs)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=0, stop_token_ids=(3, 17, 42)))
    noisy["on"] = False
    return samples


# float64 rounding is all that separates a replayed forward from the sampler's (measured below 1e-14)
FLOAT64_TOL = 1e-10


@pytest.mark.parametrize("perturbed", [True, False], ids=["sampler_routes_differently", "same_routing"])
def test_trainer_replay_gives_the_sampler_logprobs(tiny_checkpoint, noisy_sampler_routing, float64_math, perturbed):
    noisy, attach = noisy_sampler_routing
    path = tiny_checkpoint("qwen3_moe", mlp_only_layers=[])
    trainer = Trainer(cases.engine_config(path, micro_batch_tokens=40, dtype="float64"))
    cases.set_lora_values(trainer, seed=1)
    noisy["on"] = perturbed
    samples = _rollout(trainer, noisy, attach, prefill_chunk_tokens=6)
    layers = moe_routers(trainer.model)
    for s in samples:
        recorded = s.extra[ROUTED_EXPERTS]
        assert recorded.dtype == torch.int16
        assert recorded.shape == (len(s.prompt_ids) + len(s.completion_ids), len(layers), layers[0].top_k)
        assert (recorded[:-1] >= 0).all() and (recorded[-1] == -1).all()  # the last token was never fed

    advantages = torch.zeros(len(samples), dtype=torch.float64)  # fp64: the batch keeps the fp64 log-probs
    batch = rollout_batch(samples, advantages, trainer_version=0, routed_experts=True)
    replayed = trainer.logprobs(batch).logprobs
    batch.extras.pop(ROUTED_EXPERTS_EXTRA)
    own = trainer.logprobs(batch).logprobs
    mask = batch.loss_mask
    assert batch.rollout_logprobs.dtype == torch.float64, "the engine's fp64 log-probs were rounded"
    assert_close_reporting(replayed[mask], batch.rollout_logprobs[mask], FLOAT64_TOL, "replayed against sampled")
    differs = (own - batch.rollout_logprobs).abs()[mask] > 1e-4
    if perturbed:
        assert differs.sum() >= 3, "the perturbation flipped no expert choice that mattered"
    else:
        assert not differs.any()
        assert_close_reporting(replayed[mask], own[mask], FLOAT64_TOL, "replayed against the trainer's own routing")


def test_training_forward_replays_and_counts_the_replayed_experts(tiny_checkpoint, float64_math):
    """The training forward routes to the batch's ids: the routers' step counts are theirs, and
    with activation checkpointing (recomputed in the backward) the gradient is the same."""
    from archon.lora import is_lora_param
    from archon.parallel import ParallelConfig

    path = tiny_checkpoint("qwen3_moe", mlp_only_layers=[])
    batch = cases.make_batch(256)
    g = torch.Generator().manual_seed(3)
    grads = {}
    for ac in ("none", "full"):
        trainer = Trainer(cases.engine_config(path, parallel=ParallelConfig(activation_checkpoint=ac), dtype="float64"))
        cases.set_lora_values(trainer, seed=1)
        layers = trainer.routers
        if ac == "none":
            ids = torch.stack([torch.randperm(8, generator=g)[:2] for _ in range(batch.num_tokens * len(layers))])
            ids = ids.view(batch.num_tokens, len(layers), 2).to(torch.int16)
            batch.extras[ROUTED_EXPERTS_EXTRA] = ids
            batch.old_logprobs = trainer.logprobs(batch).logprobs
        trainer.forward_backward(batch, cases.loss_fn, with_entropy=True)
        for layer, router in enumerate(layers):
            want = torch.bincount(ids[:, layer].long().reshape(-1), minlength=8).float()
            assert torch.equal(router.routing.step_counts, want)
        grads[ac] = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if is_lora_param(n)}
    assert grads["none"]
    for name, grad in grads["none"].items():
        assert_close_reporting(grads["full"][name], grad, FLOAT64_TOL * grad.abs().max().item(), f"{name} recomputed")


def test_engine_without_moe_refuses_to_record(tiny_checkpoint):
    model = build_model(tiny_checkpoint("qwen3")).model
    with pytest.raises(ValueError, match="record_routing needs an MoE model"):
        NativeRolloutEngine(model, record_routing=True)


def test_config_errors_name_the_setting():
    from archon.rl.config import parse_config, validate

    with pytest.raises(ValueError, match=r"algorithm.routing_replay='rollout': needs rollout.engine=native"):
        parse_config(["--algorithm.routing-replay", "rollout", "--rollout.engine", "vllm"])
    config = parse_config(["--algorithm.routing-replay", "rollout"])
    config.environment.name = "tool_use"
    with pytest.raises(ValueError, match=r"algorithm.routing_replay='rollout': not available with environment"):
        validate(config, world_size=1)
    with pytest.raises(SystemExit):
        parse_config(["--algorithm.routing-replay", "sometimes"])


def test_dense_model_is_a_config_error(tiny_checkpoint, tmp_path):
    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.tasks import build_char_tokenizer

    path = tiny_checkpoint("qwen3", vocab_size=len(build_char_tokenizer()))
    build_char_tokenizer().save_pretrained(path)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(40)))
    config = parse_config(
        [
            "--model.path",
            str(path),
            "--data.path",
            str(data),
            "--algorithm.routing-replay",
            "rollout",
            "--reward.function",
            "reward_fixtures:digits_or_raise",
            "--reward.num-workers",
            "0",
            "--logging.run-dir",
            str(tmp_path / "run"),
            "--logging.no-progress",
            "--logging.backends",
        ]
    )
    with pytest.raises(ValueError, match=r"algorithm.routing_replay='rollout' needs an MoE model.*set it to 'off'"):
        RLRun(config)


@pytest.mark.parametrize("replay", ["rollout", "off"])
def test_rl_run_with_routing_replay(tmp_path, noisy_sampler_routing, replay):
    """GRPO steps on a tiny qwen3_moe whose sampler routes with noise: with replay the trainer's
    pi_old is the rollout's log-prob (logprob_abs_diff_max ~ 0), without it the two differ."""
    from helpers import tiny_char_checkpoint

    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun
    from archon.rl.tasks import ArithmeticTaskConfig, arithmetic_splits, write_jsonl

    noisy, attach = noisy_sampler_routing
    path, _ = tiny_char_checkpoint("qwen3_moe", tmp_path / "model", mlp_only_layers=[])
    train, _ = arithmetic_splits(ArithmeticTaskConfig(operations=("+",), num_train=16, num_held_out=1))
    write_jsonl(train, tmp_path / "train.jsonl")
    config = parse_config(
        [
            "--model.path",
            str(path),
            "--data.path",
            str(tmp_path / "train.jsonl"),
            "--steps",
            "2",
            "--rollout.prompts-per-step",
            "2",
            "--rollout.group-size",
            "2",
            "--rollout.max-new-tokens",
            "4",
            "--reward.function",
            "reward_fixtures:digits_or_raise",
            "--reward.num-workers",
            "0",
            "--optim.lr",
            "1e-2",
            "--lora.rank",
            "4",
            "--lora.alpha",
            "8",
            "--algorithm.routing-replay",
            replay,
            # without replay the noisy routing is a real mismatch, which the fidelity guard would stop
            "--rollout.fidelity.mode",
            "warn",
            "--logging.run-dir",
            str(tmp_path / "run"),
            "--logging.no-progress",
            "--logging.backends",
        ]
    )
    run = RLRun(config)
    attach(run.trainer.model)
    generate = run.native.generate

    def noisy_generate(*args, **kwargs):
        noisy["on"] = True
        try:
            return generate(*args, **kwargs)
        finally:
            noisy["on"] = False

    run.native.generate = noisy_generate
    run.run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["logprob_abs_diff_max"] for r in records if "logprob_abs_diff_max" in r]
    assert len(gaps) == 2
    if replay == "rollout":
        assert max(gaps) < 1e-4, gaps
    else:
        assert max(gaps) > 1e-3, gaps
