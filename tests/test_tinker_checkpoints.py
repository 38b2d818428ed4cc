"""Checkpoints through the SDK: save_state / load_state (adapter and optimizer), save_weights_for_sampler
and sampling clients made from tinker:// paths, and the export of a checkpoint to a PEFT directory
that PEFT loads on the HF base model."""

from __future__ import annotations

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

from archon.serve.export import main as export_main

TEXT = "21+21=42"
PROBE = "8+1=9"


def _train(client, tokenizer, steps: int) -> None:
    for _ in range(steps):
        client.forward_backward([sft_datum(tokenizer, TEXT)], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=3e-2)).result()


def _probe(client, tokenizer) -> np.ndarray:
    return datum_logprobs(client.forward([sft_datum(tokenizer, PROBE)], "cross_entropy").result())[0]


def test_save_state_and_resume_with_the_optimizer(service_client, tiny_base):
    """A client made from a save_state checkpoint with its optimizer continues exactly as the saved
    one does; made without the optimizer, it starts with the same weights but fresh Adam moments."""
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=2).result()
    _train(client, tokenizer, 2)
    saved = client.save_state("resume-me").result().path
    assert saved == f"tinker://{client.model_id}/weights/resume-me"
    resumed = service_client.create_training_client_from_state_with_optimizer(saved).result()
    weights_only = service_client.create_training_client_from_state(saved).result()
    assert resumed.get_info().lora_rank == 4
    np.testing.assert_array_equal(_probe(resumed, tokenizer), _probe(client, tokenizer))
    np.testing.assert_array_equal(_probe(weights_only, tokenizer), _probe(client, tokenizer))
    for c in (client, resumed, weights_only):
        _train(c, tokenizer, 1)
    # the same fp32 arithmetic from the same state: equal to ~1e-7
    np.testing.assert_allclose(_probe(resumed, tokenizer), _probe(client, tokenizer), atol=1e-6, rtol=0)
    assert np.abs(_probe(weights_only, tokenizer) - _probe(client, tokenizer)).max() > 1e-4


def test_load_state_into_a_client_and_overwrite(service_client, tiny_base):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=4).result()
    _train(client, tokenizer, 1)
    saved = client.save_state("first").result().path
    expected = _probe(client, tokenizer)
    with pytest.raises(tinker.RequestFailedError, match="exists already"):
        client.save_state("first").result()
    _train(client, tokenizer, 2)
    assert np.abs(_probe(client, tokenizer) - expected).max() > 1e-3
    client.load_state(saved).result()
    np.testing.assert_array_equal(_probe(client, tokenizer), expected)
    other = service_client.create_lora_training_client(base_model=str(path), rank=8).result()
    with pytest.raises(tinker.RequestFailedError, match="does not fit"):
        other.load_state(saved).result()
    with pytest.raises(tinker.RequestFailedError, match="no checkpoint"):
        client.load_state(f"tinker://{client.model_id}/weights/never-saved").result()


def test_sampler_weights_path_serves_the_adapter(service_client, tiny_base):
    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=6).result()
    _train(client, tokenizer, 3)
    saved = client.save_weights_for_sampler("for-sampling").result().path
    assert saved == f"tinker://{client.model_id}/sampler_weights/for-sampling"
    sampler = service_client.create_sampling_client(model_path=saved).result()
    base_sampler = service_client.create_sampling_client(base_model=str(path)).result()
    tokens = tokenizer.encode(TEXT)
    served = np.asarray(sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
    base = np.asarray(base_sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:])
    trained = datum_logprobs(client.forward([sft_datum(tokenizer, TEXT)], "cross_entropy").result())[0]
    # one fp32 model, two computations: measured ~1e-6
    np.testing.assert_allclose(served, trained, atol=1e-5, rtol=0)
    assert np.abs(base - trained).max() > 1e-2


def test_checkpoint_exports_to_a_peft_directory_peft_loads(service_client, tiny_base, tinker_server, tmp_path):
    """The oracle is PEFT on HF transformers: the exported adapter on the HF base gives the log-probs
    the server's training client computes."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    path, tokenizer = tiny_base
    client = service_client.create_lora_training_client(base_model=str(path), rank=4, seed=8).result()
    _train(client, tokenizer, 3)
    saved = client.save_state("to-export").result().path
    out = tmp_path / "peft"
    export_main([saved, str(out), "--checkpoint-dir", tinker_server.config.checkpoint_dir])
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64), out)
    tokens = tokenizer.encode(TEXT)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0].numpy()
    served = datum_logprobs(client.forward([sft_datum(tokenizer, TEXT)], "cross_entropy").result())[0]
    # fp32 server against fp64 PEFT: measured ~3e-7
    np.testing.assert_allclose(served, expected, atol=1e-5, rtol=0)
