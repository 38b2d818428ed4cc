"""Quantized bases (FP8 block-scaled, MXFP4) against references: the alignment tool's block-by-block
dequantization of the published recipes (checked by hand and against transformers where
transformers is right), HF transformers and PEFT on that dequantized copy for every family with a
published low-precision checkpoint, the memory contract of a kept-quantized base, and the errors
for malformed quantized checkpoints.

The comparisons of two computations of the same math (archon against HF and PEFT on the same
dequantized weights, a kept-quantized base against one dequantized at load) run in float64 with
fp32 islands kept in fp64 (`fp32_islands_in_fp64`): both sides dequantize each weight to the same
values (the product of the stored value and its scale, formed in fp32 as the recipes define it), so
what is left between them is float64 rounding."""

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_close_reporting
from safetensors.torch import load_file, save_file

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.precision import fp32_islands_in_fp64
from archon.quant import QuantFormat, quantized_weights
from archon.quant.export import quantize_checkpoint
from archon.quant.formats import dequantize, fp8_rows_from_checkpoint, mxfp4_rows_from_checkpoint, quantize_fp8
from archon.tools.align import (
    AlignArgs,
    main,
    make_tiny_hf_checkpoint,
    packed_batch,
    quantize_option_format,
    reference_dequantize_fp8,
    reference_dequantize_mxfp4,
    run_alignment,
    write_dequantized_reference,
)

sys.path.insert(0, str(Path(__file__).parent / "models"))
from test_deepseek_v3 import CASES as DEEPSEEK_V3_CASES  # noqa: E402

FP8_16x24 = QuantFormat("fp8", (16, 24))  # tiny widths of 32, 64 and 128 leave partial column blocks
MXFP4 = QuantFormat("mxfp4", (1, 32))
SEQ_LENS = (7, 1, 13, 33)


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Factory: (model_type, fmt) -> a tiny random checkpoint of the type stored in `fmt` (made once)."""
    made = {}

    def make(model_type: str, fmt: QuantFormat, **overrides) -> Path:
        key = (model_type, fmt, json.dumps(overrides, sort_keys=True))
        if key not in made:
            root = tmp_path_factory.mktemp(f"{model_type}_{fmt.method}")
            source = make_tiny_hf_checkpoint(model_type, root / "hf", **overrides)
            made[key] = quantize_checkpoint(source, root / "quantized", fmt)
        return made[key]

    return make


# ---------------------------------------------------------------------------------------------
# The reference dequantization
# ---------------------------------------------------------------------------------------------


def test_fp8_reference_and_archon_dequantize_a_hand_computed_case_with_partial_blocks():
    """A 3 x 5 weight of 2 x 2 blocks: the last block row has one row, the last block column one
    column. q[r, c] = c + 1; the scales of the 2 x 3 block grid are 1..6."""
    q = torch.arange(1.0, 6.0).expand(3, 5).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    expected = torch.tensor([[1.0, 2.0, 6.0, 8.0, 15.0], [1.0, 2.0, 6.0, 8.0, 15.0], [4.0, 8.0, 15.0, 20.0, 30.0]])
    assert torch.equal(reference_dequantize_fp8(q, scale_inv, (2, 2), "w"), expected)
    fmt = QuantFormat("fp8", (2, 2))
    assert torch.equal(dequantize(fmt, *fp8_rows_from_checkpoint(q, scale_inv, 2), torch.float32), expected)


def test_mxfp4_reference_and_archon_dequantize_a_hand_computed_case():
    """Two rows of one 32-value group. Row 0: byte 0xF9 (low nibble 9 = -0.5, high 15 = -6), then
    0x21 (0.5, 1.0), exponent 128 (x2). Row 1: bytes 0x70 (0, 6), exponent 125 (x1/4)."""
    blocks = torch.tensor([[0xF9] + [0x21] * 15, [0x70] * 16], dtype=torch.uint8)[:, None, :]  # [2, 1, 16]
    scales = torch.tensor([[128], [125]], dtype=torch.uint8)
    rows = torch.tensor([[-1.0, -12.0] + [1.0, 2.0] * 15, [0.0, 1.5] * 16])  # [out 2, in 32]
    assert torch.equal(reference_dequantize_mxfp4(blocks, scales, "w"), rows.T)  # HF layout [in, out]
    assert torch.equal(dequantize(MXFP4, *mxfp4_rows_from_checkpoint(blocks, scales), torch.float32), rows)


def test_deepseek_v3_kv_a_proj_with_mqa_has_partial_blocks_read_from_the_config():
    """DeepSeek-V3's kv_a_proj_with_mqa is 576 x 7168 with 128 x 128 blocks: a 5 x 56 scale grid whose
    last block row holds 64 rows. The block size cannot be derived from the shapes (576 / 5 is not
    whole), so the config's weight_block_size must be read; archon and the reference agree, and the
    weight comes back within e4m3's precision."""
    torch.manual_seed(0)
    weight = torch.randn(576, 7168) * 0.02
    q, scale_inv = quantize_fp8(weight, (128, 128))
    assert tuple(scale_inv.shape) == (5, 56)
    reference = reference_dequantize_fp8(q, scale_inv, (128, 128), "kv_a_proj_with_mqa.weight")
    archon = dequantize(QuantFormat("fp8", (128, 128)), *fp8_rows_from_checkpoint(q, scale_inv, 128), torch.float32)
    assert torch.equal(archon, reference)
    block_scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[:576, :7168]
    # e4m3: 3 mantissa bits (relative half-step 2^-4), subnormal step 2^-9 of the block scale
    assert ((reference - weight).abs() <= weight.abs() / 16 + block_scale * 2.0**-9).all()


