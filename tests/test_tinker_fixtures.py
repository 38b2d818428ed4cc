"""What the Tinker-compatible server's tests share: a tiny random Qwen3 checkpoint over a character
tokenizer, a server on it (archon.serve, on a free port, with an API key), and the real `tinker`
SDK's clients pointed at it. The other tests/test_tinker_*.py files import these fixtures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archon.rl.tasks import build_char_tokenizer
from archon.serve.config import ServeConfig
from archon.serve.server import start_server
from archon.tools.align import make_tiny_hf_checkpoint

tinker = pytest.importorskip("tinker")
types = tinker.types

API_KEY = "tml-archon-test-key"


@pytest.fixture(scope="session")
def tiny_base(tmp_path_factory):
    """(checkpoint directory with its tokenizer, the tokenizer)."""
    tokenizer = build_char_tokenizer()
    path = make_tiny_hf_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("tinker_base") / "hf",
        vocab_size=len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        max_position_embeddings=96,
    )
    tokenizer.save_pretrained(path)
    return path, tokenizer


@pytest.fixture(scope="session")
def tinker_server(tiny_base, tmp_path_factory):
    path, _ = tiny_base
    config = ServeConfig(
        base_model=str(path),
        port=0,
        api_key=API_KEY,
        max_lora_rank=8,
        checkpoint_dir=str(tmp_path_factory.mktemp("tinker_checkpoints")),
    )
    server = start_server(config)
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def service_client(tinker_server):
    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    yield client
    client.close("success").result()


def sft_datum(tokenizer, text: str, prompt_chars: int = 0):
    """A next-token datum of `text`: inputs text[:-1], targets text[1:], weight 1 after the prompt."""
    ids = tokenizer.encode(text)
    weights = [0.0 if i < prompt_chars - 1 else 1.0 for i in range(len(ids) - 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": ids[1:], "weights": weights},
    )


def datum_logprobs(result) -> list[np.ndarray]:
    return [np.asarray(out["logprobs"].to_numpy(), dtype=np.float64) for out in result.loss_fn_outputs]


def hf_logprobs(path, tokens: list[int]) -> torch.Tensor:
    """log p(tokens[t + 1] | tokens[: t + 1]) under HF transformers' model of the checkpoint, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
