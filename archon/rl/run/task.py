"""A task of an RL run: one adapter trained on its own data with its own reward and algorithm.

A run without `tasks` is one unnamed task built from the top-level fields; its outputs are the run
directory's own (RUN_DIR/adapter, RUN_DIR/checkpoints) and its metrics carry no prefix. Named tasks
(multi-LoRA) write to RUN_DIR/tasks/<name>/ and, when there are several, prefix their metrics with
"<name>/".
"""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from archon.agents.setup import build_episode_runner
from archon.checkpoint.atomic import atomic_write_json
from archon.checkpoint.resume import CheckpointManager
from archon.rl.algorithms import get_algorithm, teacher_setting
from archon.rl.config import AlgorithmConfig, RLConfig, RolloutConfig, TaskConfig
from archon.rl.data import PromptBatchIterator, PromptExample, load_prompt_dataset
from archon.rl.rewards import RewardScorer, UnroutedSourceError, unrouted_message
from archon.rl.run.producer import RolloutProducer
from archon.rl.run.run_dir import TASKS_DIR
from archon.rl.run.step_metrics import TaskStep
from archon.rl.run.versions import AdapterHistory
from archon.secrets import redact
from archon.sync.weight_sync import build_weight_sync
from archon.trainer import NonFiniteError

logger = logging.getLogger("archon.rl")


class RewardFunctionError(RuntimeError):
    """The reward function failed on every sample for too many steps in a row."""


STOPPED_FILE = "stopped.json"
"""In a task's directory once the task is stopped: the step and the reason; a resumed run keeps it stopped."""


def read_stopped_record(path: Path) -> dict:
    """A stopped task's record (STOPPED_FILE): {"step": the RL step it stopped at, "reason": why}."""
    advice = "fix it, or delete it to train the task again"
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read ({e}); it records why the task was stopped: {advice}") from None
    if not isinstance(record, dict) or not isinstance(record.get("reason"), str) or "step" not in record:
        raise ValueError(f"{path} is not a record of a stopped task (a JSON object with 'step' and 'reason'): {advice}")
    return record


def source_teachers(
    algorithm: AlgorithmConfig, examples: list[PromptExample], data_path: str, where: str
) -> dict[str, tuple[str, str]]:
    """(teacher path, the setting naming it) of each data source of `examples` (the training
    prompts of `data_path`), by algorithm.teachers and the default algorithm.teacher_path; a source
    with neither is a ValueError naming the source, its rows and the settings (`where`: the
    algorithm section's place). A listed source the data lacks is logged, not loaded."""
    rows: dict[str, list[PromptExample]] = {}
    for example in examples:
        rows.setdefault(example.data_source, []).append(example)
    chosen = {}
    for source in sorted(rows):
        setting = teacher_setting(algorithm, source, where)
        if setting is None:
            named = f"data_source {source!r}" if source else "no data_source"
            listed = ", ".join(repr(t.data_source) for t in algorithm.teachers)
            raise ValueError(
                f"{where}.teachers: {len(rows[source])} training prompt(s) of {data_path} have {named} (e.g. "
                f"{rows[source][0].source}) and no teacher: {where}.teachers lists {listed} and "
                f"{where}.teacher_path (the teacher of the sources not listed) is not set; add "
                f"{{data_source: {source!r}, path: ...}} to {where}.teachers or set {where}.teacher_path"
            )
        chosen[source] = setting
    for i, teacher in enumerate(algorithm.teachers):
        if teacher.data_source not in rows:
            logger.warning(
                "%s.teachers[%d].data_source=%r: no training prompt of %s has this source; its teacher "
                "(%s) is not used",
                where,
                i,
                teacher.data_source,
                data_path,
                teacher.path,
            )
    return chosen