# transformers 5.19 on CPU loads either format only dequantized: FP8 through
# FineGrainedFP8Config(dequantize=True) (chosen by itself, with a warning, where there is no GPU),
# MXFP4 through Mxfp4Config(dequantize=True) (chosen where the `kernels` package is missing).
# Its FP8 dequantization (Fp8Dequantize._dequantize_one) derives the block size from the weight and
# scale shapes, not from weight_block_size: on weights whose sides are not multiples of the block it
# raises ("not divisible by scale grid"; fp8 16x24 on these tiny models) or, where the division comes
# out even (24 rows of 16-row blocks read as two blocks of 12), uses the wrong blocks. So it is checked
# here on whole blocks only. Its MXFP4 experts are dequantized into bf16 parameters even for an fp32
# model (exact values, but the experts then compute in bf16), so neither loader is the logits reference.
TRANSFORMERS_CASES = {
    "qwen3_moe-fp8-16x16": ("qwen3_moe", QuantFormat("fp8", (16, 16))),
    "deepseek_v3-fp8-8x8": ("deepseek_v3", QuantFormat("fp8", (8, 8))),
    "gpt_oss-mxfp4": ("gpt_oss", MXFP4),
}


@pytest.mark.parametrize("case", sorted(TRANSFORMERS_CASES))
def test_reference_dequantization_equals_transformers_on_whole_blocks(case, quantized, tmp_path):
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Mxfp4Config

    model_type, fmt = TRANSFORMERS_CASES[case]
    path = quantized(model_type, fmt)
    reference, count = write_dequantized_reference(path, tmp_path / "reference")
    assert count > 0
    assert "quantization_config" not in json.loads((reference / "config.json").read_text())
    if fmt.method == "fp8":
        config = FineGrainedFP8Config(dequantize=True, weight_block_size=fmt.block_size)
    else:
        config = Mxfp4Config(dequantize=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=config).state_dict()
    ours = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).state_dict()
    assert hf.keys() == ours.keys()
    for key, tensor in ours.items():
        assert torch.equal(hf[key].to(tensor.dtype), tensor), key


# ---------------------------------------------------------------------------------------------
# archon (base kept quantized) vs HF and PEFT on the reference dequantization
# ---------------------------------------------------------------------------------------------

