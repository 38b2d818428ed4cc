"""Activation offload: the same loss and LoRA gradients as a run without it, bit for bit (compared in
float64, see tests/parallel_cases.py), with the saved activations really moved off the compute
device. On CPU the copies are forced (offload_host_tensors=True), which runs the same pack / unpack /
prefetch bookkeeping."""

import os
import subprocess
import sys
from pathlib import Path

import parallel_cases as cases
import pytest
import torch
from helpers import assert_close_reporting

from archon.lora import is_lora_param
from archon.parallel import ParallelConfig, ParallelDims, apply_activation_offload
from archon.precision import fp32_islands_in_fp64
from archon.tools.align import make_tiny_hf_checkpoint
from archon.trainer import Trainer

# The tiny models' hidden states are 128 tokens x 64 x 4 B = 32 KiB (64 KiB in float64): a threshold
# below that offloads them and keeps the smaller saved tensors (attention statistics, LoRA's rank-4
# activations).
MIN_BYTES = 4096
WORKER = Path(__file__).with_name("activation_offload_worker.py")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {
        # four blocks: the backward holds at most two blocks' offloaded tensors, fewer than all
        "qwen3": make_tiny_hf_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "hf", num_hidden_layers=4),
        "qwen3_5": make_tiny_hf_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen3_5") / "hf"),
    }


def _first_step(path, activation_checkpoint: str, offload: bool | None, dtype: str = "float32"):
    """Loss and LoRA gradients of one forward-backward over the packed batch (all six sequences in one
    micro-batch), and the ActivationOffload's stats: offload None runs without hooks, False counts
    only, True offloads (forced on CPU). `dtype`: of the base weights (float64: call it inside
    fp32_islands_in_fp64)."""
    parallel = ParallelConfig(activation_checkpoint=activation_checkpoint)
    trainer = Trainer(cases.engine_config(path, parallel, micro_batch_tokens=10_000, dtype=dtype))
    hooks = None
    if offload is not None:
        hooks = apply_activation_offload(
            trainer.model.layers, offload=offload, offload_host_tensors=True, min_bytes=MIN_BYTES
        )
    batch = cases.make_batch(trainer.loaded.args.vocab_size)
    cases.set_lora_values(trainer, seed=1)
    batch.old_logprobs = trainer.logprobs(batch).logprobs
    result = trainer.forward_backward(batch, cases.loss_fn, with_entropy=True)
    grads = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if is_lora_param(n)}
    return result["loss"], grads, hooks


@pytest.mark.parametrize("activation_checkpoint", ["none", "full", "selective"])
@pytest.mark.parametrize("model_type", ["qwen3", "qwen3_5"])
def test_offload_gives_the_same_loss_and_gradients(checkpoints, model_type, activation_checkpoint):
    path = checkpoints[model_type]
    with fp32_islands_in_fp64():
        loss, grads, _ = _first_step(path, activation_checkpoint, offload=None, dtype=cases.EQUALITY_DTYPE)
        counted_loss, counted_grads, counted = _first_step(
            path, activation_checkpoint, offload=False, dtype=cases.EQUALITY_DTYPE
        )
        offloaded_loss, offloaded_grads, offloaded = _first_step(
            path, activation_checkpoint, offload=True, dtype=cases.EQUALITY_DTYPE
        )

    where = f"{model_type} activation_checkpoint={activation_checkpoint}"
    assert_close_reporting(counted_loss, loss, 0.0, f"{where}, offload hooks counting only: loss")
    assert_close_reporting(offloaded_loss, loss, 0.0, f"{where}, offloaded: loss")
    assert grads.keys() == offloaded_grads.keys() == counted_grads.keys() and len(grads) > 0
    for name, grad in grads.items():
        assert grad.dtype == torch.float64 and torch.count_nonzero(grad) > 0, f"{where}: gradient {name}"
        assert_close_reporting(offloaded_grads[name], grad, 0.0, f"{where}, offloaded: gradient {name}")
        assert_close_reporting(counted_grads[name], grad, 0.0, f"{where}, offload hooks counting only: gradient {name}")

    assert counted.stats.tensors_offloaded == 0 and counted.stats.bytes_offloaded == 0
    assert offloaded.stats.tensors_offloaded > 0 and offloaded.stats.bytes_offloaded >= MIN_BYTES
    assert 0 < offloaded.stats.peak_resident_bytes < counted.stats.peak_resident_bytes
    # every saved activation was given back to autograd: nothing is left counted as resident
    assert counted.stats.resident_bytes == 0 and offloaded.stats.resident_bytes == 0


