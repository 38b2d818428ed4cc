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

import dataclasses
import json
import math
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from archon.build import build_model, load_hf_config
from archon.checkpoint.hf import read_json_file
from archon.config_coverage import unaccounted_fields
from archon.head import model_label_logprobs
from archon.lora import LoRAConfig, lora_parameters
from archon.lora.peft import save_peft_adapter
from archon.precision import fp32_islands_in_fp64
from archon.quant import QuantFormat, quant_format_from_config, quantized_weights
from archon.quant.export import QUANTIZED_WEIGHTS, quantize_checkpoint
from archon.quant.formats import compressed_tensors_config
from archon.spec import get_spec
from archon.tools.align_report import format_report
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
}
DTYPES = {"float32": torch.float32, "float64": torch.float64}
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
    dtype: Literal["float32", "float64"] = "float32"
    """The dtype both sides run in; float64 tells fp32 rounding from a wrong port (see TOLERANCES)."""
    quantize: str | None = None
    """Store the checkpoint's weights in a published low-precision format before comparing: fp8
    (block-scaled e4m3, 128x128 blocks), fp8:RxC (R x C blocks, e.g. fp8:16x24), fp8-channel or
    fp8-tensor (compressed-tensors e4m3 with a scale per output channel or per tensor) or mxfp4 (the
    routed experts, GPT-OSS's layout)."""


def parse_config_assignments(assignments: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """["key=value", ...] -> {key: value}; a value is read as JSON (numbers, true/false/null, lists,
    objects), else kept as a string. `None` is null too."""
    overrides: dict[str, Any] = {}
    for item in assignments:
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key.isidentifier():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE with KEY a config field name")
        if text.strip() == "None":
            overrides[key] = None
            continue
        try:
            overrides[key] = json.loads(text)
        except json.JSONDecodeError:
            overrides[key] = text
    return overrides


def resolve_model_type(args: AlignArgs) -> str:
    """args.model_type, else the model_type of args.hf_path/config.json; a supported type either way."""
    overrides = parse_config_assignments(args.set)
    if args.hf_path is not None and (overrides or args.config_overrides):
        raise ValueError(
            "--set / config_overrides change the tiny model's config; a --hf-path checkpoint is checked as it is"
        )
    if args.hf_path is None:
        if args.model_type is None:
            raise ValueError("give --model-type (to check a tiny random model of that type) or --hf-path DIR")
        get_spec(args.model_type)
        return args.model_type
    config_path = Path(args.hf_path) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} does not exist; --hf-path must be an HF model directory")
    model_type = read_json_file(config_path, "model config").get("model_type")
    if not isinstance(model_type, str):
        raise ValueError(f'{config_path} has no "model_type" string, so it is not an HF transformers model config')
    if args.model_type is not None and args.model_type != model_type:
        raise ValueError(f"{config_path} holds model_type {model_type!r}, not {args.model_type!r}")
    try:
        get_spec(model_type)
    except ValueError as e:
        raise ValueError(f"{config_path}: {e}") from None
    return model_type


def quantize_option_format(option: str) -> QuantFormat:
    """The format an `--quantize` value names: fp8 (128x128 blocks), fp8:RxC, fp8-channel,
    fp8-tensor or mxfp4."""
    method, _, blocks = option.partition(":")
    if method == "mxfp4" and not blocks:
        return QuantFormat("mxfp4", (1, 32))
    if method in ("fp8-channel", "fp8-tensor") and not blocks:
        return quant_format_from_config(compressed_tensors_config(method.removeprefix("fp8-")))
    if method == "fp8":
        if not blocks:
            return QuantFormat("fp8", (128, 128))
        rows, x, cols = blocks.partition("x")
        if x and rows.isdigit() and cols.isdigit() and int(rows) > 0 and int(cols) > 0:
            return QuantFormat("fp8", (int(rows), int(cols)))
    raise ValueError(
        f"--quantize {option!r}: expected fp8 (128x128 blocks), fp8:RxC (blocks of R rows and C columns, "
        "e.g. fp8:16x24), fp8-channel, fp8-tensor or mxfp4"
    )


def _checkpoint_quantization_config(path: Path) -> dict | None:
    return read_json_file(path / "config.json", "model config").get("quantization_config")


def check_quantize_option(args: AlignArgs) -> None:
    """An error naming the option when --quantize is malformed or the --hf-path checkpoint is quantized already."""
    if args.quantize is None:
        return
    quantize_option_format(args.quantize)
    if args.hf_path is not None and _checkpoint_quantization_config(Path(args.hf_path)) is not None:
        raise ValueError(
            f"--quantize {args.quantize!r}: {str(Path(args.hf_path) / 'config.json')!r} has a quantization_config "
            "already; check a quantized checkpoint with --hf-path alone"
        )


def packed_batch(seq_lens, vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in seq_lens]
    tokens = torch.cat(seqs)
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()])
    return seqs, tokens, positions, cu_seqlens


def label_logprobs(logits: torch.Tensor, seqs: list[torch.Tensor]) -> torch.Tensor:
    """Log-prob of each next token within each sequence, packed: [sum(len-1)]."""
    out, start = [], 0
    for seq in seqs:
        n = len(seq)
        lp = torch.log_softmax(logits[start : start + n - 1].double(), dim=-1)
        out.append(lp.gather(-1, seq[1:, None])[:, 0])
        start += n
    return torch.cat(out)