PARITY_CASES = {
    "qwen3-fp8-16x24": ("qwen3", "fp8:16x24", {}),
    "qwen3_moe-fp8-16x24": ("qwen3_moe", "fp8:16x24", {}),
    "qwen3_5_text-fp8-16x24": ("qwen3_5_text", "fp8:16x24", {}),
    "glm4_moe-fp8-16x24": ("glm4_moe", "fp8:16x24", {}),
    # GLM-4.5-FP8's own layout: compressed-tensors, one scale per output channel
    "glm4_moe-fp8-channel": ("glm4_moe", "fp8-channel", {}),
    "qwen3-fp8-tensor": ("qwen3", "fp8-tensor", {}),
    # DeepSeek-V3's own 128 x 128 blocks: kv_a_proj_with_mqa is (136 + 8) x 64, one whole and one
    # partial block row (the real one, 576 x 7168, has 4.5); kv_b_proj has 136 columns.
    "deepseek_v3-fp8-128x128": ("deepseek_v3", "fp8", {"kv_lora_rank": 136}),
    # Kimi K2: one expert group, no query bottleneck (tests/models/test_deepseek_v3.py's case).
    "kimi_k2-fp8-16x24": ("deepseek_v3", "fp8:16x24", DEEPSEEK_V3_CASES["no-q-lora-plain-rope-bias"]),
    # GLM-5 (DeepSeek sparse attention): the indexer's wq_b, wk and weights_proj stored in fp8 too.
    "glm_moe_dsa-fp8-16x24": ("glm_moe_dsa", "fp8:16x24", {}),
}


def _check_report(report: dict) -> None:
    """A float64 gate report that passed: every figure within the gate's fp64 tolerance (logits and
    log-probs 1e-9, mean KL 1e-15, LoRA gradients 1e-9 relative), the base kept quantized, the PEFT
    keys matched and the adapter in effect."""
    case = f"{report['model_type']} {report['quantization']}"
    assert report["dtype"] == "float64", f"{case}: run in {report['dtype']}"
    assert report["quantized_tensors"] > 0 and report["archon_quantized_weights"] > 0, report
    beyond = {
        name: f"{report[name]:.3e} > {tol:.1e}" for name, tol in report["tolerances"].items() if not report[name] <= tol
    }
    assert not beyond, f"{case}: {beyond}"
    assert report["peft_missing_keys"] == [] and report["peft_unexpected_keys"] == [], report
    effect = report["lora_effect_max_abs"]
    assert effect > 1e-3, f"{case}: the adapter changes the logits by {effect:.3e}"
    assert report["pass"], f"{case}: {report['failures']}"


@pytest.mark.parametrize("case", sorted(PARITY_CASES))
def test_kept_quantized_base_matches_hf_and_peft(case):
    model_type, quantize, overrides = PARITY_CASES[case]
    report = run_alignment(
        AlignArgs(
            model_type=model_type,
            quantize=quantize,
            config_overrides=overrides,
            lora_rank=4,
            seq_lens=SEQ_LENS,
            dtype="float64",
        )
    )
    assert report["quantization"] == str(quantize_option_format(quantize))
    _check_report(report)


def test_align_cli_checks_a_quantized_checkpoint_given_by_path(quantized, capsys):
    """GPT-OSS with MXFP4 experts, as published, through `--hf-path` alone."""
    path = quantized("gpt_oss", MXFP4)
    code = main(["--hf-path", str(path), "--lora-rank", "4", "--dtype", "float64", "--seq-lens", *map(str, SEQ_LENS)])
    out = capsys.readouterr().out
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 0, out
    assert report["quantization"] == str(MXFP4) and "mxfp4" in out
    assert report["quantized_tensors"] == 4  # gate_up_proj and down_proj of both layers
    _check_report(report)


@pytest.mark.parametrize(
    "argv, culprit",
    [
        (["--model-type", "qwen3", "--quantize", "fp8:16"], "--quantize 'fp8:16'"),
        (["--model-type", "qwen3", "--quantize", "int4"], "--quantize 'int4'"),
        (["--quantize", "fp8"], "quantization_config already"),  # --hf-path of a quantized checkpoint
    ],
)
def test_align_refuses_bad_quantize_options_naming_them(argv, culprit, quantized, capsys):
    if argv[0] != "--model-type":
        argv = ["--hf-path", str(quantized("qwen3", FP8_16x24)), *argv]
    assert main(argv) == 2
    assert culprit in capsys.readouterr().err


