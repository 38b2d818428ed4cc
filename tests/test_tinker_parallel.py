"""The Tinker-compatible server under torchrun (2 ranks, gloo on CPU) against one process: the same
SDK calls give the same numbers under FSDP2 and TP x2 on a dense Qwen3 and under EP x2 on a
Qwen3-MoE. One torchrun launch serves the three layouts in turn (tests/tinker_parallel_worker.py,
through archon.serve's own start-up). Every server runs in float64 with fp32 islands kept in fp64
(archon.precision), so what is left between them is float64 rounding."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_tinker_fixtures import API_KEY  # noqa: F401 - also loads the SDK (importorskip)
from tinker_parallel_worker import LAYOUTS, drive, serve_args

from archon.parallel import ParallelConfig
from archon.precision import fp32_islands_in_fp64
from archon.rl.tasks import build_char_tokenizer
from archon.serve.__main__ import parse
from archon.serve.config import ServeConfig
from archon.serve.ranks import init_ranks
from archon.serve.server import start_server
from archon.tools.align import make_tiny_hf_checkpoint

TOL = 1e-10  # float64 against float64
# Log-probs travel as float32 (the SDK's wire format): values that agree to ~1e-14 in float64 can round
# to neighbouring float32 values, so they are compared to one float32 ulp (2**-23 relative).
WIRE_RTOL = 2.0**-23
WORKER = Path(__file__).parent / "tinker_parallel_worker.py"
VOCAB = 104
"""The character tokenizer's 103 ids, padded to a size TP x2 can split (vocabulary-parallel head)."""


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """{"dense": a tiny Qwen3, "moe": a tiny Qwen3-MoE (8 experts)}, each with the character tokenizer."""
    tokenizer = build_char_tokenizer()
    root = tmp_path_factory.mktemp("tinker_parallel_bases")
    out = {}
    for name, model_type in (("dense", "qwen3"), ("moe", "qwen3_moe")):
        path = make_tiny_hf_checkpoint(
            model_type, root / name, vocab_size=VOCAB, eos_token_id=tokenizer.eos_token_id, max_position_embeddings=96
        )
        tokenizer.save_pretrained(path)
        out[name] = path
    return out


def one_process(base: Path, checkpoints: Path) -> dict:
    config = parse(serve_args(base, checkpoints))
    with fp32_islands_in_fp64():
        server = start_server(config)
        try:
            return drive(server.url, base, build_char_tokenizer(), checkpoints)
        finally:
            server.shutdown()
            server.server_close()


@pytest.fixture(scope="module")
def runs(bases, tmp_path_factory):
    """({layout: what the SDK got from the 2-rank server}, {base: what it got from one process}).
    The torchrun launch runs while this process serves the one-process references."""
    out_dir = tmp_path_factory.mktemp("tinker_parallel")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(WORKER),
        str(out_dir),
        str(bases["dense"]),
        str(bases["moe"]),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        reference = {name: one_process(path, out_dir / f"one_{name}") for name, path in bases.items()}
        log, _ = proc.communicate(timeout=420)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log[-8000:]
    layouts = {layout: pickle.loads((out_dir / f"{layout}.pkl").read_bytes()) for layout in LAYOUTS}
    return layouts, reference


def assert_same_numbers(got: dict, want: dict) -> None:
    np.testing.assert_allclose(got["loss"], want["loss"], atol=TOL, rtol=0)
    np.testing.assert_allclose(got["grad_norm"], want["grad_norm"], atol=TOL, rtol=0)
    assert want["loss"][2] < want["loss"][0]  # the two steps trained the adapter
    for got_step, want_step in zip(got["logprobs"], want["logprobs"], strict=True):
        for g, w in zip(got_step, want_step, strict=True):
            np.testing.assert_allclose(g, w, rtol=WIRE_RTOL, atol=TOL)
    # the saved adapter is the whole PEFT adapter (every rank's shard gathered), as one process writes it
    assert got["adapter"].keys() == want["adapter"].keys()
    for name, tensor in want["adapter"].items():
        assert got["adapter"][name].dtype == tensor.dtype and got["adapter"][name].shape == tensor.shape, name
        np.testing.assert_allclose(got["adapter"][name].numpy(), tensor.numpy(), atol=TOL, rtol=0)
    for kind in ("samples_snapshot", "samples_live"):
        assert [tokens for tokens, _ in got[kind]] == [tokens for tokens, _ in want[kind]], kind
        for (_, g), (_, w) in zip(got[kind], want[kind], strict=True):
            np.testing.assert_allclose(g, w, rtol=WIRE_RTOL, atol=TOL)
    np.testing.assert_allclose(got["compute_logprobs"], want["compute_logprobs"], rtol=WIRE_RTOL, atol=TOL)


EXPECTED_LAYOUTS = {
    "fsdp2": ({"tp": 1, "ep": 1, "dp_shard": 2}, {"layers.0.self_attn.q_proj.weight": {"dp_shard": "S(0)"}}),
    "tp2": ({"tp": 2, "ep": 1, "dp_shard": 1}, {"layers.0.self_attn.q_proj.weight": {"tp": "S(0)"}}),
    "ep2": (
        {"tp": 1, "ep": 2, "dp_shard": 2},
        {
            "layers.0.self_attn.q_proj.weight": {"dp_shard": "S(0)"},
            "layers.1.mlp.experts.down_proj": {"dp_replicate": "R", "dp_shard_mod_ep": "R", "ep": "S(0)"},
        },
    ),
}
"""Each layout's degrees, and the placements (by mesh dimension) of base weights it must have laid
out: FSDP2's shard on dp_shard, TP's column split on tp, EP's expert split on ep (replicated over the
data-parallel dimensions) beside FSDP2's shard of the attention."""


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_ranks_give_the_numbers_of_one_process(runs, layout):
    layouts, reference = runs
    degrees, placements = EXPECTED_LAYOUTS[layout]
    ran = layouts[layout]["layout"]
    assert {k: ran[k] for k in degrees} == degrees
    assert {k: ran["placements"][k] for k in placements} == placements
    assert_same_numbers(layouts[layout], reference[LAYOUTS[layout][0]])


def test_the_moe_adapter_holds_expert_factors(runs):
    """EP splits the routed experts' LoRA factors over the ranks; the saved adapter holds all of them."""
    _, reference = runs
    assert any("experts" in name for name in reference["moe"]["adapter"])


def test_layouts_that_cannot_be_served_are_refused_at_start(monkeypatch):
    with pytest.raises(ValueError, match="parallel.cp=2: context parallelism is not served"):
        ServeConfig(base_model="unused", parallel=ParallelConfig(cp=2))
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process
    with pytest.raises(
        ValueError, match=r"--parallel\.\* asks for .*tp=2, ep=1 over 1 rank.*torchrun --nproc-per-node N"
    ):
        init_ranks(ServeConfig(base_model="unused", parallel=ParallelConfig(tp=2)))
    assert init_ranks(ServeConfig(base_model="unused")) == (None, 0)