def test_full_checkpointing_offloads_the_block_inputs(checkpoints):
    """With full checkpointing what a block saves is its inputs: one hidden-state tensor a block, and
    the rotary cos and sin tables [T, head_dim] that every block reads, copied once."""
    _, _, offloaded = _first_step(checkpoints["qwen3"], "full", offload=True)
    tokens = sum(cases.SEQ_LENS)
    assert offloaded.stats.tensors_offloaded == 4 + 2
    assert offloaded.stats.bytes_offloaded == 4 * tokens * 64 * 4 + 2 * tokens * 16 * 4


def test_offload_is_refused_on_a_cpu_device(checkpoints):
    from archon.build import build_model

    with pytest.raises(ValueError, match=r"parallel\.activation_offload.*already live in host memory"):
        build_model(
            checkpoints["qwen3"], parallel=ParallelConfig(activation_offload=True), dims=ParallelDims(world_size=1)
        )


def test_offload_is_refused_with_compile():
    from archon.parallel.activation_offload import check_activation_offload

    with pytest.raises(ValueError, match=r"parallel\.activation_offload.*parallel\.compile"):
        check_activation_offload("cuda", compile=True)


def test_two_process_fsdp_with_offload_equals_without(checkpoints, tmp_path):
    """FSDP2 over two gloo ranks: with offload forced, the same loss and gradients."""
    out = tmp_path / "result.pt"
    # PYTHONFAULTHANDLER: a worker that crashes prints where it was
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(WORKER),
        str(checkpoints["qwen3"]),
        str(out),
    ]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-6000:]
    result = torch.load(out)
    assert_close_reporting(result["offloaded"]["loss"], result["plain"]["loss"], 0.0, "qwen3 fsdp2 offloaded: loss")
    assert result["plain"]["grads"].keys() == result["offloaded"]["grads"].keys() and result["plain"]["grads"]
    for name, grad in result["plain"]["grads"].items():
        assert grad.dtype == torch.float64, f"qwen3 fsdp2: gradient {name} is {grad.dtype}"
        assert_close_reporting(result["offloaded"]["grads"][name], grad, 0.0, f"qwen3 fsdp2 offloaded: gradient {name}")
    assert result["offloaded"]["tensors_offloaded"] > 0


def test_parameters_and_small_tensors_stay_put():
    """Each linear layer saves its input and its weight (a view of the parameter): only the inputs, at
    least OFFLOAD_MIN_BYTES, are offloaded, not the 2 MiB weight; the small sigmoid output is kept."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 512), torch.nn.Sequential(torch.nn.Linear(512, 4), torch.nn.Sigmoid())
    ).double()
    x = torch.randn(600, 512, dtype=torch.float64, requires_grad=True)  # 2.5 MB
    model[0].weight.requires_grad_(True)
    expected = torch.autograd.grad(model(x).sum(), [x, model[0].weight])

    hooks = apply_activation_offload([model[0], model[1]], offload_host_tensors=True)
    got = torch.autograd.grad(model(x).sum(), [x, model[0].weight])
    for name, g, e in zip(("input", "weight"), got, expected, strict=True):
        assert_close_reporting(g, e, 0.0, f"two linears with offload against without: gradient of the {name}")
    assert hooks.stats.tensors_offloaded == 2 and hooks.stats.bytes_offloaded == 2 * x.numel() * x.element_size()
    assert hooks.stats.resident_bytes == 0


def test_run_config_validation_names_the_field():
    import dataclasses

    from archon.rl.config.schema import ModelConfig, RLConfig
    from archon.rl.config.validation import _parallel_problems

    config = RLConfig(model=ModelConfig(device="cpu"), parallel=ParallelConfig(activation_offload=True))
    assert any("parallel.activation_offload" in p and "host memory" in p for p in _parallel_problems(config, 1))
    assert _parallel_problems(dataclasses.replace(config, parallel=ParallelConfig()), 1) == []
