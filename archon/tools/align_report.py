"""The alignment tool's report (archon.tools.align.run_alignment) as text: each measure against its
tolerance, the quantization checked, config fields unaccounted for, PEFT's load, the verdict."""

from __future__ import annotations

from typing import Any


def format_report(report: dict[str, Any]) -> str:
    rows = [("metric", "value", "tolerance", "ok")]
    tolerances = report["tolerances"]
    for key in (
        "max_abs_logits_diff",
        "mean_kl",
        "max_abs_logprob_diff",
        "max_abs_train_logprob_diff",
        "lora_max_abs_logits_diff",
        "lora_mean_kl",
        "lora_max_abs_train_logprob_diff",
        "lora_effect_max_abs",
        "lora_grad_max_rel_err",
    ):
        value = report.get(key)
        if value is None:
            continue
        tol = tolerances.get(key)
        ok = "" if tol is None else ("yes" if value <= tol else "NO")
        rows.append((key, f"{value:.3e}", "" if tol is None else f"{tol:.0e}", ok))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        f"archon vs HF transformers: {report['model_type']} ({report['sequences']} packed sequences, "
        f"{report['tokens']} tokens, {report['dtype']})"
    ]
    if report.get("quantization"):
        lines.append(
            f"quantized checkpoint: {report['quantization']}, {report['quantized_tensors']} weights stored quantized; "
            f"archon keeps {report['archon_quantized_weights']} weights quantized, "
            "HF runs on the reference dequantization"
        )
    for i, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths)))
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    if report.get("unaccounted_config_fields"):
        lines.append(
            "config fields neither read by from_hf_config nor declared inert (ModelSpec.inert_hf_config_fields): "
            + ", ".join(report["unaccounted_config_fields"])
        )
    for pattern in report.get("single_kind_patterns", []):
        lines.append(f"warning: every layer of the checked config is of one kind in {pattern}")
    if "peft_missing_keys" in report:
        lines.append(
            f"PEFT load: {len(report['peft_missing_keys'])} missing, "
            f"{len(report['peft_unexpected_keys'])} unexpected adapter keys"
        )
    lines.append("PASS" if report["pass"] else f"FAIL: {', '.join(report['failures'])}")
    return "\n".join(lines)
