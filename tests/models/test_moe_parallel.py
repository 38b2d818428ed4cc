"""TP x2 (gloo, two processes) gives the single-process hidden states, label log-probs and LoRA
gradients for the MoE families of models/common/moe_parallel.py: GLM-4.5 with QK-norm and q/k/v
bias, DeepSeek-V3 with and without the query bottleneck, GPT-OSS with attention sinks sharded with
the q heads (and under FSDP x2 as well). MLA's rotary key is shared by all heads but each rank uses
it for its own heads only, so its gradient must be summed over the ranks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dense_parallel_worker.py")  # takes any family's checkpoints
TOLERANCE = 1e-10  # float64 against float64 (the worker runs inside fp32_islands_in_fp64)
# case: (model_type, config overrides, layouts of the worker)
CASES = {
    "glm4_moe": ("glm4_moe", {}, ("tp2",)),
    "deepseek_v3-q-lora": ("deepseek_v3", {}, ("tp2",)),
    "deepseek_v3-no-q-lora": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False), ("tp2",)),
    # The registered tiny config: sinks, q/k/v/o bias, window on even layers, untied head.
    "gpt_oss": ("gpt_oss", {}, ("tp2", "fsdp2")),
    # A DeltaNet layer (fused in_proj_qkvz / in_proj_ba sharded by key head) with a sparse MLP, then a
    # gated attention layer with a dense one.
    "qwen3_next": (
        "qwen3_next",
        dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], mlp_only_layers=[1]),
        ("tp2", "fsdp2"),
    ),
    # DeepSeek sparse attention (GLM-5: a layer sharing an earlier layer's selection): the indexer
    # replicated, every rank selecting the same keys for its own heads.
    "glm_moe_dsa": ("glm_moe_dsa", {}, ("tp2", "fsdp2")),
    # q_norm / k_norm over the whole projection: sharded with it, the statistic summed over the ranks.
    "minimax_m2": ("minimax_m2", {}, ("tp2", "fsdp2")),
    # KDA layers sharded by head (projections, convs, forget gate, gated norm) around an MLA layer.
    "kimi_linear": ("kimi_linear", {}, ("tp2", "fsdp2")),
}


@pytest.mark.slow
def test_parallel_layouts_match_one_process(tiny_checkpoint, tmp_path):
    dirs = {case: str(tiny_checkpoint(model_type, **overrides)) for case, (model_type, overrides, _) in CASES.items()}
    out = tmp_path / "results.json"
    checkpoints = [f"{dirs[case]}@{','.join(layouts)}" for case, (_, _, layouts) in CASES.items()]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(WORKER),
        str(out),
        *checkpoints,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(out.read_text())
    for case, (_, _, layouts) in CASES.items():
        assert sorted(results[dirs[case]]) == sorted(layouts), case
        for layout in layouts:
            figures = results[dirs[case]][layout]
            assert figures["hidden_max_abs"] <= TOLERANCE, (case, layout, figures)
            assert figures["logprob_max_abs"] <= TOLERANCE, (case, layout, figures)
            assert figures["grad_max_rel"] <= TOLERANCE, (case, layout, figures)
