"""The Tinker API's loss functions (archon/serve/losses.py): each against a case computed by hand
from the API documentation's definition (float64), then through the SDK against the server, where
the reported loss is the definition applied to the log-probs the server returns, and the gradient
of a loss at ratio 1 is that of cross-entropy with the advantages as weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_tinker_fixtures import (  # noqa: F401 - fixtures
    datum_logprobs,
    service_client,
    sft_datum,
    tinker,
    tinker_server,
    tiny_base,
    types,
)

from archon.serve import losses

L = math.log(0.5)
TARGET = [math.log(0.5), math.log(0.25)]
SAMPLING = [math.log(0.4), math.log(0.5)]
ADVANTAGES = [2.0, -1.0]
# ratio = p / q = [1.25, 0.5]


def _case():
    target = torch.tensor(TARGET, dtype=torch.float64, requires_grad=True)
    return target, torch.tensor(SAMPLING, dtype=torch.float64), torch.tensor(ADVANTAGES, dtype=torch.float64)


def _check(loss: torch.Tensor, target: torch.Tensor, value: float, grad: list[float]) -> None:
    loss.backward()
    assert float(loss.detach()) == pytest.approx(value, abs=1e-12)
    np.testing.assert_allclose(target.grad.numpy(), grad, atol=1e-12, rtol=0)


def test_cross_entropy_by_hand():
    target, _, _ = _case()
    # -(log 0.5 * 1 + log 0.25 * 0.5) = -2 log 0.5; d/d logprob = -weights
    _check(losses.cross_entropy(target, torch.tensor([1.0, 0.5], dtype=torch.float64)), target, -2 * L, [-1.0, -0.5])


def test_importance_sampling_by_hand():
    target, sampling, advantages = _case()
    # -(1.25 * 2 + 0.5 * -1) = -2; d/d logprob = -ratio * A
    _check(losses.importance_sampling(target, sampling, advantages), target, -2.0, [-2.5, 0.5])


def test_ppo_by_hand():
    target, sampling, advantages = _case()
    # clip(ratio, 0.8, 1.2) = [1.2, 0.8]; min(2.5, 2.4) = 2.4 and min(-0.5, -0.8) = -0.8, both clipped: no gradient
    _check(losses.ppo(target, sampling, advantages), target, -1.6, [0.0, 0.0])
    target, sampling, advantages = _case()
    # wider clips leave both ratios: the importance-sampling loss
    _check(losses.ppo(target, sampling, advantages, 0.4, 1.3), target, -2.0, [-2.5, 0.5])


def test_cispo_by_hand():
    target, sampling, advantages = _case()
    # -(1.2 * log 0.5 * 2 + 0.8 * 2 log 0.5 * -1) = -0.8 log 0.5; d/d logprob = -clip(ratio) * A
    _check(losses.cispo(target, sampling, advantages), target, -0.8 * L, [-2.4, 0.8])


def test_dro_by_hand():
    target, sampling, advantages = _case()
    # -(log 0.5 * 2 + 2 log 0.5 * -1) + 0.5 / 2 * ((log 1.25)^2 + (log 0.5)^2)
    value = 0.25 * (math.log(1.25) ** 2 + L**2)
    # d/d logprob = -A + beta * log ratio
    grad = [-2.0 + 0.5 * math.log(1.25), 1.0 + 0.5 * L]
    _check(losses.dro(target, sampling, advantages, beta=0.5), target, value, grad)


def test_gspo_by_hand():
    target, sampling, advantages = _case()
    # s = exp(mean(log 1.25, log 0.5)) = sqrt(0.625) < 0.8: token 1 keeps s * 2 (< 0.8 * 2), gradient -A * s;
    # token 2 takes the clipped -0.8 (< -s), no gradient
    s = math.sqrt(0.625)
    _check(losses.gspo(target, sampling, advantages), target, 0.8 - 2 * s, [-2 * s, 0.0])
    target, sampling, advantages = _case()
    # only token 1 in the ratio: s = 1.25, clipped to 1.2 for token 1 (min(2.5, 2.4)); token 2 keeps -1.25
    mask = torch.tensor([1.0, 0.0], dtype=torch.float64)
    _check(losses.gspo(target, sampling, advantages, mask), target, -(2.4 - 1.25), [0.0, 1.25])


def test_loss_config_is_checked():
    with pytest.raises(ValueError, match="beta"):
        losses.check_config("dro", {})
    with pytest.raises(ValueError, match="clip_low_threshold"):
        losses.check_config("importance_sampling", {"clip_low_threshold": 0.5})


# ---- through the SDK ---------------------------------------------------------------------------------


def _rl_datum(tokenizer, text: str, sampling: list[float], advantages: list[float], **extra):
    ids = tokenizer.encode(text)
    inputs = {"target_tokens": ids[1:], "logprobs": sampling, "advantages": advantages, **extra}
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)


@pytest.mark.parametrize(
    "loss_fn, config",
    [
        ("importance_sampling", None),
        ("ppo", None),
        ("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 1.5}),
        ("cispo", None),
        ("dro", {"beta": 0.3}),
        ("gspo", None),
    ],
)
def test_served_loss_is_the_definition_on_the_returned_logprobs(service_client, tiny_base, loss_fn, config):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4).result()
    text = "3+4=7"
    n = len(tokenizer.encode(text)) - 1
    rng = np.random.default_rng(0)
    base = datum_logprobs(client.forward([sft_datum(tokenizer, text)], "cross_entropy").result())[0]
    sampling = (base + rng.normal(0, 0.3, n)).astype(np.float32).tolist()
    advantages = rng.normal(0, 1, n).astype(np.float32).tolist()
    result = client.forward_backward([_rl_datum(tokenizer, text, sampling, advantages)], loss_fn, config).result()
    (target,) = datum_logprobs(result)
    config = config or {}
    kwargs = {"beta": config["beta"]} if loss_fn == "dro" else {}
    if loss_fn in ("ppo", "cispo", "gspo"):
        kwargs = {k: config[k] for k in ("clip_low_threshold", "clip_high_threshold") if k in config}
    expected = getattr(losses, loss_fn)(
        torch.tensor(target),
        torch.tensor(sampling, dtype=torch.float64),
        torch.tensor(advantages, dtype=torch.float64),
        **kwargs,
    )
    # the server sums in fp32: measured differences ~1e-6
    assert result.metrics["loss:sum"] == pytest.approx(float(expected), abs=1e-4)
    np.testing.assert_allclose(target, base, atol=1e-6, rtol=0)


def _after_one_step(client, datum, loss_fn="cross_entropy", custom=None):
    future = client.forward_backward_custom([datum], custom) if custom else client.forward_backward([datum], loss_fn)
    future.result()
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result()


def test_gradients_of_importance_sampling_and_custom_losses_match_cross_entropy(service_client, tiny_base):
    """At ratio 1 the gradient of -ratio * A is that of -logprob * A: one Adam step from the same
    adapter gives the same adapter, as does a custom loss sum(-logprob * weights) run by the SDK."""
    path, tokenizer = tiny_base
    text, weights = "5+6=11", [0.0, 0.0, 0.0, 1.0, 0.5]
    clients = [
        service_client.create_lora_training_client(base_model=str(path), rank=4, seed=9).result() for _ in range(3)
    ]
    ids = tokenizer.encode(text)
    ce_datum = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={"target_tokens": ids[1:], "weights": weights}
    )
    own = datum_logprobs(clients[1].forward([ce_datum], "cross_entropy").result())[0].astype(np.float32).tolist()
    _after_one_step(clients[0], ce_datum)
    _after_one_step(clients[1], _rl_datum(tokenizer, text, own, weights), "importance_sampling")

    def custom(data, logprobs_list):
        loss = sum((-lp * torch.tensor(weights)).sum() for lp in logprobs_list)
        return loss, {"custom": float(loss)}

    _after_one_step(clients[2], sft_datum(tokenizer, text), custom=custom)
    probe = [sft_datum(tokenizer, "9+9=18")]
    after = [datum_logprobs(c.forward(probe, "cross_entropy").result())[0] for c in clients]
    untrained = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=9).result()
    before = datum_logprobs(untrained.forward(probe, "cross_entropy").result())[0]
    assert np.abs(after[0] - before).max() > 1e-3
    # the same fp32 arithmetic on the same inputs: measured equal to ~1e-7
    np.testing.assert_allclose(after[1], after[0], atol=1e-6, rtol=0)
    np.testing.assert_allclose(after[2], after[0], atol=1e-6, rtol=0)


def test_unserved_losses_are_refused_by_name(service_client, tiny_base):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4).result()
    datum = _rl_datum(tokenizer, "1+1=2", [0.0] * 4, [1.0] * 4)
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce"):
        client.forward_backward([datum], "stable_reinforce").result()
    with pytest.raises(tinker.RequestFailedError, match="beta"):
        client.forward_backward([datum], "dro").result()
    # the client goes on working
    assert client.forward([datum], "importance_sampling").result().metrics["loss:sum"] != 0
