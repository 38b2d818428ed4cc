"""The Tinker-compatible server (archon.serve) driven by the real `tinker` SDK: sessions, training
clients (forward, forward_backward, optim_step), sampling clients, checked against HF transformers
and against each other."""

from __future__ import annotations

import time

import numpy as np
import pytest
from test_tinker_fixtures import (  # noqa: F401 - fixtures
    API_KEY,
    datum_logprobs,
    hf_logprobs,
    service_client,
    sft_datum,
    tinker,
    tinker_server,
    tiny_base,
    types,
)

TEXT = "12+34=46"


def test_capabilities_list_the_base_model(tinker_server, tiny_base):
    rest = tinker.RestClient(base_url=tinker_server.url, api_key=API_KEY)
    capabilities = rest.get_server_capabilities().result()
    (model,) = capabilities.supported_models
    assert model.model_name == str(tiny_base[0])
    assert model.max_context_length == 96 and model.trainable and model.sampleable


def test_get_info_and_tokenizer(service_client, tiny_base):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4).result()
    info = client.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.arch == "qwen3"
    assert client.get_tokenizer().encode(TEXT) == tokenizer.encode(TEXT)


def test_forward_logprobs_match_hf_transformers(service_client, tiny_base):
    """A new adapter (B = 0) leaves the base's log-probs: those of HF's model of the checkpoint."""
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4).result()
    result = client.forward([sft_datum(tokenizer, TEXT)], "cross_entropy").result()
    (served,) = datum_logprobs(result)
    expected = hf_logprobs(path, tokenizer.encode(TEXT)).numpy()
    # fp32 model against fp64 HF: measured differences ~2e-7
    np.testing.assert_allclose(served, expected, atol=1e-5, rtol=0)
    assert result.metrics["loss:sum"] == pytest.approx(-expected.sum(), abs=1e-4)


def test_training_lowers_the_loss_and_forward_does_not_train(service_client, tiny_base):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=3).result()
    data = [sft_datum(tokenizer, TEXT, prompt_chars=6), sft_datum(tokenizer, "7+8=15", prompt_chars=4)]
    first = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    again = client.forward(data, "cross_entropy").result().metrics["loss:sum"]
    assert again == first  # forward alone leaves no gradient behind
    losses = []
    for _ in range(5):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result().metrics["loss:sum"])
        assert "grad_norm:mean" in step.result().metrics
    assert losses[0] == pytest.approx(first, abs=1e-5)
    assert losses[-1] < 0.7 * losses[0]


def test_two_training_clients_stay_independent(service_client, tiny_base):
    path, tokenizer = tiny_base
    trained = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=1).result()
    untouched = service_client.create_lora_training_client(base_model=str(path), rank=8, seed=1).result()
    data = [sft_datum(tokenizer, TEXT)]
    before = datum_logprobs(untouched.forward(data, "cross_entropy").result())[0]
    for _ in range(3):
        trained.forward_backward(data, "cross_entropy")
        trained.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    after_trained = datum_logprobs(trained.forward(data, "cross_entropy").result())[0]
    after_untouched = datum_logprobs(untouched.forward(data, "cross_entropy").result())[0]
    np.testing.assert_array_equal(after_untouched, before)
    assert np.abs(after_trained - before).max() > 1e-2


def _trained_sampler(service_client, tiny_base, steps: int = 3):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=5).result()
    for _ in range(steps):
        client.forward_backward([sft_datum(tokenizer, TEXT)], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return client, client.save_weights_and_get_sampling_client().result()


def test_sampling_logprobs_match_compute_logprobs_and_forward(service_client, tiny_base):
    """At temperature 1 a sampled token's log-prob is the model's: the same as compute_logprobs of
    prompt + completion, and as the training client's forward on it."""
    _, tokenizer = tiny_base
    client, sampler = _trained_sampler(service_client, tiny_base)
    prompt = tokenizer.encode("12+")
    response = sampler.sample(
        types.ModelInput.from_ints(prompt), 3, types.SamplingParams(max_tokens=6, seed=7)
    ).result()
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        tokens = prompt + sequence.tokens
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
        assert scored[0] is None
        # one fp32 model, two computations (a packed prefill with a KV cache vs one forward): measured ~1e-6
        np.testing.assert_allclose(sequence.logprobs, scored[len(prompt) :], atol=1e-5, rtol=0)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
        )
        forward = datum_logprobs(client.forward([datum], "cross_entropy").result())[0]
        np.testing.assert_allclose(forward[len(prompt) - 1 :], sequence.logprobs, atol=1e-5, rtol=0)


def test_sampling_params_seed_stop_and_topk(service_client, tiny_base):
    _, tokenizer = tiny_base
    _, sampler = _trained_sampler(service_client, tiny_base, steps=1)
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+"))

    def sample(n=1, **params):
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result().sequences

    seeded = [s.tokens for s in sample(n=2, max_tokens=8, seed=11)]
    assert seeded == [s.tokens for s in sample(n=2, max_tokens=8, seed=11)]
    (greedy,) = sample(max_tokens=8, temperature=0.0, stop=[])
    assert len(greedy.tokens) == 8 and greedy.stop_reason == "length"
    (by_id,) = sample(max_tokens=8, temperature=0.0, stop=[greedy.tokens[2]])
    first = greedy.tokens.index(greedy.tokens[2])
    assert by_id.tokens == greedy.tokens[: first + 1] and by_id.stop_reason == "stop"
    stop_text = tokenizer.decode(greedy.tokens[3:5])
    (by_text,) = sample(max_tokens=8, temperature=0.0, stop=[stop_text])
    text = tokenizer.decode(by_text.tokens)
    assert text.endswith(stop_text) and stop_text not in text[:-1] and by_text.stop_reason == "stop"
    topk = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0, stop=[]), topk_sample_logprobs=3
    ).result()
    (sequence,) = topk.sequences
    for token, top in zip(sequence.tokens, sequence.topk_logprobs):
        assert len(top) == 3 and top[0][0] == token
        assert top[0][1] >= top[1][1] >= top[2][1]