def test_quantizing_a_model_with_nothing_the_format_stores_is_refused():
    with pytest.raises(ValueError, match=r"--quantize 'mxfp4': no weight of the qwen3 checkpoint"):
        run_alignment(AlignArgs(model_type="qwen3", quantize="mxfp4"))


# ---------------------------------------------------------------------------------------------
# The kept-quantized base in the model
# ---------------------------------------------------------------------------------------------

MODEL_CASES = {"qwen3_moe-fp8": ("qwen3_moe", FP8_16x24), "gpt_oss-mxfp4": ("gpt_oss", MXFP4)}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_kept_quantized_and_dequantized_at_load_give_the_same_logits(case, quantized):
    path = quantized(*MODEL_CASES[case])
    _, tokens, positions, cu_seqlens = packed_batch(SEQ_LENS, 256, seed=0)
    logits = {}
    for mode in ("keep", "dequantize"):
        model = build_model(path, dtype=torch.float64, quantized_base=mode).model.eval()
        assert (len(quantized_weights(model)) > 0) == (mode == "keep")
        with torch.no_grad(), fp32_islands_in_fp64():
            logits[mode] = model(tokens, positions, cu_seqlens, max(SEQ_LENS))
    # measured at most 3.1e-15 (gpt_oss MXFP4 experts; qwen3_moe fp8: bit-identical)
    assert_close_reporting(
        logits["keep"], logits["dequantize"], 1e-10, f"{case}: logits, kept against dequantized at load"
    )


def _weight_shaped_saved_tensors(path: Path, quantized_base: str, weights: dict[str, set]) -> tuple[list, dict]:
    """Forward and backward of a LoRA model on `path`: the floating tensors autograd saved for the
    backward that have the shape of a weight of `weights` (archon key -> shapes) and are not one of
    the model's other parameters (a plain weight may share a shape), and the LoRA gradients."""
    lora = LoRAConfig(rank=4, alpha=8, target_modules="all-linear")
    model = build_model(path, lora=lora, quantized_base=quantized_base).model
    weight_shapes = set().union(*weights.values())
    other_params = {p.untyped_storage().data_ptr() for n, p in model.named_parameters() if n not in weights}
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in lora_parameters(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    _, tokens, positions, cu_seqlens = packed_batch((7, 1, 13), 256, seed=0)  # 21 tokens: no weight has 21 rows
    found = []

    def pack(t: torch.Tensor):
        if not t.is_floating_point() or t.untyped_storage().data_ptr() in other_params:
            return t
        if tuple(t.shape) in weight_shapes:
            found.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, positions, cu_seqlens, 13).float().logsumexp(-1).sum()
    loss.backward()
    return found, {name: p.grad for name, p in lora_parameters(model).items()}


@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_forward_saves_no_dequantized_weight_for_backward_and_lora_gradients_flow(case, quantized):
    path = quantized(*MODEL_CASES[case])
    kept = build_model(path).model
    weights = {}
    for key, (module, name) in quantized_weights(kept).items():
        info = module._quantized[name]
        # the module's layout and its transpose (input-major experts), and one expert's weight
        weights[key] = {info.shape, info.rows_shape, info.shape[-2:], info.rows_shape[-2:]}
    found, grads = _weight_shaped_saved_tensors(path, "keep", weights)
    assert found == []
    assert all(g is not None for g in grads.values())
    assert sum(g.abs().sum() for g in grads.values()) > 0
    linear_grads = [g for n, g in grads.items() if "self_attn.q_proj" in n]
    assert linear_grads and all(g.abs().sum() > 0 for g in linear_grads)
    # The same model with its base dequantized at load does save its weights: the check sees them.
    found_dense, _ = _weight_shaped_saved_tensors(path, "dequantize", weights)
    assert found_dense


# ---------------------------------------------------------------------------------------------
# Malformed quantized checkpoints
# ---------------------------------------------------------------------------------------------

Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def _pop(key):
    return lambda tensors: tensors.pop(key)