class Task:
    """One task of the run: its data and iterator, reward, algorithm, teachers, rollout engine and
    weight sync (once the run's engines are up), producer, adapter version, failure streaks, output
    directory and resume state.

    Built from the task's settings and what the run shares with it: `shared`, the run's settings;
    `context`, the model's context length; `eval_new_tokens`, the held-out completions' length;
    `teacher(path, option)`, the run's frozen teacher at `path` (loaded once, shared between tasks);
    `run_dir`; `reports`, whether this rank prints the data reports."""

    def __init__(
        self,
        index: int,
        config: TaskConfig,
        prefix: str,
        *,
        shared: RLConfig,
        tokenizer,
        context: int,
        eval_new_tokens: int,
        teacher: Callable[[str, str], torch.nn.Module],
        run_dir: Path,
        reports: bool,
    ) -> None:
        self.name, self.index, self.config = config.name, index, config
        self.prefix = prefix
        """Put before the task's metric names: "<name>/" when the run has several tasks, else ""."""
        self.seed_offset = zlib.crc32(self.name.encode()) % 100_003 if self.name else 0
        """Sampling seeds follow the task's name, not its place in the list, so adding or removing
        another task leaves this one's rollouts as they were."""
        self.algorithm = get_algorithm(config.algorithm, shared.rollout.max_new_tokens, config.max_staleness)
        self._load_data(shared, tokenizer, context, eval_new_tokens, reports)
        self.teacher = None
        """The default teacher (algorithm.teacher_path), when a source of the data takes it."""
        self.teachers: dict[str, torch.nn.Module] = {}
        """The teacher of each data source of the training prompts, with distillation (teachers
        shared between sources, or with other tasks, are one model)."""
        if self.algorithm.needs_teacher:
            where = f"tasks[{index}].algorithm" if self.name else "algorithm"
            chosen = source_teachers(config.algorithm, self.train_set.examples, config.data.path, where)
            self.teachers = {source: teacher(path, option) for source, (path, option) in chosen.items()}
            default = [source for source, (_, option) in chosen.items() if option == f"{where}.teacher_path"]
            self.teacher = self.teachers[default[0]] if default else None
        self.dir = run_dir / TASKS_DIR / self.name if self.name else run_dir
        self.checkpoints = CheckpointManager(self.dir / "checkpoints", keep_last=shared.checkpoint.keep_last)
        self.scorer: RewardScorer | None = None
        self.episodes = self.tool_runner = None
        """A multi-turn task's EpisodeRunner and ToolRunner (archon.agents)."""
        self.rollout = self.sync = None
        self.producer: RolloutProducer | None = None
        """Makes the task's rollouts ahead (max_staleness >= 1)."""
        self.adapter_history: AdapterHistory | None = None
        """The task's adapters of the last versions, kept on every rank when samples may lag and the
        version gap is measured (max_staleness >= 1 and rollout.measure_version_gap)."""
        if config.max_staleness > 0 and shared.rollout.measure_version_gap:
            self.adapter_history = AdapterHistory(keep=config.max_staleness + 1)
        self.version = 0
        """This task's adapter version: the RL steps it has trained."""
        self.stopped: str | None = None
        """Why the task was stopped (None while it trains)."""
        self.skipped_streak: list[int] = []
        """RL steps in a row (the latest last) with an update skipped for a non-finite loss or gradient."""
        self.reward_failure_streak: list[int] = []
        """RL steps in a row on which the reward function failed on every sample."""
        self.resumed_fidelity: dict | None = None
        """The fidelity guard's state in the checkpoint a resumed run loaded (archon.rl.run.fidelity)."""
        self.skipped_steps = 0
        """RL steps so far with a skipped update (the `skipped_steps` metric)."""
        self.trained_iterator_state: dict | None = None
        """The data iterator as of the last trained step's prompts (a producer draws ahead)."""

    def _load_data(self, shared: RLConfig, tokenizer, context: int, eval_new_tokens: int, reports: bool) -> None:
        """The task's training prompts and their iterator, and its held-out prompts (with eval.every);
        every data source of them must have a reward."""
        config, where = self.config, f"{self.name} " if self.name else ""
        self.train_set = load_prompt_dataset(config.data, tokenizer, context, shared.rollout.max_new_tokens)
        self._report(reports, f"{where}train", self.train_set)
        self.iterator = PromptBatchIterator(
            self.train_set.examples,
            batch_size=shared.rollout.prompts_per_step,
            seed=config.data.seed,
            shuffle=config.data.shuffle,
            drop_last=config.data.drop_last,
        )
        self.eval_set = None
        if config.eval_path and shared.eval.every:
            eval_data = replace(config.data, path=config.eval_path)
            self.eval_set = load_prompt_dataset(eval_data, tokenizer, context, eval_new_tokens)
            self._report(reports, f"{where}held-out", self.eval_set)
        held_out = self.eval_set.examples if self.eval_set is not None else []
        if unrouted := config.reward.unrouted_sources([e.data_source for e in self.train_set.examples + held_out]):
            raise UnroutedSourceError(
                unrouted_message(unrouted, f"tasks[{self.index}].reward" if self.name else "reward")
            )

    def start_workers(self, tokenizer, model_type: str) -> None:
        """Start the task's reward workers and, for a multi-turn task, its episode runner and tools
        (processes: the run starts them once every task is built)."""
        self.scorer = RewardScorer(self.config.reward, self.data_sources())
        if self.config.environment.enabled:
            self.episodes, self.tool_runner = build_episode_runner(
                self.config.environment, tokenizer, model_type, self.config.data.prompt_field
            )

    def connect(self, rollout, rollout_config: RolloutConfig, sync_dir: Path, channel) -> None:
        """Generate with the engine `rollout` and publish each adapter version to it through a weight
        sync of the task's own (`sync_dir`: where adapters for vLLM are written; `channel`: the run's
        collective channel to the vLLM workers, if any)."""
        self.rollout = rollout
        self.sync = build_weight_sync(
            rollout_config, rollout, lora=self.config.lora, sync_dir=sync_dir, task=self.name or None, channel=channel
        )

    def stop(self, step: int, reason: str, writes_record: bool) -> None:
        """Stop training the task at RL step `step` (its last checkpoint and adapter stay as they
        were); `writes_record`: this rank writes STOPPED_FILE, which keeps it stopped on resume."""
        reason = redact(reason)  # an error's message may quote a secret of the config (archon.secrets)
        self.stopped = reason
        if writes_record:
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(self.dir / STOPPED_FILE, {"step": step, "reason": reason})
        if self.producer is not None:
            self.producer.stop()

    def data_sources(self) -> list[str]:
        """The data_source of every training row (their metrics are logged by source)."""
        return sorted({example.data_source for example in self.train_set.examples})

    @staticmethod
    def _report(reports: bool, name: str, dataset) -> None:
        if reports:
            print(f"{name} data: {len(dataset)} prompts, {dataset.schema} rows ({dataset.schema_reason})", flush=True)
        if (dataset.malformed or dataset.too_long) and reports:
            logger.warning("%s data: %s", name, dataset.report())

    def state(self) -> dict:
        """What a checkpoint keeps of the task besides its adapter and optimizer."""
        return {
            "iterator": self.trained_iterator_state or self.iterator.state_dict(),
            "version": self.version,
            "skipped_steps": self.skipped_steps,
            "skipped_streak": self.skipped_streak,
            "reward_failure_streak": self.reward_failure_streak,
        }

    def load_state(self, data: dict, step: int) -> None:
        """The task as checkpointed at RL step `step` (checkpoints of older releases have no version:
        a run without tasks trained its adapter on every step)."""
        self.iterator.load_state_dict(data["iterator"])
        self.version = data.get("version", step)
        self.skipped_steps = data.get("skipped_steps", 0)
        self.skipped_streak = data.get("skipped_streak", [])
        self.reward_failure_streak = data.get("reward_failure_streak", [])
        self.resumed_fidelity = data.get("fidelity")

    def record_step(self, step: int, outcome: TaskStep, metrics: dict[str, float]) -> Exception | None:
        """Count RL step `step` (`outcome`: the task's step; `metrics`: the run's, this task's under
        its prefix) into the task's streaks and its `skipped_steps` metric; returns the error that
        stops the task when it is past algorithm.max_skipped_steps RL steps in a row with a skipped
        update, or reward.max_failed_steps steps in a row on which its reward function failed on
        every sample (the same on every rank: the counts are global), else None."""
        skipped = outcome.skipped_updates > 0
        self.skipped_steps += int(skipped)
        metrics[self.prefix + "skipped_steps"] = self.skipped_steps
        self.skipped_streak = self.skipped_streak + [step] if skipped else []
        failed = outcome.prepared.reward_counts.every_failed
        self.reward_failure_streak = self.reward_failure_streak + [step] if failed else []
        return self._failure(step, outcome, metrics)

    def _failure(self, step: int, outcome: TaskStep, metrics: dict[str, float]) -> Exception | None:
        """The error that stops the task at RL step `step`, if it is past a limit."""
        p, where = self.prefix, f"task {self.name!r}: " if self.name else ""
        extremes = outcome.prepared.extremes
        limit = self.config.algorithm.max_skipped_steps
        if len(self.skipped_streak) >= limit:
            return NonFiniteError(
                f"RL step {step}: {where}the loss or gradient norm was NaN or inf on {len(self.skipped_streak)} RL "
                f"steps in a row (steps {self.skipped_streak[0]}-{step}, algorithm.max_skipped_steps={limit}); those "
                "updates were skipped and left the adapter and optimizer unchanged. Last step: "
                f"loss {metrics.get(p + 'loss')}, grad_norm {metrics.get(p + 'grad_norm')}, "
                f"lr {metrics.get(p + 'lr')}, "
                f"largest |reward| {extremes.get('reward_abs_max')}, largest |advantage| "
                f"{extremes.get('advantage_abs_max')}. Likely causes: rewards so large that the loss overflows "
                "(rescale the reward function), or a learning rate too high (lower optim.lr)."
            )
        limit = self.config.reward.max_failed_steps
        if len(self.reward_failure_streak) >= limit:
            cause = outcome.reward_traceback or "(every sample timed out, or failed on another rank)"
            return RewardFunctionError(
                f"RL step {step}: {where}{self.config.reward.describe()} failed on every sample "
                f"for {len(self.reward_failure_streak)} steps in a row (steps {self.reward_failure_streak[0]}-{step}, "
                f"reward.max_failed_steps={limit}). First failure of step {step}:\n{cause}"
            )
        return None

    def close(self) -> None:
        """Stop the task's producer (the run joins it once the servers are closed, which ends a
        generation under way), reward workers and sync."""
        if self.producer is not None:
            self.producer.stop()
        if self.scorer is not None:
            self.scorer.close()
        if self.tool_runner is not None:  # an environment's episodes (an agent function's have no tools)
            self.tool_runner.close()
            self.episodes.close()
        if self.sync is not None:
            self.sync.close()


