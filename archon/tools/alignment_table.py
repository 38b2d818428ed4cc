"""The alignment table of the documentation: the gate on every registered model type, fp32 and fp64.

    python -m archon.tools.alignment_table [--lora-rank 8] [--model-types qwen3 llama ...]

For each type it runs `archon.tools.align` on the type's tiny random model with a random LoRA, in
fp32 and in fp64, and prints a Markdown table (then one JSON line per run). The exit code is
non-zero when any run fails its gate.
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import dataclass

from archon.spec import supported_model_types
from archon.tools.align import TOLERANCES, AlignArgs, run_alignment


@dataclass
class AlignmentTableArgs:
    model_types: tuple[str, ...] = ()
    """The HF model types to check; default: every registered type."""
    lora_rank: int = 8


COLUMNS = (
    ("max_abs_logits_diff", "max \\|Δlogits\\|"),
    ("max_abs_train_logprob_diff", "training path max \\|Δlogprob\\|"),
    ("lora_max_abs_logits_diff", "LoRA max \\|Δlogits\\|"),
    ("lora_grad_max_rel_err", "LoRA grad rel. err"),
)


def markdown_table(reports: dict[str, dict[str, dict]]) -> str:
    """reports[model_type][dtype] -> one row per type: fp32 then fp64 figures of each column."""
    header = ["model_type"]
    for _, title in COLUMNS:
        header += [f"{title} fp32", "fp64"]
    header.append("config fields unaccounted")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for model_type, by_dtype in reports.items():
        row = [model_type]
        for key, _ in COLUMNS:
            row += [f"{by_dtype[dtype][key]:.1e}" for dtype in ("float32", "float64")]
        row.append(str(len(by_dtype["float32"]["unaccounted_config_fields"])))
        lines.append("| " + " | ".join(row) + " |")
    limits = ["tolerance"]
    for key, _ in COLUMNS:
        tolerance_key = "lora_grad_max_rel_err" if key == "lora_grad_max_rel_err" else "max_abs_logits_diff"
        limits += [f"{TOLERANCES[dtype][tolerance_key]:.0e}" for dtype in ("float32", "float64")]
    limits.append("0")
    lines.append("| " + " | ".join(limits) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import tyro

    args = tyro.cli(AlignmentTableArgs, args=argv)
    model_types = args.model_types or tuple(supported_model_types())
    reports: dict[str, dict[str, dict]] = {}
    runs = []
    for model_type in model_types:
        for dtype in ("float32", "float64"):
            start = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = run_alignment(AlignArgs(model_type=model_type, lora_rank=args.lora_rank, dtype=dtype))
            report["seconds"] = round(time.perf_counter() - start, 1)
            reports.setdefault(model_type, {})[dtype] = report
            runs.append(report)
    print(markdown_table(reports))
    for report in runs:
        print(json.dumps(report))
    return 0 if all(report["pass"] for report in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