def _compare_logits(a: torch.Tensor, h: torch.Tensor) -> tuple[float, float]:
    log_p_hf = torch.log_softmax(h.double(), -1)
    log_p_archon = torch.log_softmax(a.double(), -1)
    kl = (log_p_hf.exp() * (log_p_hf - log_p_archon)).sum(-1).mean().item()
    return (a - h).abs().max().item(), max(kl, 0.0)


def _hf_forward(hf_model, seqs):
    return torch.cat([hf_model(seq[None]).logits[0] for seq in seqs])


def label_positions(seqs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M], labels [M]) of the packed batch: each position but a sequence's last, and the next
    token, in the order of `label_logprobs`."""
    rows, labels, start = [], [], 0
    for seq in seqs:
        n = len(seq)
        rows.append(torch.arange(start, start + n - 1))
        labels.append(seq[1:])
        start += n
    return torch.cat(rows), torch.cat(labels)


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


def _run_alignment(args: AlignArgs) -> dict[str, Any]:
    model_type = resolve_model_type(args)
    check_quantize_option(args)
    dtype = DTYPES[args.dtype]
    tolerances = TOLERANCES[args.dtype]
    overrides = {**args.config_overrides, **parse_config_assignments(args.set)}
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        hf_path, hf_reference_path, quant_format, quantized_tensors = _checkpoints(
            args, model_type, overrides, Path(tmp)
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

        hf_model = load_hf()
        loaded = build_model(hf_path, dtype=dtype)
        model = loaded.model.to(dtype).eval()
        kept_quantized = len(quantized_weights(model))
        batch = packed_batch(args.seq_lens, hf_model.config.get_text_config().vocab_size, args.seed)
        seqs, tokens, positions, cu_seqlens = batch
        max_seqlen = max(args.seq_lens)
        with torch.no_grad():
            archon_logits = model(tokens, positions, cu_seqlens, max_seqlen)
            hf_logits = _hf_forward(hf_model, seqs)
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
        del model, loaded

        if args.lora_rank is not None:
            report.update(_compare_lora(args, hf_path, dtype, load_hf, batch, hf_logits, Path(tmp)))
            checks += [
                ("lora_max_abs_logits_diff", logits_tol),
                ("lora_max_abs_train_logprob_diff", logits_tol),
                ("lora_grad_max_rel_err", tolerances["lora_grad_max_rel_err"]),
            ]
    return _verdict(args, report, checks, unread)


def _checkpoints(args: AlignArgs, model_type: str, overrides: dict[str, Any], tmp: Path):
    """(the checkpoint archon loads, the plain one HF loads, its quantization format or None, how many
    weights it stores quantized): the tiny model or --hf-path, quantized by --quantize, and when
    quantized, HF's copy dequantized by the reference recipe."""
    if args.hf_path is None:
        hf_path = make_tiny_hf_checkpoint(model_type, tmp / "hf", args.seed, **overrides)
    else:
        hf_path = Path(args.hf_path)
    if args.quantize is not None:
        fmt = quantize_option_format(args.quantize)
        hf_path = quantize_checkpoint(hf_path, tmp / "quantized", fmt)

    # HF runs on a plain copy of a quantized checkpoint, dequantized by the reference recipe.
    quant_format = quant_format_from_config(_checkpoint_quantization_config(hf_path), str(hf_path / "config.json"))
    hf_reference_path, quantized_tensors = hf_path, 0
    if quant_format is not None:
        hf_reference_path, quantized_tensors = write_dequantized_reference(hf_path, tmp / "reference")
    if args.quantize is not None and quantized_tensors == 0:
        raise ValueError(
            f"--quantize {args.quantize!r}: no weight of the {model_type} checkpoint is one {quant_format.method} "
            f"stores (HF names matching {QUANTIZED_WEIGHTS[quant_format.method]!r})"
        )
    return hf_path, hf_reference_path, quant_format, quantized_tensors


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
    report["lora_grad_max_rel_err"] = _grad_rel_err(model, loaded.converter, peft_model)
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


def _grad_rel_err(model, converter, peft_model) -> float:
    peft_grads = {n.replace(".default", ""): p.grad for n, p in peft_model.named_parameters() if "lora_" in n}
    worst = 0.0
    for name, param in lora_parameters(model).items():
        for peft_key, grad in converter.lora_to_peft(name, param.grad):
            ref = peft_grads[peft_key]
            if ref is None:
                ref = torch.zeros_like(grad)
            scale = ref.abs().max().item()
            err = (grad - ref).abs().max().item()
            if scale == 0.0:
                rel = 0.0 if err == 0.0 else math.inf
            else:
                rel = err / scale
            worst = max(worst, rel)
    return worst


def main(argv: list[str] | None = None) -> int:
    import tyro

    args = tyro.cli(AlignArgs, args=argv)
    try:
        args = dataclasses.replace(args, model_type=resolve_model_type(args))
        check_quantize_option(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = run_alignment(args)
    print(format_report(report))
    print(json.dumps(report))
    return 0 if report["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
