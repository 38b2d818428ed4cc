"""The alignment tool's report (archon.tools.align.run_alignment) as text: each measure against its
tolerance, the quantization checked, config fields unaccounted for, PEFT's load, the verdict; and gate
v2's (archon.tools.align.run_gate): each run's table, then one named line per failed check."""

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
        "cache_max_abs_logprob_diff",
        "cache_greedy_mismatches",
        "bf16_norm_max_abs_diff",
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
    lines.append("PASS" if report["pass"] else "\n".join(f"FAIL {line}" for line in failure_lines(report)))
    return "\n".join(lines)


def failure_lines(report: dict[str, Any]) -> list[str]:
    """One line per failed check of a run_alignment report: the metric, its value and its tolerance,
    or what is wrong (the fields, the keys, the parameters)."""
    lines = []
    for name in report["failures"]:
        tol = report.get("tolerances", {}).get(name)
        if tol is not None:
            lines.append(f"{name}: {report[name]:.3e} > {tol:.0e}")
        elif name == "unaccounted_config_fields":
            lines.append(f"{name}: {', '.join(report[name])} (read in from_hf_config or declare inert)")
        elif name == "peft_keys":
            lines.append(
                f"peft_keys: missing {report['peft_missing_keys']}, unexpected {report['peft_unexpected_keys']}"
            )
        elif name == "lora_effect_max_abs":
            lines.append(f"lora_effect_max_abs: {report[name]:.3e} <= 1e-03 (the adapter does not act)")
        elif name == "lora_params_without_grad":
            lines.append(f"lora_params_without_grad: {report[name]} (the training path never reaches them)")
        elif name == "archon_quantized_weights":
            lines.append("archon_quantized_weights: 0 (the base was not kept quantized)")
        else:
            lines.append(name)
    return lines


def format_gate(result: dict[str, Any]) -> str:
    """Gate v2: each run's table, the refused variants, the TP figures, then PASS or one FAIL line per
    failed check."""
    lines = []
    for report in result["reports"]:
        lines += [f"== {report['config']} ==", format_report(report), ""]
    for name, reason in result["refused_variants"].items():
        lines.append(f"variant {name}: refused by the family ({reason})")
    for name, value in result["tp"].items():
        lines.append(f"{name}: {value if isinstance(value, list) else f'{value:.3e}'}")
    if result["pass"]:
        lines.append(f"PASS ({len(result['reports'])} runs{', TP x2' if result['tp'] else ''})")
    lines += [f"FAIL {line}" for line in result["failures"]]
    return "\n".join(lines)
