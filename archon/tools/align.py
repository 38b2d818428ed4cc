"""HF parity report: does an archon model family match HF transformers (and PEFT) in fp32?

    python -m archon.tools.align --model-type qwen3 [--lora-rank 8] [--seed 0]
    python -m archon.tools.align --hf-path DIR [--lora-rank 8]
    python -m archon.tools.align --model-type qwen3 --quantize fp8:128x128 [--lora-rank 8]
    python -m archon.tools.align --model-type qwen3 --dtype float64 --set sliding_window=8 use_sliding_window=true

What is compared, on the same weights:
- logits of archon's forward against HF transformers' (max |diff|, mean KL);
- the path training takes (`archon.head.model_label_logprobs`: the final hidden states through the
  chunked head), against the log-softmax of HF's logits at the label tokens. A family that puts
  something between its hidden states and its logits only in `forward` (a soft-cap) fails here;
- with --lora-rank, a random LoRA against PEFT on the HF model: logits, the training path, and the
  LoRA gradients of the training path's summed log-probs against PEFT's;
- config coverage: every field of the HF config is read by the family's `from_hf_config` or
  declared inert (archon/config_coverage.py).
--dtype float64 runs both sides in fp64, which tells rounding (recurrences, deep stacks) from a
wrong port; its tolerances are its own (`TOLERANCES`). HF's RMSNorms compute in fp32 whatever the
model dtype, and so do archon's, so fp64 agreement is bounded by fp32 rounding inside the norms.

Without --hf-path a tiny random-weight HF model is built from the transformers config class of
the type (sizes from the family's ModelSpec.tiny_hf_config) and saved to a temp dir; with it, the
type is read from DIR/config.json. Both models run a packed batch of several sequences of
different lengths; HF runs each sequence on its own.

A quantized checkpoint (a `quantization_config` of quant_method fp8 or mxfp4 in DIR/config.json, or
one made by --quantize) is checked with archon keeping its base quantized, against HF transformers
on a plain fp32 copy of the checkpoint dequantized here by the published recipe
(`write_dequantized_reference`). transformers' own dequantizing load is not the reference: in
transformers 5.19 its CPU fp8 path derives the block size from the weight and scale shapes instead
of reading `weight_block_size`, so it raises (or, where the division comes out even, uses wrong
blocks) on weights whose sides are not multiples of the block, as real checkpoints have.
The last line printed is JSON; the exit code is non-zero when a tolerance is exceeded.

The tiny checkpoints are made by archon.tools.tiny_checkpoint, the reference dequantization is
archon.tools.dequantized_reference, the report's text archon.tools.align_report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from archon.build import build_model, load_hf_config
from archon.config_coverage import unaccounted_fields
from archon.head import model_label_logprobs
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import save_peft_adapter
from archon.precision import fp32_islands_in_fp64
from archon.quant import quantized_weights
from archon.spec import get_spec
from archon.tools.align_batch import (  # noqa: F401 - label_positions ...: at their old path
    _compare_logits,
    _hf_forward,
    label_logprobs,
    label_positions,
    packed_batch,
)
from archon.tools.align_checks import bf16_norm_check, generation_cache_check, lora_grad_errors
from archon.tools.align_inputs import (  # noqa: F401 - parse_config_assignments ...: at their old path
    check_quantize_option,
    checkpoints,
    parse_config_assignments,
    quantize_option_format,
    resolve_model_type,
)
from archon.tools.align_mtp import has_mtp, mtp_check
from archon.tools.align_report import failure_lines, format_gate, format_report
from archon.tools.align_tp import tp_gate
from archon.tools.align_variants import config_variants
from archon.tools.dequantized_reference import (  # noqa: F401 - reference_dequantize_*: at their old path
    reference_dequantize_fp8,
    reference_dequantize_mxfp4,
    write_dequantized_reference,
)
from archon.tools.tiny_checkpoint import (  # noqa: F401 - tiny_config_kwargs: at its old path
    hf_model_class,
    make_tiny_hf_checkpoint,
    single_kind_patterns,
    tiny_config_kwargs,
    tiny_hf_config,
)

MAX_ABS_LOGITS_DIFF = 1e-4
MAX_MEAN_KL = 1e-8
MAX_LORA_GRAD_REL_ERR = 1e-4

# The gate's tolerances by the dtype both sides run in. Log-prob differences (the training path)
# are held to the logits tolerance.
TOLERANCES: dict[str, dict[str, float]] = {
    "float32": dict(
        max_abs_logits_diff=MAX_ABS_LOGITS_DIFF, mean_kl=MAX_MEAN_KL, lora_grad_max_rel_err=MAX_LORA_GRAD_REL_ERR
    ),
    # fp64 on both sides, fp32 islands kept in fp64 (`fp32_islands_in_fp64`): what is left is fp64
    # rounding (about 1e-14 on the tiny models), so anything near these limits is a difference of the math.
    "float64": dict(max_abs_logits_diff=1e-9, mean_kl=1e-15, lora_grad_max_rel_err=1e-9),
    # bf16 on both sides, end to end: archon's packed attention and chunked head round differently from
    # HF's eager per-sequence path, and a near tie in a bf16 router picks another expert. Measured on
    # every registered type's tiny config, seed 0 (2026-12-06, CPU): max |Δ logits| up to 3.2
    # (kimi_linear; dense types 0.05-0.10), mean KL up to 2.3e-2 (deepseek_v32; dense up to 8e-5),
    # |Δ train log-prob| up to 1.9 (minimax_m2). The limits are twice those floors: they catch a
    # broken bf16 path, not a wrong cast; the cast order is checked per norm (bf16_norm_max_abs_diff).
    # (bf16 runs compare the base model only: no LoRA entry.)
    "bfloat16": dict(max_abs_logits_diff=6.5, mean_kl=5e-2),
}
# The generation cache (decode step by step against the full forward; archon against itself), by dtype.
CACHE_TOLERANCES = {"float32": 1e-4, "float64": 1e-9}
# A norm module against HF's on the same bf16 input: a correct port computes HF's operations in HF's
# order, and every registered family's norms are bit for bit HF's (measured 0.0, 2026-12-06).
BF16_NORM_TOLERANCE = 0.0
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}
# Rows of the chunked head per chunk in the gate's training-path check: small, so the packed batch
# spans several chunks.
GATE_HEAD_CHUNK_SIZE = 16


@dataclass
class AlignArgs:
    model_type: str | None = None
    """HF model_type to check, e.g. qwen3, qwen3_moe; default: the one in hf_path's config.json."""
    hf_path: str | None = None
    """An HF checkpoint directory; default: a tiny random model built for model_type."""
    lora_rank: int | None = None
    """Also compare a random LoRA of this rank against PEFT on the HF model."""
    seed: int = 0
    seq_lens: tuple[int, ...] = (7, 1, 13, 33, 70)
    """Lengths of the packed sequences (one longer than the 64-token chunks of a chunked linear-attention
    layer)."""
    config_overrides: dict[str, Any] = field(default_factory=dict)
    """Extra kwargs for the tiny HF config (ignored with --hf-path); for a vision-language type they
    set fields of its text_config."""
    set: tuple[str, ...] = ()
    """Config overrides as KEY=VALUE (the value read as JSON, else as a string), e.g.
    `--set sliding_window=8 use_sliding_window=true 'rope_parameters={"rope_type": "default", "rope_theta": 10000}'`;
    they join config_overrides (tiny models only)."""
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    """The dtype both sides run in; float64 tells fp32 rounding from a wrong port (see TOLERANCES)."""
    generation: bool = False
    """Also decode greedily with archon's generation cache and compare each step with a full forward
    (float32 / float64)."""
    variants: bool = False
    """Gate v2 (the command line's `--all`): besides the tiny config, one config per boolean or
    enumerated field the family reads, flipped (archon.tools.align_variants)."""
    extra_dtypes: tuple[Literal["float64", "bfloat16"], ...] = ()
    """Gate v2: the tiny config again in these dtypes (bfloat16 without LoRA: the end-to-end comparison
    within the measured bf16 floor and every norm module against HF's)."""
    mtp: bool = False
    """Gate v2: for a family with MTP layers, one random MTP layer against the published formula
    (archon.tools.align_mtp), float32 / float64."""
    tp: int = 1
    """Gate v2: with 2, hidden states, log-probs and LoRA gradients of the tiny model under TP x2 (two
    gloo processes) against one process (archon.tools.align_tp)."""
    stop_at_first_failure: bool = False
    """Gate v2: stop at the first run that fails (the verdict is the same, sooner)."""
    all: bool = False
    """Gate v2 in full: --variants --generation --extra-dtypes float64 bfloat16 --tp 2."""
    quantize: str | None = None
    """Store the checkpoint's weights in a published low-precision format before comparing: fp8
    (block-scaled e4m3, 128x128 blocks), fp8:RxC (R x C blocks, e.g. fp8:16x24), fp8-channel or
    fp8-tensor (compressed-tensors e4m3 with a scale per output channel or per tensor) or mxfp4 (the
    routed experts, GPT-OSS's layout)."""


