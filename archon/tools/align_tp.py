"""Gate v2's tensor-parallel check: the model under TP x2 (two gloo processes on CPU) against one
process, on the gate's packed batch with the same random LoRA on both.

    python -m archon.tools.align_tp HF_DIR OUT_JSON [DTYPE]     (under torch.distributed.run, 2 processes)

`tp_check(hf_dir, dtype)` launches it and returns the largest |Δ hidden state|, |Δ label log-prob| and
relative LoRA-gradient error (of mean(h^2)), or raises with the workers' last output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from archon.build import build_model
from archon.checkpoint.hf import copy_local_into, local_region
from archon.head import label_logprobs
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import full_tensor
from archon.parallel import ParallelConfig, reduce_partial_grads
from archon.rollout.vllm_network import free_port
from archon.tools.tiny_checkpoint import make_tiny_hf_checkpoint

SEQ_LENS = (7, 1, 13, 33)
# TP x2 against one process, by dtype: fp32 rounding of the sharded matmuls and reductions (measured
# at most 2.1e-6 on the tiny glm4 model, 2026-12-06), fp64 rounding (measured 8.9e-16).
TP_TOLERANCES = {"float32": 1e-5, "float64": 1e-10}


def _packed(vocab_size: int):
    g = torch.Generator().manual_seed(0)
    tokens = torch.cat([torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS])
    positions = torch.cat([torch.arange(n) for n in SEQ_LENS])
    cu_seqlens = torch.tensor([0, *torch.tensor(SEQ_LENS).cumsum(0).tolist()])
    return tokens, positions, cu_seqlens


def _hidden_logprobs_grads(model, tokens, positions, cu_seqlens):
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in sorted(lora_parameters(model).items()):
            full = torch.randn(param.shape, generator=g) * 0.1
            region = local_region(param)
            copy_local_into(param, full if region is None else full[region], name)
    hidden = model(tokens, positions, cu_seqlens, max(SEQ_LENS), return_hidden=True)
    with torch.no_grad():
        logprobs, _ = label_logprobs(hidden.detach(), model.output_weight, tokens.roll(-1))
    hidden.to(torch.promote_types(hidden.dtype, torch.float32)).pow(2).mean().backward()
    reduce_partial_grads(model)
    grads = {n: full_tensor(p.grad).clone() for n, p in lora_parameters(model).items() if p.grad is not None}
    return hidden.detach(), logprobs, grads


def _worker(hf_dir: str, out: str, dtype_name: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    dtype = getattr(torch, dtype_name)
    lora = LoRAConfig(rank=4, alpha=8.0)
    one = build_model(hf_dir, lora=lora, dtype=dtype).model
    tokens, positions, cu_seqlens = _packed(one.args.vocab_size)
    ref_hidden, ref_logprobs, ref_grads = _hidden_logprobs_grads(one, tokens, positions, cu_seqlens)
    config = ParallelConfig(tp=2, dp_shard=1)
    sharded = build_model(hf_dir, lora=lora, dtype=dtype, parallel=config, dims=config.dims(2, "cpu")).model
    hidden, logprobs, grads = _hidden_logprobs_grads(sharded, tokens, positions, cu_seqlens)
    result = {
        "tp2_hidden_max_abs": (hidden - ref_hidden).abs().max().item(),
        "tp2_logprob_max_abs": (logprobs - ref_logprobs).abs().max().item(),
        "tp2_grad_max_rel": max(
            (((grads[n] - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item() for n, ref in ref_grads.items()),
            default=0.0,
        ),
        "tp2_lora_params_without_grad": sorted(ref_grads.keys() ^ grads.keys()),
    }
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def tp_check(hf_dir: str | Path, dtype: str = "float32", timeout_s: int = 300) -> dict:
    """The TP x2 figures of the checkpoint at `hf_dir`; RuntimeError with the workers' output when they fail."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "tp.json"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port("127.0.0.1")),
            "-m",
            "archon.tools.align_tp",
            str(hf_dir),
            str(out),
            dtype,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode != 0 or not out.is_file():
            errors = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
            raise RuntimeError(f"TP x2 workers exited with {proc.returncode}: {(errors or ['(no error line)'])[-1]}")
        return json.loads(out.read_text())


def tp_gate(args, model_type: str, overrides: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Gate v2's TP x2 against one process in float64 (TP_TOLERANCES), on args.hf_path or the tiny
    checkpoint: (the figures, a named line per failed check or the error that stopped it)."""
    tol = TP_TOLERANCES["float64"]
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = args.hf_path or make_tiny_hf_checkpoint(model_type, Path(tmp) / "hf", args.seed, **overrides)
            figures = tp_check(path, "float64")
        except Exception as e:
            return {}, [f"tp2/float64 error: {type(e).__name__}: {e}"]
    failures = [
        f"tp2/float64 {k}: {v:.3e} > {tol:.0e}"
        for k, v in figures.items()
        if k != "tp2_lora_params_without_grad" and not v <= tol
    ]
    if figures["tp2_lora_params_without_grad"]:
        failures.append(
            f"tp2/float64 LoRA parameters with a gradient on one side only: {figures['tp2_lora_params_without_grad']}"
        )
    return figures, failures


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "float32")
