"""The model card (README.md) of an exported adapter directory, in the form PEFT's save_pretrained
writes: YAML front matter (base_model, library_name: peft, tags, pipeline_tag) that
huggingface_hub.ModelCard reads, then what the adapter is and how it was made: the base model, the
LoRA settings, the data, the algorithm and its key settings, the metrics of the step it was saved
at (from RUN_DIR/metrics.jsonl) and the command that ran.
"""

from __future__ import annotations

import collections
import importlib.metadata
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import yaml

from archon.rl.logging.metrics import METRICS_FILE, read_metrics
from archon.secrets import redact

RESULT_METRICS = (
    ("reward_mean", "mean reward"),
    ("accuracy", "accuracy (reward >= 1)"),
    ("response_length", "mean response length (tokens)"),
    ("distill_logprob_gap", "log pi_student - log pi_teacher (mean per token)"),
)
"""The step's metrics the card reports (besides the held-out accuracy), with their descriptions."""


def launch_command() -> str:
    """The command line that started this process, as a shell line: torchrun's when torchrun
    launched it (read from the parent process on Linux, else rebuilt from torchrun's environment),
    else `python` and sys.argv; the config's secrets redacted (archon.secrets)."""
    return redact(_launch_command())


def _launch_command() -> str:
    argv = list(sys.argv)
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return shlex.join(["python", *argv])
    parent = _parent_command()
    if parent is not None and argv and any(Path(word).name == Path(argv[0]).name for word in parent):
        if len(parent) > 1 and Path(parent[1]).name == "torchrun":  # `python .../bin/torchrun ...`
            parent = ["torchrun", *parent[2:]]
        elif Path(parent[0]).name == "torchrun":
            parent = ["torchrun", *parent[1:]]
        return shlex.join(parent)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    nodes = max(int(os.environ.get("WORLD_SIZE", str(local))) // max(local, 1), 1)
    launcher = ["torchrun", f"--nproc_per_node={local}"] + ([f"--nnodes={nodes}"] if nodes > 1 else [])
    return shlex.join([*launcher, *argv])


def _parent_command() -> list[str] | None:
    """The parent process's command line (Linux), or None."""
    try:
        words = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return [word.decode(errors="replace") for word in words if word] or None


def card_metrics(run_dir: Path, step: int, prefix: str) -> dict[str, Any]:
    """The metrics of RUN_DIR/metrics.jsonl a card reports for a task (its metrics' `prefix`) at RL
    step `step`: the last record up to `step` (its step, and each of RESULT_METRICS it has), and the
    latest held-out accuracy up to `step` with its step."""
    path = run_dir / METRICS_FILE
    records = [r for r in read_metrics(run_dir) if r["step"] <= step] if path.exists() else []
    found: dict[str, Any] = {}
    trained = [r for r in records if r["step"] > 0]
    if trained:
        last = trained[-1]
        found["step"] = last["step"]
        found.update({key: last[prefix + key] for key, _ in RESULT_METRICS if last.get(prefix + key) is not None})
    held_out = [r for r in records if r.get(prefix + "eval_accuracy") is not None]
    if held_out:
        found["eval_accuracy"] = held_out[-1][prefix + "eval_accuracy"]
        found["eval_step"] = held_out[-1]["step"]
    return found


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ", ".join(f"`{v}`" for v in value) if value else "none"
    if isinstance(value, dict):
        return ", ".join(f"`{k}`: {v}" for k, v in value.items()) if value else "none"
    return f"`{value}`"


def _table(rows: list[tuple[str, Any]]) -> list[str]:
    return ["| setting | value |", "|---|---|", *[f"| {name} | {_value(value)} |" for name, value in rows]]


def model_card(run, task, step: int, final: bool, command: str | None = None) -> str:
    """README.md of `task`'s adapter exported at RL step `step` of `run` (the run's RunContext; `final`: the
    run's last adapter, TASK_DIR/adapter). `command`: the launch command (default: this process's).
    The config's secrets are redacted from the whole card."""
    config, task_config = run.config, task.config
    lora, algo, algorithm = task_config.lora, task_config.algorithm, task.algorithm
    base = str(config.model.path)
    distilled = algorithm.needs_teacher
    tags = ["archon", "lora", f"base_model:adapter:{base}", algorithm.name, "reinforcement-learning"]
    if distilled:
        tags.append("on-policy-distillation")
    front = {"base_model": base, "library_name": "peft", "pipeline_tag": "text-generation", "tags": tags}
    name = f"task `{task.name}` of " if task.name else ""
    load = f"AutoModelForCausalLM.from_pretrained({base!r}), {str(task_export_dir(task, step, final))!r}"
    tokenizer = f" (tokenizer: `{config.model.tokenizer}`)" if config.model.tokenizer else ""
    state = (
        f"the final adapter, after {step} of {config.steps} RL steps"
        if final
        else (f"the adapter at RL step {step} of {config.steps}")
    )
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).rstrip(),
        "---",
        "",
        f"# {Path(base).name} + LoRA ({algorithm.name})",
        "",
        f"A LoRA adapter of `{base}` trained by archon with {algorithm.spec.summary.split(':')[0]} "
        f"({name}the run in `{run.run_dir}`): {state}. It is a PEFT adapter directory.",
        "",
        "```python",
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        "",
        f"model = PeftModel.from_pretrained({load})",
        "```",
        "",
        "## Base model",
        "",
        f"`{base}`{tokenizer}, weights in {config.model.dtype}.",
        "",
        "## LoRA",
        "",
        *_table(_lora_rows(lora)),
        "",
        "## Data",
        "",
        *_data_lines(task, task_config),
        "",
        "## Algorithm",
        "",
        algorithm.spec.summary + ".",
        "",
        *_table(_algorithm_rows(run, task, algo, algorithm)),
        "",
        "## Results",
        "",
        *_result_lines(run.run_dir, step, task.prefix),
        "",
        "## Command",
        "",
        "```bash",
        command if command is not None else launch_command(),
        "```",
        "",
        "### Framework versions",
        "",
        *_version_lines(),
        "",
    ]
    return redact("\n".join(lines))