def training_path_logprobs(model, tokens, positions, cu_seqlens, max_seqlen, seqs) -> torch.Tensor:
    """Label log-probs [M] the way the trainer computes them (hidden states, then the chunked head)."""
    rows, labels = label_positions(seqs)
    lp, _ = model_label_logprobs(
        model, tokens, positions, cu_seqlens, max_seqlen, rows, labels, chunk_size=GATE_HEAD_CHUNK_SIZE
    )
    return lp


def run_alignment(args: AlignArgs) -> dict[str, Any]:
    if args.dtype == "float64":
        with fp32_islands_in_fp64():
            return _run_alignment(args)
    return _run_alignment(args)


# While `reuse_hf_references()` is active: the HF side of each gate run (the checkpoints, HF's model and
# its logits), by the config and dtype it was made for; None otherwise.
_REUSED: dict[Any, Any] | None = None


@contextlib.contextmanager
def reuse_hf_references():
    """Within the block, gate runs of a config already checked reuse its checkpoints and HF's logits
    instead of making them again: runs that differ only on archon's side (a mutation suite) cost
    archon's side only. The checkpoints live in a temporary directory until the block ends."""
    global _REUSED
    with tempfile.TemporaryDirectory() as tmp:
        _REUSED = {"dir": Path(tmp)}
        try:
            yield
        finally:
            _REUSED = None


