"""Several task adapters on one kept-quantized base: the mixed forward and each task's view give
what the same multi-task model gives on the base dequantized at load.

Both compute the same math (each weight dequantized to the same values), so they are compared in
float64 (fp64 models inside `fp32_islands_in_fp64`), where what is left is float64 rounding."""

import torch
from helpers import assert_close_reporting, randomise_lora

from archon.batch import PackedBatch
from archon.build import build_model
from archon.lora import LoRAConfig, adapter_routing, lora_parameters, task_view
from archon.precision import fp32_islands_in_fp64
from archon.quant import QuantFormat, quantized_weights
from archon.quant.export import quantize_checkpoint
from archon.tools.align import make_tiny_hf_checkpoint

TASKS = {
    "a": LoRAConfig(rank=4, alpha=8.0),
    "b": LoRAConfig(rank=2, alpha=3.0, target_modules=("q_proj", "v_proj", "down_proj"), experts=False),
}
FP64_TOL = 1e-10  # measured: bit-identical (the fp8 GEMMs see the same operands either way)


def test_multi_task_on_quantized_base(tmp_path):
    source = make_tiny_hf_checkpoint("qwen3_moe", tmp_path / "hf")
    quantized = quantize_checkpoint(source, tmp_path / "fp8", QuantFormat("fp8", (16, 24)))
    kept = build_model(quantized, task_loras=TASKS, dtype=torch.float64)
    plain = build_model(quantized, task_loras=TASKS, dtype=torch.float64, quantized_base="dequantize")
    assert quantized_weights(kept.model) and not quantized_weights(plain.model)
    for model in (kept.model, plain.model):
        randomise_lora(lora_parameters(model), 0.1, torch.Generator().manual_seed(3))
    g = torch.Generator().manual_seed(0)
    lengths = [7, 5, 9]
    batch = PackedBatch.from_sequences([torch.randint(0, kept.args.vocab_size, (n,), generator=g) for n in lengths])
    task_of_token = torch.repeat_interleave(torch.tensor([0, 1, 0]), torch.tensor(lengths))
    outputs = []
    with fp32_islands_in_fp64():
        for model in (kept.model, plain.model):
            with adapter_routing(model, task_of_token):
                logits = model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
            logits.logsumexp(-1).sum().backward()
            outputs.append((logits.detach(), {k: p.grad for k, p in lora_parameters(model).items()}))
        (kept_logits, kept_grads), (plain_logits, plain_grads) = outputs
        assert_close_reporting(kept_logits, plain_logits, FP64_TOL, "mixed-batch logits")
        assert kept_grads.keys() == plain_grads.keys()
        for key, grad in plain_grads.items():
            assert_close_reporting(kept_grads[key], grad, FP64_TOL, f"gradient of {key}")
        with torch.no_grad():
            for task in TASKS:
                with task_view(kept.model, task):
                    kept_view = kept.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
                with task_view(plain.model, task):
                    plain_view = plain.model(batch.tokens, batch.positions, batch.cu_seqlens, batch.max_seqlen)
                assert_close_reporting(kept_view, plain_view, FP64_TOL, f"task {task}'s view: logits")