def _lora_rows(lora) -> list[tuple[str, Any]]:
    targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    return [
        ("rank (r)", lora.rank),
        ("alpha", lora.alpha),
        ("scaling", "alpha / sqrt(r) (rsLoRA)" if lora.use_rslora else "alpha / r"),
        ("target modules", targets),
        ("dropout", lora.dropout),
        ("rank pattern", dict(lora.rank_pattern)),
        ("alpha pattern", dict(lora.alpha_pattern)),
        ("MoE experts", lora.experts),
    ]


def _version_lines() -> list[str]:
    return [
        f"- {package} {version}"
        for package in ("archon", "peft", "torch", "transformers")
        if (version := _version(package)) is not None
    ]


def task_export_dir(task, step: int, final: bool) -> Path:
    """Where `task`'s adapter of RL step `step` is exported (archon.rl.run.checkpoints.save)."""
    return task.dir / ("adapter" if final else f"adapters/step_{step:06d}")


def _data_lines(task, task_config) -> list[str]:
    sources = collections.Counter(example.data_source for example in task.train_set.examples)
    skipped = len(task.train_set.malformed) + len(task.train_set.too_long)
    lines = [
        f"- training prompts: `{task_config.data.path}`, {len(task.train_set)} prompts"
        + (f" ({skipped} rows skipped: malformed or too long)" if skipped else "")
    ]
    if len(sources) > 1 or "" not in sources:
        by_source = ", ".join(f"`{source or '(none)'}` {count}" for source, count in sorted(sources.items()))
        lines.append(f"- data sources: {by_source}")
    if task.eval_set is not None:
        lines.append(f"- held-out prompts: `{task_config.eval_path}`, {len(task.eval_set)} prompts")
    lines.append(f"- reward function: `{task_config.reward.function}`")
    return lines


def _algorithm_rows(run, task, algo, algorithm) -> list[tuple[str, Any]]:
    config = run.config
    loss = algo.loss
    rows: list[tuple[str, Any]] = [
        ("algorithm", algorithm.name),
        ("RL steps", config.steps),
        ("prompts per step", config.rollout.prompts_per_step),
        ("samples per prompt", config.rollout.group_size),
        ("max new tokens", config.rollout.max_new_tokens),
        ("temperature", config.rollout.temperature),
        ("learning rate", task.config.optim.lr),
        ("PPO epochs", algo.ppo_epochs),
        ("minibatches", algo.minibatches),
        ("clip range", f"[1 - {algorithm.clip_low}, 1 + {algorithm.clip_high}]"),
        ("aggregation", algorithm.aggregation),
        ("importance sampling", algorithm.importance_sampling),
        ("KL coefficient", loss.kl_coef),
        ("entropy coefficient", loss.entropy_coef),
        ("max staleness", task.config.max_staleness),
    ]
    if algo.dynamic_sampling:
        rows.append(("dynamic sampling", True))
    if algo.overlong_buffer:
        rows.append(("overlong buffer", algo.overlong_buffer))
    if algo.teacher_path is not None:
        rows.append(("teacher" if not algo.teachers else "default teacher", algo.teacher_path))
    for teacher in algo.teachers:
        rows.append((f"teacher of `{teacher.data_source}`", teacher.path))
    if algorithm.needs_teacher:
        rows.append(
            (
                "distillation weight",
                algo.distillation_weight
                if algo.distillation_weight is not None
                else "none (the teacher's advantage alone)",
            )
        )
    return rows


def _result_lines(run_dir: Path, step: int, prefix: str) -> list[str]:
    found = card_metrics(run_dir, step, prefix)
    if "step" not in found and "eval_accuracy" not in found:
        return ["No step has been logged yet."]
    lines = []
    if "step" in found:
        lines.append(f"From `metrics.jsonl`, RL step {found['step']}:")
        lines.append("")
        lines += [f"- {text}: {found[key]:.6g}" for key, text in RESULT_METRICS if key in found]
    if "eval_accuracy" in found:
        lines.append(f"- held-out accuracy (greedy, step {found['eval_step']}): {found['eval_accuracy']:.6g}")
    return lines