def _reused(key, make):
    if _REUSED is None:
        return make()
    if key not in _REUSED:
        _REUSED[key] = make()
    return _REUSED[key]


def _reuse_dir(tmp: Path, key: str) -> Path:
    """Where a run makes its checkpoints: its own temporary directory, or the reuse block's."""
    if _REUSED is None:
        return tmp
    return _REUSED["dir"] / hashlib.sha256(key.encode()).hexdigest()[:16]


def _run_alignment(args: AlignArgs) -> dict[str, Any]:
    model_type = resolve_model_type(args)
    check_quantize_option(args)
    if args.dtype == "bfloat16" and args.lora_rank is not None:
        raise ValueError("--dtype bfloat16 compares the base model; compare LoRA in float32 or float64")
    dtype = DTYPES[args.dtype]
    tolerances = TOLERANCES[args.dtype]
    overrides = {**args.config_overrides, **parse_config_assignments(args.set)}
    torch.manual_seed(args.seed)
    key = json.dumps([model_type, overrides, args.seed, args.hf_path, args.quantize], sort_keys=True, default=str)
    with tempfile.TemporaryDirectory() as tmp:
        hf_path, hf_reference_path, quant_format, quantized_tensors = _reused(
            ("checkpoints", key), lambda: checkpoints(args, model_type, overrides, _reuse_dir(Path(tmp), key))
        )
        hf_config = load_hf_config(hf_path)
        hf_class = hf_model_class(hf_config)
        one_kind, unread = _config_checks(args, model_type, hf_config)

        def load_hf():
            # HF's grouped-GEMM experts have no fp64 kernel; its eager experts loop over them
            experts = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
            return hf_class.from_pretrained(
                hf_reference_path, dtype=dtype, attn_implementation="eager", **experts
            ).eval()

        batch = packed_batch(args.seq_lens, hf_config.get_text_config().vocab_size, args.seed)
        seqs, tokens, positions, cu_seqlens = batch
        max_seqlen = max(args.seq_lens)

        def hf_side():
            hf_model = load_hf()
            with torch.no_grad():
                return hf_model, _hf_forward(hf_model, seqs)

        hf_model, hf_logits = _reused(("hf", key, args.dtype, args.seq_lens), hf_side)
        loaded = build_model(hf_path, dtype=dtype)
        model = loaded.model.to(dtype).eval()
        kept_quantized = len(quantized_weights(model))
        with torch.no_grad():
            archon_logits = model(tokens, positions, cu_seqlens, max_seqlen)
            hf_logprobs = label_logprobs(hf_logits, seqs)
            train_logprobs = training_path_logprobs(model, tokens, positions, cu_seqlens, max_seqlen, seqs)
        max_diff, mean_kl = _compare_logits(archon_logits, hf_logits)
        logprob_diff = (label_logprobs(archon_logits, seqs) - hf_logprobs).abs().max().item()
        report: dict[str, Any] = {
            "model_type": model_type,
            "hf_path": None if args.hf_path is None else str(args.hf_path),
            "dtype": args.dtype,
            "config_overrides": overrides,
            "quantization": None if quant_format is None else str(quant_format),
            "quantized_tensors": quantized_tensors,
            "archon_quantized_weights": kept_quantized,
            "tokens": int(tokens.numel()),
            "sequences": len(seqs),
            "max_abs_logits_diff": max_diff,
            "mean_kl": mean_kl,
            "max_abs_logprob_diff": logprob_diff,
            "max_abs_train_logprob_diff": (train_logprobs.double() - hf_logprobs).abs().max().item(),
            "lora_max_abs_logits_diff": None,
            "lora_grad_max_rel_err": None,
            "single_kind_patterns": one_kind,
            "unaccounted_config_fields": unread,
        }
        logits_tol = tolerances["max_abs_logits_diff"]
        checks = [
            ("max_abs_logits_diff", logits_tol),
            ("mean_kl", tolerances["mean_kl"]),
            ("max_abs_train_logprob_diff", logits_tol),
        ]
        checks += _extra_checks(args, model_type, report, model, hf_model, loaded.converter, batch, hf_path, tmp)
        del model, loaded

        if args.lora_rank is not None:
            report.update(_compare_lora(args, hf_path, dtype, load_hf, batch, hf_logits, Path(tmp)))
            checks += [
                ("lora_max_abs_logits_diff", logits_tol),
                ("lora_max_abs_train_logprob_diff", logits_tol),
                ("lora_grad_max_rel_err", tolerances["lora_grad_max_rel_err"]),
            ]
    return _verdict(args, report, checks, unread)