def resume_named_tasks(tasks: list[Task], trainer, tasks_dir: Path, steps: int, step: int | None = None) -> int:
    """Load each named task's newest checkpoint (or, with `step`, its checkpoint of that step) into
    its adapter and state (tasks without one, added since, start fresh; a stopped task stays
    stopped); returns the RL step to go on from, the newest step any task was saved at."""
    resumed = {}
    for task in tasks:
        stopped = task.dir / STOPPED_FILE
        if stopped.exists():
            record = read_stopped_record(stopped)
            task.stopped = record["reason"]
            logger.warning(
                "task %r stays stopped (since RL step %s; delete %s to train it again): %s",
                task.name,
                record["step"],
                stopped,
                task.stopped,
            )
        latest = task.checkpoints.latest()
        if latest is None:
            continue
        state = trainer.load_checkpoint(task.checkpoints, latest, task=task.name)
        task.load_state(state["data"], state["step"])
        resumed[task.name] = state["step"]
    if not resumed:
        raise ValueError(
            f"--resume: none of the tasks {[task.name for task in tasks]} has a checkpoint in "
            f"{tasks_dir}/<name>/checkpoints"
        )
    first = max(resumed.values())
    if first > steps:
        raise ValueError(f"--resume: the checkpoints are at step {first}, beyond steps={steps}")
    stopped = {task.name for task in tasks if task.stopped is not None}
    behind = {name: at for name, at in resumed.items() if at < first and name not in stopped}
    if behind:
        logger.warning(
            "tasks %s were last saved before step %d (the run ended while saving): each goes on from its "
            "own checkpoint, without the steps in between",
            behind,
            first,
        )
    added = [task.name for task in tasks if task.name not in resumed]
    logger.warning("resumed tasks %s at step %d; new tasks %s start from a fresh adapter", resumed, first, added)
    return first