def _set(key, change):
    return lambda tensors: tensors.__setitem__(key, change(tensors[key]).contiguous())


def _config(change):
    return lambda config: change(config["quantization_config"])


BAD_CHECKPOINTS = {
    # name: (model_type, fmt, edit of the tensors, edit of config.json, error, what the message names)
    "fp8-missing-scale": (
        "qwen3",
        FP8_16x24,
        _pop(f"{Q_PROJ}_scale_inv"),
        None,
        KeyError,
        [f"'{Q_PROJ}' (in 'model.safetensors') has no '{Q_PROJ}_scale_inv'"],
    ),
    "fp8-scale-shape": (
        "qwen3",
        FP8_16x24,
        _set(f"{Q_PROJ}_scale_inv", lambda s: s[:, :2]),
        None,
        ValueError,
        [f"'{Q_PROJ}_scale_inv' in 'model.safetensors' has shape (4, 2)", "needs (4, 3)", "weight_block_size [16, 24]"],
    ),
    "fp8-scale-without-weight": (
        "qwen3",
        FP8_16x24,
        _pop(Q_PROJ),
        None,
        KeyError,
        [f"'{Q_PROJ}_scale_inv' in 'model.safetensors' has no weight '{Q_PROJ}'"],
    ),
    "fp8-scaled-weight-not-e4m3": (
        "qwen3",
        FP8_16x24,
        _set(Q_PROJ, lambda w: w.float().to(torch.bfloat16)),
        None,
        ValueError,
        [f"'{Q_PROJ}' in 'model.safetensors' has a scale", "BF16"],
    ),
    "mxfp4-blocks-without-scales": (
        "gpt_oss",
        MXFP4,
        _pop(f"{GATE_UP}_scales"),
        None,
        KeyError,
        [f"'{GATE_UP}_blocks' (in 'model.safetensors') has no '{GATE_UP}_scales'"],
    ),
    "mxfp4-scales-without-blocks": (
        "gpt_oss",
        MXFP4,
        _pop(f"{GATE_UP}_blocks"),
        None,
        KeyError,
        [f"'{GATE_UP}_scales' (in 'model.safetensors') has no '{GATE_UP}_blocks'"],
    ),
    "mxfp4-blocks-last-dim": (
        "gpt_oss",
        MXFP4,
        _set(f"{GATE_UP}_blocks", lambda b: b.reshape(8, 64, 1, 32)),
        None,
        ValueError,
        [f"'{GATE_UP}_blocks' in 'model.safetensors' have shape (8, 64, 1, 32)", "last dimension must be 16"],
    ),
    "unknown-quant-method": (
        "qwen3",
        FP8_16x24,
        None,
        _config(lambda q: q.update(quant_method="awq")),
        ValueError,
        ["config.json", "quantization_config.quant_method='awq'"],
    ),
    "fp8-without-block-size": (
        "qwen3",
        FP8_16x24,
        None,
        _config(lambda q: q.pop("weight_block_size")),
        ValueError,
        ["config.json", "quantization_config.weight_block_size=None"],
    ),
    "fp8-not-e4m3": (
        "qwen3",
        FP8_16x24,
        None,
        _config(lambda q: q.update(fmt="e5m2")),
        ValueError,
        ["config.json", "quantization_config.fmt='e5m2'"],
    ),
}


@pytest.mark.parametrize("quantized_base", ["keep", "dequantize"])
@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_malformed_quantized_checkpoint_is_refused_naming_the_tensor_and_file_or_field(
    case, quantized_base, quantized, tmp_path
):
    model_type, fmt, edit_tensors, edit_config, error, culprits = BAD_CHECKPOINTS[case]
    path = shutil.copytree(quantized(model_type, fmt), tmp_path / "checkpoint")
    if edit_tensors is not None:
        tensors = load_file(path / "model.safetensors")
        edit_tensors(tensors)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    if edit_config is not None:
        config = json.loads((path / "config.json").read_text())
        edit_config(config)
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(error) as caught:
        build_model(path, quantized_base=quantized_base)
    for culprit in culprits:
        assert culprit in str(caught.value)