def _extra_checks(args: AlignArgs, model_type, report, model, hf_model, converter, batch, hf_path, tmp):
    """With args.generation (float32 / float64): the generation cache against the full forward. In
    bfloat16: every norm module against HF's. With args.mtp, for a family with MTP layers: one random
    MTP layer against the formula. Their figures go into `report`; returns their checks."""
    checks = []
    if args.generation and args.dtype in CACHE_TOLERANCES:
        report.update(generation_cache_check(model, batch[0]))
        checks += [("cache_max_abs_logprob_diff", CACHE_TOLERANCES[args.dtype]), ("cache_greedy_mismatches", 0)]
    if args.dtype == "bfloat16":
        report.update(bf16_norm_check(model, hf_model, converter, args.seed))
        checks.append(("bf16_norm_max_abs_diff", BF16_NORM_TOLERANCE))
    if args.mtp and args.dtype in CACHE_TOLERANCES and has_mtp(model_type) and args.hf_path is None:
        copy = shutil.copytree(hf_path, Path(tmp) / "mtp")
        report["mtp_max_abs_logits_diff"] = mtp_check(copy, DTYPES[args.dtype], batch, args.seed, build_model)
        checks.append(("mtp_max_abs_logits_diff", TOLERANCES[args.dtype]["max_abs_logits_diff"]))
    return checks


