"""TP x2 (gloo, two processes) gives the single-process hidden states and LoRA gradients with the
dense families' TP plan: llama with attention and MLP biases (column- and row-parallel biases),
qwen2 with a sliding window, olmo3 with QK-norms over the whole projections (and under FSDP x2).
FSDP2 is the families' shared pipeline and is tested with it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from archon.rollout.vllm_network import free_port

WORKER = Path(__file__).with_name("dense_parallel_worker.py")
TOLERANCE = 1e-10  # float64 against float64 (the worker runs inside fp32_islands_in_fp64)
CASES = {
    "llama": dict(attention_bias=True, mlp_bias=True),
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    # QK-norms over the whole projections: the sum of squares spans both ranks' heads.
    "olmo3": dict(),
    "gemma3_text": dict(),
}
# Layouts of the worker per case (tp2 when not listed).
LAYOUTS = {"olmo3": ("tp2", "fsdp2"), "gemma3_text": ("tp2", "fsdp2")}


@pytest.mark.slow
def test_tp2_matches_one_process(tiny_checkpoint, tmp_path):
    dirs = {model_type: str(tiny_checkpoint(model_type, **overrides)) for model_type, overrides in CASES.items()}
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port("127.0.0.1")),
        str(WORKER),
        str(out),
        *(f"{hf_dir}@{','.join(LAYOUTS.get(model_type, ('tp2',)))}" for model_type, hf_dir in dirs.items()),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for model_type, hf_dir in dirs.items():
        for layout in LAYOUTS.get(model_type, ("tp2",)):
            figures = results[hf_dir][layout]
            assert figures["hidden_max_abs"] <= TOLERANCE, (model_type, layout, figures)
            assert figures["logprob_max_abs"] <= TOLERANCE, (model_type, layout, figures)
            assert figures["grad_max_rel"] <= TOLERANCE, (model_type, layout, figures)