def test_prompt_logprobs_and_topk_prompt_logprobs(service_client, tiny_base):
    path, tokenizer = tiny_base
    sampler = service_client.create_sampling_client(base_model=str(path)).result()
    tokens = tokenizer.encode(TEXT)
    response = sampler.sample(
        types.ModelInput.from_ints(tokens),
        1,
        types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
    ).result()
    expected = hf_logprobs(path, tokens).numpy()
    assert response.prompt_logprobs[0] is None
    np.testing.assert_allclose(response.prompt_logprobs[1:], expected, atol=1e-5, rtol=0)
    assert response.topk_prompt_logprobs[0] is None
    for top, scored in zip(response.topk_prompt_logprobs[1:], expected):
        assert len(top) == 2 and top[0][1] >= max(scored, top[1][1]) - 1e-6


def test_wrong_api_key_is_refused(tinker_server):
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=tinker_server.url, api_key="tml-wrong").get_server_capabilities().result()


def test_command_line_and_loopback_default(capsys):
    """The command line of `python -m archon.serve` (tests/test_tinker_parallel.py runs the start-up
    it calls, archon.serve.__main__.run, under torchrun on command lines it parses)."""
    from archon.serve.__main__ import main
    from archon.serve.config import ServeConfig

    assert ServeConfig(base_model="x").host == "127.0.0.1"
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    usage = capsys.readouterr().out
    for flag in ("--base-model", "--port", "--host", "--api-key", "--max-lora-rank"):
        assert flag in usage
    with pytest.raises(ValueError, match="max_lora_rank"):
        ServeConfig(base_model="x", max_lora_rank=0)


def test_the_api_key_and_the_vllm_servers_secrets_are_redacted_from_the_servers_logs(monkeypatch, capsys):
    """`python -m archon.serve` registers its config's secrets (archon.secrets) before it serves, and
    logs through a handler that redacts them (the process starts with none on the root logger)."""
    import logging

    import archon.serve.__main__ as serve_main
    from archon.secrets import REDACTED, forget_secrets, redact

    served = []
    monkeypatch.setattr(serve_main, "run", served.append)
    root = logging.getLogger()
    handlers_before = list(root.handlers)
    root.handlers[:] = []  # as in a fresh process (pytest installs its own)
    forget_secrets()
    try:
        key, vllm_key = "tml-serve-key-8d1f", "vllm-key-77c2"
        serve_main.main(["--base-model", "x", "--api-key", key, "--vllm.api-key", vllm_key])
        (config,) = served
        assert config.api_key == key and config.vllm.api_key == vllm_key
        assert redact(f"key {key}, vLLM key {vllm_key}") == f"key {REDACTED}, vLLM key {REDACTED}"
        logging.getLogger("archon.serve").warning("request with %s and %s", key, vllm_key)
        logged = capsys.readouterr().err
        assert f"request with {REDACTED} and {REDACTED}" in logged and key not in logged
    finally:
        root.handlers[:] = handlers_before
        forget_secrets()


def _wait_until_queued(server, count: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while server.futures.queued() < count and time.monotonic() < deadline:
        time.sleep(0.02)


def test_queued_sample_requests_share_a_generation(service_client, tiny_base, tinker_server):
    """Sample requests of one sampler and settings that wait in the queue together run as one
    generation; each still gets its own samples, at the model's log-probs. Seeded ones run alone."""
    _, tokenizer = tiny_base
    _, sampler = _trained_sampler(service_client, tiny_base, steps=1)
    backend = tinker_server.backend
    before = len(backend.generation_sizes)
    tinker_server.futures.submit(lambda: _wait_until_queued(tinker_server, 5))  # holds the worker while they queue
    prompts = [tokenizer.encode(text) for text in ("1+", "22+", "3+3", "40+")]
    params = types.SamplingParams(max_tokens=5, stop=[])
    futures = [sampler.sample(types.ModelInput.from_ints(p), 2, params) for p in prompts]
    seeded = sampler.sample(types.ModelInput.from_ints(prompts[0]), 2, types.SamplingParams(max_tokens=5, seed=3))
    responses = [f.result() for f in futures]
    seeded.result()
    sizes = backend.generation_sizes[before:]
    assert max(sizes) > 1 and sum(sizes) == 5 and 1 in sizes
    for prompt, response in zip(prompts, responses):
        assert len(response.sequences) == 2
        for sequence in response.sequences:
            assert len(sequence.tokens) == 5
            scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + sequence.tokens)).result()
            # one fp32 model, two computations: measured ~1e-6
            np.testing.assert_allclose(sequence.logprobs, scored[len(prompt) :], atol=1e-5, rtol=0)
