"""Checks of the alignment gate beyond one forward against HF (archon.tools.align):

- the generation cache: greedy decoding step by step with archon's cache against a full forward
  over the same tokens (`generation_cache_check`);
- bfloat16 norms: every RMSNorm of archon's model against the HF module of the same name, on the
  same bf16 input (`bf16_norm_check`). The order of casts and multiplies shows in bf16 only, and at
  the level of one module a correct port computes HF's operations in HF's order: bit for bit equal;
- LoRA gradients against PEFT's, naming LoRA parameters that got no gradient (`lora_grad_errors`).
"""

from __future__ import annotations

import inspect
import math

import torch
from torch import nn

from archon.lora import lora_parameters
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine

# The prompts the generation check decodes from (prefixes of the gate's packed sequences) and how many
# tokens it decodes from each.
GENERATION_PROMPT_LENS = (7, 1, 13)
GENERATION_NEW_TOKENS = 6


def generation_cache_check(model: nn.Module, seqs: list[torch.Tensor]) -> dict[str, float | int]:
    """Greedy decoding with archon's generation cache (the native engine: a prefill, then one token per
    sequence per step) against archon's full forward over each prefix. Returns the largest |Δ log-prob|
    of the decoded tokens and the number of decoded tokens that are not the full forward's argmax."""
    prompts = [seq[:n].tolist() for seq, n in zip(seqs, GENERATION_PROMPT_LENS) if len(seq) >= n]
    engine = NativeRolloutEngine(model, max_batch_sequences=len(prompts), cuda_graphs=False)
    samples = engine.generate(prompts, SamplingParams(max_new_tokens=GENERATION_NEW_TOKENS, temperature=0, n=1))
    worst, mismatches = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            ids = torch.tensor(sample.prompt_ids + sample.completion_ids)
            logits = model(ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]), len(ids))
            start = len(sample.prompt_ids) - 1
            for step, (token, logprob) in enumerate(zip(sample.completion_ids, sample.logprobs)):
                row = torch.log_softmax(logits[start + step].double(), -1)
                worst = max(worst, abs(float(row[token]) - logprob))
                mismatches += int(row.argmax()) != token
    return {"cache_max_abs_logprob_diff": worst, "cache_greedy_mismatches": mismatches}


def _takes_one_input(module: nn.Module) -> bool:
    parameters = [p for p in inspect.signature(module.forward).parameters.values() if p.default is p.empty]
    return len(parameters) == 1


def _hf_module(hf_model: nn.Module, checkpoint_path: str, archon_name: str) -> nn.Module | None:
    """HF's module at the checkpoint's path, or, where transformers renames keys on load (Nemotron-H's
    checkpoints say `backbone.`, its modules `model.`), the one module whose path ends in archon's name."""
    try:
        return hf_model.get_submodule(checkpoint_path)
    except AttributeError:
        found = [m for n, m in hf_model.named_modules() if n.endswith(f".{archon_name}")]
        return found[0] if len(found) == 1 else None


def bf16_norm_check(model: nn.Module, hf_model: nn.Module, converter, seed: int) -> dict[str, float | int]:
    """Each norm of archon's bf16 model (a module whose class name ends in `Norm`, with a weight and
    one input) against the HF module its weight loads from, on the same random bf16 input [5, dim].
    Returns the largest |difference| and how many norms were compared (0: nothing to compare)."""
    g = torch.Generator().manual_seed(seed)
    worst, compared = 0.0, 0
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(module, "weight", None)
            if not type(module).__name__.endswith("Norm") or weight is None or not _takes_one_input(module):
                continue
            hf_module = _hf_module(hf_model, converter.hf_name(f"{name}.weight").removesuffix(".weight"), name)
            if hf_module is None:
                continue  # stored under another layout (fused, stacked): not one HF module
            x = (torch.randn(5, weight.shape[-1], generator=g) * 3).to(weight.dtype)
            ours, theirs = module(x), hf_module(x)
            if ours.shape != theirs.shape:
                continue
            worst = max(worst, (ours.double() - theirs.double()).abs().max().item())
            compared += 1
    return {"bf16_norm_max_abs_diff": worst, "bf16_norms_compared": compared}


def lora_grad_errors(model: nn.Module, converter, peft_model) -> tuple[float, list[str]]:
    """(the largest relative error of archon's LoRA gradients against PEFT's, the archon LoRA
    parameters that got no gradient at all: a module the training path never reaches)."""
    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    worst, without_grad = 0.0, []
    for name, param in lora_parameters(model).items():
        if param.grad is None:
            without_grad.append(name)
            continue
        for peft_key, grad in converter.lora_to_peft(name, param.grad):
            ref = peft_grads.get(peft_key)
            if ref is None:
                ref = torch.zeros_like(grad)
            scale = ref.abs().max().item()
            err = (grad - ref).abs().max().item()
            rel = (0.0 if err == 0.0 else math.inf) if scale == 0.0 else err / scale
            worst = max(worst, rel)
    return worst, without_grad
