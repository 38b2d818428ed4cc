"""TP x2 (gloo, two processes) gives the single-process hidden states and LoRA gradients for the
group-limited MoE families (models/common/moe_parallel.py): GLM-4.5 with QK-norm and q/k/v bias,
DeepSeek-V3 with and without the query bottleneck. MLA's rotary key is shared by all heads but each
rank uses it for its own heads only, so its gradient must be summed over the ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dense_parallel_worker.py")  # takes any family's checkpoints
TOLERANCE = 1e-5
CASES = {
    "glm4_moe": ("glm4_moe", {}),
    "deepseek_v3-q-lora": ("deepseek_v3", {}),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
}


@pytest.mark.slow
def test_tp2_matches_one_process(tiny_checkpoint, tmp_path):
    dirs = {case: str(tiny_checkpoint(model_type, **overrides)) for case, (model_type, overrides) in CASES.items()}
    out = tmp_path / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           str(out), *dirs.values()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for case, hf_dir in dirs.items():
        figures = results[hf_dir]["tp2"]
        assert figures["hidden_max_abs"] <= TOLERANCE, (case, figures)
        assert figures["grad_max_rel"] <= TOLERANCE, (case, figures)