def _config_checks(args: AlignArgs, model_type: str, hf_config) -> tuple[list[str], list[str]]:
    """(the tiny config's per-layer patterns with one kind of layer, each warned of; the config fields
    the family neither reads nor declares inert)."""
    one_kind_by_definition = get_spec(model_type).one_kind_layer_patterns
    one_kind = single_kind_patterns(hf_config, one_kind_by_definition) if args.hf_path is None else []
    for pattern in one_kind:
        warnings.warn(
            f"the tiny {model_type} config has one kind of layer only in {pattern}: the gate cannot tell "
            "the kinds apart; add both (config_overrides or the family's tiny_hf_config)",
            stacklevel=4,  # run_alignment's caller
        )
    return one_kind, unaccounted_fields(get_spec(model_type), hf_config)


def _compare_lora(args: AlignArgs, hf_path: Path, dtype: torch.dtype, load_hf, batch, hf_logits, tmp: Path):
    """A random LoRA of rank args.lora_rank on archon's model against PEFT's load of its export on the HF
    model: the report's peft_* and lora_* entries."""
    seqs, tokens, positions, cu_seqlens = batch
    max_seqlen = max(args.seq_lens)
    lora = LoRAConfig(rank=args.lora_rank, alpha=2.0 * args.lora_rank, target_modules="all-linear")
    loaded = build_model(hf_path, lora=lora, dtype=dtype)
    model = loaded.model.to(dtype).eval()
    g = torch.Generator().manual_seed(args.seed + 1)
    with torch.no_grad():
        for name, p in lora_parameters(model).items():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    adapter_dir = tmp / "adapter"
    save_peft_adapter(model, loaded.converter, lora, adapter_dir, str(hf_path))
    peft_model, report = _load_peft(load_hf(), adapter_dir)

    with torch.no_grad():
        archon_logits = model(tokens, positions, cu_seqlens, max_seqlen)
    peft_logits = _hf_forward(peft_model, seqs)
    lora_diff, lora_kl = _compare_logits(archon_logits, peft_logits.detach())
    report["lora_max_abs_logits_diff"] = lora_diff
    report["lora_mean_kl"] = lora_kl
    report["lora_effect_max_abs"] = (peft_logits.detach() - hf_logits).abs().max().item()

    # LoRA gradients of the summed label log-probs: archon's through the training path.
    peft_logprobs = label_logprobs(peft_logits, seqs)
    train_logprobs = training_path_logprobs(model, tokens, positions, cu_seqlens, max_seqlen, seqs)
    report["lora_max_abs_train_logprob_diff"] = (
        (train_logprobs.detach().double() - peft_logprobs.detach()).abs().max().item()
    )
    (-train_logprobs.sum()).backward()
    (-peft_logprobs.sum()).backward()
    report["lora_grad_max_rel_err"], report["lora_params_without_grad"] = lora_grad_errors(
        model, loaded.converter, peft_model
    )
    return report


def _verdict(args: AlignArgs, report: dict[str, Any], checks: list[tuple[str, float]], unread: list[str]):
    """The report with its tolerances, its failures and whether it passes."""
    failures = [name for name, tol in checks if not report[name] <= tol]
    if unread:
        failures.append("unaccounted_config_fields")  # read each in from_hf_config, or declare it inert
    if report["quantized_tensors"] and not report["archon_quantized_weights"]:
        failures.append("archon_quantized_weights")  # the check is of a base kept quantized
    if args.lora_rank is not None:
        if report["peft_missing_keys"] or report["peft_unexpected_keys"]:
            failures.append("peft_keys")
        if not report["lora_effect_max_abs"] > 1e-3:
            failures.append("lora_effect_max_abs")  # the adapter must change the outputs
        if report["lora_params_without_grad"]:
            failures.append("lora_params_without_grad")  # a LoRA module the training path never reaches
    report["tolerances"] = {name: tol for name, tol in checks}
    report["failures"] = failures
    report["pass"] = not failures
    return report


