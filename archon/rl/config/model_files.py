"""The rules that read files: the model directory's config.json (its context length, its MTP
layers, the family's vLLM modes), the teachers' and the data files of each task. They run on the
settings as given, before any model is loaded."""

from __future__ import annotations

import math
from pathlib import Path

from archon.checkpoint.hf import check_model_dir, read_json_file
from archon.quant.formats import quant_format_from_config
from archon.rl.config.demo import demo_environment_problems, reasoning_gym_demo_problems
from archon.rl.config.schema import RLConfig, TaskConfig, TaskFields, tasks_and_fields
from archon.rl.data import data_path_problem
from archon.rl.data.reasoning_gym import reasoning_gym_overlap
from archon.rl.problems import Problems
from archon.rollout.vllm import merged_needs_collective, resolve_vllm_mode
from archon.rollout.vllm_server import max_position_embeddings

# The config fields that count a checkpoint's MTP layers (DeepSeek-V3 and Qwen3-Next; Qwen3.5).
MTP_CONFIG_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def read_model_config(directory: str, field_name: str) -> dict | None:
    """The config.json of an HF checkpoint directory, or None when there is none (the model loader
    reports a missing checkpoint); an unreadable file is an error naming it."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        return None
    try:
        return read_json_file(path, "model config")
    except ValueError as e:
        raise ValueError(f"{field_name}: {e}") from None


def model_problems(config: RLConfig) -> list[str]:
    """The model directory (config.json: the context length, the vLLM mode) and each task's files;
    without model.path, the demo's rules against the run's environment and data."""
    if config.model.path is None:  # the demo builds its model later
        if config.demo.kind == "code_tool":
            return [
                problem for task in config.task_configs() for problem in demo_environment_problems(task.environment)
            ]
        if config.demo.kind == "reasoning_gym":
            return reasoning_gym_demo_problems(config.demo.reasoning_gym, config.data, config.eval.path, config.tasks)
        return []
    problems = []
    try:
        check_model_dir(config.model.path, "model.path")
    except (OSError, ValueError) as e:
        problems.append(str(e))
    if config.model.tokenizer and not Path(config.model.tokenizer).is_dir():
        problems.append(f"tokenizer directory '{config.model.tokenizer}' (from model.tokenizer) does not exist")
    student = read_model_config(config.model.path, "model.path")
    if student is not None:  # before transformers reads it: a quantization_config it cannot read fails there unnamed
        try:
            quant_format_from_config(student.get("quantization_config"), str(Path(config.model.path) / "config.json"))
        except ValueError as e:
            problems.append(f"model.path: {e}")
    context = max_position_embeddings(student) if student else None
    if isinstance(context, int):
        for name, value in (
            ("rollout.max_new_tokens", config.rollout.max_new_tokens),
            ("eval.max_new_tokens", config.eval.max_new_tokens),
        ):
            if value is not None and value >= context:
                problems.append(
                    f"{name}={value}: the model's context is {context} tokens (max_position_embeddings in "
                    f"{Path(config.model.path) / 'config.json'}), which leaves no room for a prompt"
                )
    if config.rollout.engine == "vllm" and student is not None:
        problems += _vllm_mode_problems(config, student)
    for task, fields in tasks_and_fields(config):
        problems += _file_problems(task, fields, config.model.path, student)
    return problems


def _file_problems(task: TaskConfig, fields: TaskFields, model_path: str, student: dict | None) -> list[str]:
    """A task's files, with a model to train (model.path): its training and held-out prompts, and the
    config.json of its teacher."""
    problems = []
    data_path = f"{fields.prefix}data.path"
    if not task.data.path:
        problems.append(
            f"{data_path} is not set: it is required with model.path (a .jsonl, .parquet or datasets directory)"
        )
    elif (problem := data_path_problem(task.data.path)) is not None:
        problems.append(f"{data_path}={task.data.path!r}: {problem}")
    if task.eval_path and (problem := data_path_problem(task.eval_path)) is not None:
        problems.append(f"{fields.eval_path}={task.eval_path!r}: {problem}")
    elif task.eval_path and (overlap := reasoning_gym_overlap(task.data.path, task.eval_path)) is not None:
        problems.append(f"{fields.eval_path}={task.eval_path!r}: {overlap}")
    teachers = [(task.algorithm.teacher_path, f"{fields.prefix}algorithm.teacher_path")]
    teachers += [
        (t.path, f"{fields.prefix}algorithm.teachers[{i}].path") for i, t in enumerate(task.algorithm.teachers)
    ]
    for teacher_path, where in teachers:
        if not teacher_path:
            continue
        teacher = read_model_config(teacher_path, where)
        if teacher is None:
            problems.append(f"{where}={teacher_path!r}: no config.json there; expected an HF model directory")
        elif student is not None and teacher.get("vocab_size") != student.get("vocab_size"):
            problems.append(
                f"{where}={teacher_path!r}: the teacher's vocabulary has {teacher.get('vocab_size')} tokens and the "
                f"student's (model.path={model_path!r}) {student.get('vocab_size')}; distillation compares "
                "log-probs of the same token ids, so they must share a vocabulary"
            )
    return problems


def _vllm_mode_problems(config: RLConfig, model_config: dict) -> list[str]:
    """The servers' mode (rollout.vllm.mode, or the family's) against the transport and the
    staleness bound, before any server is launched."""
    vllm, max_staleness = config.rollout.vllm, config.rollout.max_staleness
    try:
        mode = resolve_vllm_mode(vllm, model_config, lora=config.lora is not None)
    except ValueError as e:
        return [str(e)]
    problems = []
    if mode == "merged" and vllm.transport == "disk":
        problems.append(merged_needs_collective(vllm, lora=config.lora is not None))
    if mode == "adapter" and max_staleness > 0 and not vllm.urls and vllm.max_loras < 2:
        problems.append(
            f"rollout.vllm.max_loras={vllm.max_loras}: with rollout.max_staleness={max_staleness} the requests in "
            "flight keep their adapter version while the next one is served, so a server batch holds two "
            "adapters at once; set it to 2 or more"
        )
    return problems


def mtp_problems(config: RLConfig) -> list[str]:
    """model.mtp and algorithm.mtp_loss_weight against each other, the tasks, context parallelism and
    the checkpoint's config."""
    problems = Problems()
    trained = []
    for task, fields in tasks_and_fields(config):
        weight = task.algorithm.mtp_loss_weight
        name = f"{fields.prefix}algorithm.mtp_loss_weight"
        problems.require(math.isfinite(weight) and weight >= 0, name, weight, "must be a finite number >= 0")
        if weight > 0:
            trained.append(f"{name}={weight!r}")
            problems.require(
                not config.tasks, name, weight, "training the MTP layer is not supported with several tasks"
            )
            problems.require(
                config.model.mtp != "skip", name, weight, "trains the MTP layer, which model.mtp='skip' leaves unloaded"
            )
            problems.require(
                config.parallel.cp == 1,
                name,
                weight,
                f"is not supported with context parallelism (parallel.cp="
                f"{config.parallel.cp}): the MTP layer reads the token after each position; set parallel.cp to 1",
            )
    if config.model.path is None:
        problems.require(config.model.mtp != "load", "model.mtp", config.model.mtp, "the demo model has no MTP layers")
        problems += [f"{name}: the demo model has no MTP layers to train; set model.path" for name in trained]
        return problems
    if config.model.mtp == "skip" or not (config.model.mtp == "load" or trained):
        return problems
    student = read_model_config(config.model.path, "model.path")
    if student is None:
        return problems
    text = student.get("text_config") or student
    if not any(isinstance(text.get(f), int) and text.get(f) > 0 for f in MTP_CONFIG_FIELDS):
        asked = "model.mtp='load'" if config.model.mtp == "load" else trained[0]
        problems.append(
            f"{asked}: {Path(config.model.path) / 'config.json'} declares no multi-token-prediction layers "
            f"({' or '.join(MTP_CONFIG_FIELDS)}), so the checkpoint has none to load"
        )
    return problems


def speculative_mtp_problems(config: RLConfig) -> list[str]:
    """rollout.speculative.method=mtp drafts with the model's MTP layer: one must be loaded."""
    name, value = "rollout.speculative.method", "mtp"
    if config.model.mtp == "skip":
        return [f"{name}={value!r}: drafts with the MTP layer, which model.mtp='skip' leaves unloaded"]
    if config.model.path is None:
        return [f"{name}={value!r}: the demo model has no MTP layer to draft with; set model.path"]
    student = read_model_config(config.model.path, "model.path")
    if student is None:
        return []
    text = student.get("text_config") or student
    if any(isinstance(text.get(f), int) and text.get(f) > 0 for f in MTP_CONFIG_FIELDS):
        return []
    return [
        f"{name}={value!r}: {Path(config.model.path) / 'config.json'} declares no multi-token-prediction layers "
        f"({' or '.join(MTP_CONFIG_FIELDS)}) to draft with; use method=draft_model"
    ]
