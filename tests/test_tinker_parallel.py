"""The Tinker-compatible server under torchrun (FSDP2 over 2 ranks, gloo on CPU) against one process:
the same SDK calls give the same numbers. Both servers run in float64 with fp32 islands kept in fp64
(archon.precision), so what is left between them is float64 rounding."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file
from test_tinker_fixtures import API_KEY, sft_datum, tinker, tiny_base, types  # noqa: F401 - fixtures

from archon.precision import fp32_islands_in_fp64
from archon.serve.adapters import checkpoint_dir
from archon.serve.config import ServeConfig
from archon.serve.server import start_server

TOL = 1e-10  # float64 against float64
# Log-probs travel as float32 (the SDK's wire format): values that agree to ~1e-14 in float64 can round
# to neighbouring float32 values, so they are compared to one float32 ulp (2**-23 relative).
WIRE_RTOL = 2.0**-23
SERVE_TIMEOUT = 300


def drive(url: str, base: Path, tokenizer, checkpoints: Path) -> dict:
    """Two forward_backward + optim_step rounds, a forward, the adapter as saved, and seeded samples
    with their compute_logprobs, through the SDK."""
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    client = service.create_lora_training_client(base_model=str(base), rank=4, seed=3).result()
    data = [sft_datum(tokenizer, "12+34=46", prompt_chars=6), sft_datum(tokenizer, "7+8=15", prompt_chars=4)]
    out: dict = {"loss": [], "grad_norm": [], "logprobs": []}
    # a refused request is refused on every rank alike, and every rank goes on serving in step
    bad = types.Datum(model_input=types.ModelInput.from_ints([10**6]), loss_fn_inputs={"target_tokens": [1]})
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        client.forward_backward([bad], "cross_entropy").result()
    for _ in range(2):
        fb = client.forward_backward(data, "cross_entropy")
        step = client.optim_step(types.AdamParams(learning_rate=2e-2, grad_clip_norm=1.0)).result()
        fb = fb.result()
        out["loss"].append(fb.metrics["loss:sum"])
        out["grad_norm"].append(step.metrics["grad_norm:mean"])
        out["logprobs"].append([o["logprobs"].to_numpy() for o in fb.loss_fn_outputs])
    after = client.forward(data, "cross_entropy").result()
    out["loss"].append(after.metrics["loss:sum"])
    out["logprobs"].append([o["logprobs"].to_numpy() for o in after.loss_fn_outputs])
    path = client.save_weights_for_sampler("parity").result().path
    out["adapter"] = load_file(checkpoint_dir(checkpoints, path) / "adapter" / "adapter_model.safetensors")
    sampler = client.create_sampling_client(path).result()
    prompt = tokenizer.encode("12+")
    response = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=6, seed=7))
    out["samples"] = [(s.tokens, s.logprobs) for s in response.result().sequences]
    tokens = prompt + out["samples"][0][0]
    out["compute_logprobs"] = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:]
    service.close("success").result()
    return out


def _serving_url(proc: subprocess.Popen, lines: list[str]) -> str:
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("archon.serve: serving"):
            threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
            return line.split(" at ")[1].split()[0]
    raise RuntimeError(f"the torchrun server exited with {proc.wait()}:\n{''.join(lines)[-6000:]}")


@pytest.fixture(scope="module")
def fsdp2_run(tiny_base, tmp_path_factory):
    path, tokenizer = tiny_base
    checkpoints = tmp_path_factory.mktemp("tinker_fsdp2")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "archon.serve",
        "--base-model",
        str(path),
        "--port",
        "0",
        "--api-key",
        API_KEY,
        "--max-lora-rank",
        "8",
        "--dtype",
        "float64",
        "--checkpoint-dir",
        str(checkpoints),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    try:
        url = _serving_url(proc, lines)
        out = drive(url, path, tokenizer, checkpoints)
        service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
        client = service.create_lora_training_client(base_model=str(path), rank=4).result()
        with pytest.raises(tinker.RequestFailedError, match="not served under torchrun"):
            client.save_state("with-optimizer").result()
        yield out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def one_process(tiny_base, tmp_path_factory):
    path, tokenizer = tiny_base
    checkpoints = tmp_path_factory.mktemp("tinker_one")
    config = ServeConfig(
        base_model=str(path), port=0, api_key=API_KEY, max_lora_rank=8, dtype="float64", checkpoint_dir=str(checkpoints)
    )
    with fp32_islands_in_fp64():
        server = start_server(config)
        try:
            return drive(server.url, path, tokenizer, checkpoints)
        finally:
            server.shutdown()
            server.server_close()


def test_fsdp2_two_ranks_gives_the_numbers_of_one_process(fsdp2_run, one_process):
    np.testing.assert_allclose(fsdp2_run["loss"], one_process["loss"], atol=TOL, rtol=0)
    np.testing.assert_allclose(fsdp2_run["grad_norm"], one_process["grad_norm"], atol=TOL, rtol=0)
    assert one_process["loss"][2] < one_process["loss"][0]  # the two steps trained the adapter
    for got, want in zip(fsdp2_run["logprobs"], one_process["logprobs"]):
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=WIRE_RTOL, atol=TOL)
    assert fsdp2_run["adapter"].keys() == one_process["adapter"].keys()
    for name, want in one_process["adapter"].items():
        assert want.dtype == fsdp2_run["adapter"][name].dtype
        np.testing.assert_allclose(fsdp2_run["adapter"][name].numpy(), want.numpy(), atol=TOL, rtol=0)
    assert [tokens for tokens, _ in fsdp2_run["samples"]] == [tokens for tokens, _ in one_process["samples"]]
    for (_, got), (_, want) in zip(fsdp2_run["samples"], one_process["samples"]):
        np.testing.assert_allclose(got, want, rtol=WIRE_RTOL, atol=TOL)
    np.testing.assert_allclose(fsdp2_run["compute_logprobs"], one_process["compute_logprobs"], rtol=WIRE_RTOL, atol=TOL)
