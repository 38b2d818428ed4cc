"""Several training clients' forward_backward requests queued together run in one forward of a
multi-LoRA model on the shared base (archon/serve/training.py); each client gets the loss, log-probs
and gradients it gets alone. Compared in float64 with fp32 islands kept in fp64 (archon.precision)."""

from __future__ import annotations

import time

import numpy as np
import torch
from test_tinker_fixtures import API_KEY, sft_datum, tinker, tiny_base, types  # noqa: F401 - fixtures

from archon.lora import lora_parameters
from archon.precision import fp32_islands_in_fp64
from archon.serve.config import ServeConfig
from archon.serve.server import start_server

TOL = 1e-10  # float64 against float64
# Log-probs travel as float32 (the SDK's wire format): values that agree to ~1e-14 in float64 can round
# to neighbouring float32 values, so they are compared to one float32 ulp (2**-23 relative).
WIRE_RTOL = 2.0**-23


def _is_datum(tokenizer, text: str) -> types.Datum:
    """An importance_sampling datum of `text` with made-up sampling log-probs and advantages."""
    ids = tokenizer.encode(text)
    n = len(ids) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "logprobs": [-3.0 - 0.1 * i for i in range(n)],
            "advantages": [1.0 if i % 2 else -0.5 for i in range(n)],
        },
    )


def _wait_until_queued(server, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while server.futures.queued() < count and time.monotonic() < deadline:
        time.sleep(0.02)


def _state(server, client) -> dict[str, dict[str, torch.Tensor]]:
    params = lora_parameters(server.backend.models[client.model_id].model)
    return {
        "grad": {k: p.grad.clone() for k, p in params.items() if p.grad is not None},
        "value": {k: p.detach().clone() for k, p in params.items()},
    }


def _assert_tensors_close(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys() and want, what
    for name, reference in want.items():
        scale = max(reference.abs().max().item(), 1e-30)
        difference = (got[name] - reference).abs().max().item() / scale
        assert difference <= TOL, f"{what} {name}: relative difference {difference:.3e}"


def test_two_clients_queued_together_run_in_one_forward_with_their_own_numbers(tiny_base, tmp_path):
    path, tokenizer = tiny_base
    config = ServeConfig(
        base_model=str(path), port=0, api_key=API_KEY, max_lora_rank=8, dtype="float64", checkpoint_dir=str(tmp_path)
    )
    with fp32_islands_in_fp64():
        server = start_server(config)
        try:
            service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)

            def client(rank: int, seed: int):
                return service.create_lora_training_client(base_model=str(path), rank=rank, seed=seed).result()

            # different ranks: the multi-LoRA model pads them to the largest
            a, b, a_alone, b_alone = client(4, 1), client(8, 2), client(4, 1), client(8, 2)
            data_a = [sft_datum(tokenizer, "12+34=46", prompt_chars=6), sft_datum(tokenizer, "7+8=15")]
            data_b = [_is_datum(tokenizer, "5+5=10")]
            adam = types.AdamParams(learning_rate=2e-2)
            before = len(server.backend.training_batch_sizes)
            server.futures.submit(lambda: _wait_until_queued(server, 3))  # holds the worker while they queue up
            batched_a = a.forward_backward(data_a, "cross_entropy")
            step_a = a.optim_step(adam)  # a's step waits for a's forward_backward; b's joins it
            batched_b = b.forward_backward(data_b, "importance_sampling")
            batched = [batched_a.result(), batched_b.result()]
            b_state = _state(server, b)
            step_a.result()
            assert server.backend.training_batch_sizes[before:] == [2]

            alone = [
                a_alone.forward_backward(data_a, "cross_entropy").result(),
                b_alone.forward_backward(data_b, "importance_sampling").result(),
            ]
            assert server.backend.training_batch_sizes[before + 1 :] == [1, 1]
            _assert_tensors_close(_state(server, b_alone)["grad"], b_state["grad"], "client b's gradient")
            a_alone.optim_step(adam).result()
            _assert_tensors_close(_state(server, a_alone)["value"], _state(server, a)["value"], "client a's step")
            for got, want in zip(batched, alone):
                assert abs(got.metrics["loss:sum"] - want.metrics["loss:sum"]) <= TOL
                for g, w in zip(got.loss_fn_outputs, want.loss_fn_outputs):
                    np.testing.assert_allclose(g["logprobs"].to_numpy(), w["logprobs"].to_numpy(), rtol=WIRE_RTOL)
            service.close("success").result()
        finally:
            server.shutdown()
            server.server_close()