def _load_peft(hf_model, adapter_dir: Path):
    from peft import PeftModel
    from safetensors import safe_open

    peft_model = PeftModel.from_pretrained(hf_model, str(adapter_dir), is_trainable=True).eval()
    in_model = {n.replace(".default", "") for n, _ in peft_model.named_parameters() if "lora_" in n}
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), "pt") as f:
        in_file = set(f.keys())
    return peft_model, {
        "peft_missing_keys": sorted(in_model - in_file),
        "peft_unexpected_keys": sorted(in_file - in_model),
    }


def run_gate(args: AlignArgs) -> dict[str, Any]:
    """Gate v2: the tiny config (LoRA as asked) in args.dtype and in each of args.extra_dtypes (bfloat16
    without LoRA), each config variant (archon.tools.align_variants) in args.dtype, the generation
    cache, and TP x2. Every failed check is one line of `failures`, `CONFIG/DTYPE METRIC: VALUE > TOLERANCE`,
    and a run that raised is one too, `CONFIG/DTYPE error: TYPE: MESSAGE`."""
    if args.all:
        args = dataclasses.replace(
            args, variants=True, generation=True, mtp=True, extra_dtypes=("float64", "bfloat16"), tp=2
        )
    model_type = resolve_model_type(args)
    overrides = {**args.config_overrides, **parse_config_assignments(args.set)}
    base = dataclasses.replace(args, model_type=model_type, config_overrides=overrides, set=(), all=False)
    runs = [("tiny", base)]
    for extra in dict.fromkeys(d for d in args.extra_dtypes if d != args.dtype):
        bf16 = extra == "bfloat16"
        runs.append(("tiny", dataclasses.replace(base, dtype=extra, lora_rank=None if bf16 else base.lora_rank)))
    refused: dict[str, str] = {}
    if args.variants and args.hf_path is None:
        variants, refused = config_variants(model_type, overrides)
        runs += [
            (n, dataclasses.replace(base, config_overrides=o, generation=False, mtp=False)) for n, o in variants.items()
        ][1:]
    reports, failures = [], []
    for name, run_args in runs:
        where = f"{name}/{run_args.dtype}"
        try:
            report = run_alignment(run_args)
        except Exception as e:  # a port that cannot load or run fails the gate by name, with the reason
            failures.append(f"{where} error: {type(e).__name__}: {e}")
            if args.stop_at_first_failure:
                break
            continue
        reports.append({**report, "config": name})
        failures += [f"{where} {line}" for line in failure_lines(report)]
        if failures and args.stop_at_first_failure:
            break
    tp: dict[str, Any] = {}
    if args.tp > 1 and not (failures and args.stop_at_first_failure):
        tp, tp_failures = tp_gate(base, model_type, overrides)
        failures += tp_failures
    return {
        "model_type": model_type,
        "reports": reports,
        "refused_variants": refused,
        "tp": tp,
        "failures": failures,
        "pass": not failures,
    }


def main(argv: list[str] | None = None) -> int:
    import tyro

    args = tyro.cli(AlignArgs, args=argv)
    try:
        args = dataclasses.replace(args, model_type=resolve_model_type(args))
        check_quantize_option(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.all or args.variants or args.extra_dtypes or args.tp > 1:
        result = run_gate(args)
        print(format_gate(result))
        print(json.dumps(result))
        return 0 if result["pass"] else 1
    try:
        report = run_alignment(args)
    except Exception as e:  # a named FAIL line, not a traceback
        report = {"model_type": args.model_type, "failures": [f"error: {type(e).__name__}: {e}"], "pass": False}
        print(f"FAIL {args.dtype} error: {type(e).__name__}: {e}")
        print(json.dumps(report))
        return 1
    print(format_report(report))
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
