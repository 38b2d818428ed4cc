"""Bad requests through the SDK: each gets the SDK's own error type (RequestFailedError of category
User for a request the server queued, BadRequestError for one it answers at once), names what is
wrong, and leaves the server serving the other clients."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import numpy as np
import pytest
from test_tinker_fixtures import (  # noqa: F401 - fixtures
    API_KEY,
    datum_logprobs,
    service_client,
    sft_datum,
    tinker,
    tinker_server,
    tiny_base,
    types,
)
from tinker.lib.public_interfaces.training_client import TrainingClient

TEXT = "40+2=42"


@pytest.fixture(scope="module")
def healthy(service_client, tiny_base):
    """A client whose forward must give the same log-probs before and after every refusal."""
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4).result()
    data = [sft_datum(tokenizer, TEXT)]
    expected = datum_logprobs(client.forward(data, "cross_entropy").result())[0]
    yield client
    np.testing.assert_array_equal(datum_logprobs(client.forward(data, "cross_entropy").result())[0], expected)


def _refused(future, *names: str) -> str:
    with pytest.raises(tinker.RequestFailedError) as excinfo:
        future.result()
    assert excinfo.value.category == types.RequestErrorCategory.User
    for name in names:
        assert name in str(excinfo.value)
    return str(excinfo.value)


def test_unknown_model_id(service_client, healthy, tiny_base):
    stray = TrainingClient(
        service_client.holder, model_seq_id=99, model_id="session-x:train:99", info=healthy.get_info()
    )
    data = [sft_datum(tiny_base[1], TEXT)]
    _refused(stray.forward(data, "cross_entropy"), "unknown model id", "session-x:train:99")


def test_unknown_adapter_path(service_client, healthy):
    with pytest.raises(tinker.BadRequestError, match="no checkpoint at 'tinker://nobody:train:0/sampler_weights/x'"):
        service_client.create_sampling_client(model_path="tinker://nobody:train:0/sampler_weights/x").result()
    with pytest.raises(tinker.BadRequestError, match="unknown base model 'not-a-model'"):
        service_client.create_sampling_client(base_model="not-a-model").result()


def test_token_ids_outside_the_vocabulary(service_client, healthy, tiny_base):
    path, tokenizer = tiny_base
    bad = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 10_000]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
    )
    _refused(healthy.forward([bad], "cross_entropy"), "data[0].model_input", "token id 10000", f"[0, {len(tokenizer)})")
    bad_target = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, -1], "weights": [1.0, 1.0, 1.0]},
    )
    _refused(healthy.forward_backward([bad_target], "cross_entropy"), "target_tokens", "token id -1")
    sampler = service_client.create_sampling_client(base_model=str(path)).result()
    _refused(
        sampler.sample(types.ModelInput.from_ints([5, 99_999]), 1, types.SamplingParams(max_tokens=2)),
        "prompt",
        "99999",
    )


def test_loss_inputs_of_the_wrong_shape_or_dtype(healthy, tiny_base):
    _, tokenizer = tiny_base
    ids = tokenizer.encode(TEXT)
    n = len(ids) - 1
    inputs = types.ModelInput.from_ints(ids[:-1])
    long_weights = types.Datum(
        model_input=inputs, loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (n + 1)}
    )
    _refused(healthy.forward_backward([long_weights], "cross_entropy"), "'weights'", f"shape [{n + 1}]", f"shape [{n}]")
    int_advantages = types.Datum(
        model_input=inputs,
        loss_fn_inputs={
            "target_tokens": ids[1:],
            "logprobs": [0.0] * n,
            "advantages": types.TensorData(data=[1] * n, dtype="int64", shape=[n]),
        },
    )
    _refused(healthy.forward_backward([int_advantages], "importance_sampling"), "'advantages'", "int64", "float32")
    missing = types.Datum(model_input=inputs, loss_fn_inputs={"target_tokens": ids[1:]})
    _refused(healthy.forward_backward([missing], "ppo"), "lacks", "'logprobs'", "'advantages'")


def test_sequence_over_the_context_limit(service_client, healthy, tiny_base):
    path, _ = tiny_base
    long = types.Datum(
        model_input=types.ModelInput.from_ints([3] * 97),
        loss_fn_inputs={"target_tokens": [3] * 97, "weights": [1.0] * 97},
    )
    _refused(healthy.forward([long], "cross_entropy"), "97 tokens", "context limit of 96")
    sampler = service_client.create_sampling_client(base_model=str(path)).result()
    _refused(
        sampler.sample(types.ModelInput.from_ints([3] * 90), 1, types.SamplingParams(max_tokens=10)),
        "context limit of 96",
    )


def test_rank_above_the_server_maximum(service_client, healthy, tiny_base):
    path, _ = tiny_base
    _refused(service_client.create_lora_training_client(base_model=str(path), rank=16), "rank=16", "max-lora-rank")


def test_request_for_a_session_that_ended(tinker_server, healthy, tiny_base):
    path, tokenizer = tiny_base
    other = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    client = other.create_lora_training_client(base_model=str(path), rank=4).result()
    session_id = other.holder.get_session_id()
    request = urllib.request.Request(
        f"{tinker_server.url}/api/v1/sessions/{session_id}/finish",
        data=json.dumps({"reason": {"type": "success"}}).encode(),
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    urllib.request.urlopen(request).read()
    _refused(client.forward([sft_datum(tokenizer, TEXT)], "cross_entropy"), session_id, "has ended")
    heartbeat = urllib.request.Request(
        f"{tinker_server.url}/api/v1/session_heartbeat",
        data=json.dumps({"session_id": session_id}).encode(),
        headers={"X-API-Key": API_KEY, "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as excinfo:
        urllib.request.urlopen(heartbeat)
    assert excinfo.value.code == 410
