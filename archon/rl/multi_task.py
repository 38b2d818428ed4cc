"""Multi-LoRA RL: several tasks, each with its own adapter, trained at once on one frozen base.

`MultiTaskRun` runs GRPOConfig.tasks. Each RL step: every active task draws its prompts and rolls
out with its own adapter -> each task's reward scores its samples -> each task's algorithm turns
them into advantages and filters groups -> the tasks' samples are packed into ONE mixed batch
(`extras["task"]`), scored once for the proximal (and reference) log-probs, and trained in
minibatches that each step every task's own optimizer (Trainer.train_step_tasks) -> each task's
new adapter version is published -> metrics are logged with each task's name as prefix.

Isolation: a task whose reward function fails on every sample for reward.max_failed_steps steps in
a row, or whose update is non-finite for algorithm.max_skipped_steps steps in a row, is stopped
alone (its last checkpoint and adapter stay as they were); the others go on. Each task checkpoints
into RUN_DIR/tasks/<name>/checkpoints and exports its PEFT adapter to RUN_DIR/tasks/<name>/adapter,
so a resumed run may add tasks (they start from a fresh adapter) or drop tasks (their outputs are
left alone), and every kept task continues exactly where it was.
"""

from __future__ import annotations

import copy
import json
import logging
import time
import zlib
from pathlib import Path

import torch

from archon.batch import PER_TOKEN_FIELDS, PackedBatch
from archon.checkpoint.atomic import atomic_write_json
from archon.checkpoint.hf import check_model_dir, load_tokenizer
from archon.checkpoint.resume import CheckpointManager
from archon.lora import task_view
from archon.rl.algorithms import get_algorithm
from archon.rl.config import RLConfig as GRPOConfig
from archon.rl.config import TaskConfig, validate
from archon.rl.data import PromptBatchIterator, load_prompt_dataset
from archon.rl.loop import (
    RewardFunctionError,
    load_teacher,
    prompt_ids,
    prune_adapter_exports,
    replace_stale_groups,
    rollout_batch,
    stop_token_ids,
    teacher_logprobs,
    update_summary,
)
from archon.rl.metrics import MetricsLogger
from archon.rl.producer import RolloutProducer, Rollouts
from archon.rl.rewards import RewardScorer
from archon.rl.run_dir import TASKS_DIR, PreparedRunDir, prepare_run_dir
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.policy import ServedPolicy
from archon.sync.weight_sync import build_weight_sync
from archon.trainer import TASK_EXTRA, NonFiniteError, Trainer, TrainerConfig, TrainerTask

logger = logging.getLogger("archon.rl")
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


def concat_batches(batches: list[PackedBatch]) -> PackedBatch:
    """The sequences of `batches` in one packed batch, in order (extras kept where all have them)."""
    values = {}
    for name in PER_TOKEN_FIELDS:
        parts = [getattr(b, name) for b in batches]
        values[name] = None if any(p is None for p in parts) else torch.cat(parts)
    offsets = torch.tensor([0, *[b.num_tokens for b in batches]]).cumsum(0)
    cu_seqlens = torch.cat([offsets[:1]] + [b.cu_seqlens[1:] + offsets[i] for i, b in enumerate(batches)])
    keys = set.intersection(*(set(b.extras) for b in batches))
    extras = {key: torch.cat([b.extras[key] for b in batches]) for key in sorted(keys)}
    return PackedBatch(cu_seqlens=cu_seqlens, extras=extras, **values)


def task_servers(servers):
    """A task's handle on the shared vLLM servers (a VLLMRolloutEngine): the same servers and
    session, with a policy of its own, so that its requests name its own adapter version."""
    view = copy.copy(servers)
    view.policy = ServedPolicy()
    return view


class TaskRun:
    """One task of the run: its data, reward, algorithm, teacher, rollout policy, outputs and state."""

    def __init__(self, run: MultiTaskRun, index: int, config: TaskConfig) -> None:
        self.name, self.index, self.config = config.name, index, config
        self.seed_offset = zlib.crc32(self.name.encode()) % 100_003
        """Sampling seeds follow the task's name, not its place in the list, so adding or removing
        another task leaves this one's rollouts as they were."""
        shared = run.config
        self.algorithm = get_algorithm(config.algorithm, shared.rollout.max_new_tokens, config.max_staleness)
        context = run.trainer.loaded.hf_config.max_position_embeddings
        self.train_set = load_prompt_dataset(config.data, run.tokenizer, context, shared.rollout.max_new_tokens)
        self.iterator = PromptBatchIterator(
            self.train_set.examples, batch_size=shared.rollout.prompts_per_step, seed=config.data.seed,
            shuffle=config.data.shuffle, drop_last=config.data.drop_last,
        )  # fmt: skip
        self.eval_set = None
        if config.eval_path and shared.eval.every:
            from dataclasses import replace

            self.eval_set = load_prompt_dataset(replace(config.data, path=config.eval_path), run.tokenizer, context,
                                                run.eval_new_tokens)  # fmt: skip
        self.teacher = None
        if self.algorithm.needs_teacher:
            self.teacher = run.teacher(config.algorithm.teacher_path, f"tasks[{index}].algorithm.teacher_path")
        self.dir = run.run_dir / TASKS_DIR / self.name
        self.checkpoints = CheckpointManager(self.dir / "checkpoints", keep_last=shared.checkpoint.keep_last)
        self.scorer = RewardScorer(config.reward)
        self.rollout = self.sync = None
        self.producer: RolloutProducer | None = None
        """Makes the task's rollouts ahead (max_staleness >= 1)."""
        self.version = 0
        """This task's adapter version: the RL steps it has trained."""
        self.stopped: str | None = None
        """Why the task was stopped (None while it trains)."""
        self.skipped_streak: list[int] = []
        self.reward_failure_streak: list[int] = []
        self.skipped_steps = 0
        self.trained_iterator_state: dict | None = None

    def connect(self, run: MultiTaskRun) -> None:
        """The task's rollout engine and weight sync (once the run's servers, if any, are up)."""
        shared = run.config
        if run.servers is None:
            # the built-in engine runs on the training model, seen as this task's single-adapter model
            self.rollout = NativeRolloutEngine(run.trainer.model, run.device,
                                               max_batch_sequences=shared.rollout.max_batch_sequences)  # fmt: skip
        else:
            self.rollout = task_servers(run.servers)
        self.sync = build_weight_sync(
            shared.rollout, self.rollout, lora=self.config.lora, sync_dir=run.run_dir / "vllm_adapters", task=self.name,
            channel=run.channel,
        )  # fmt: skip

    def state(self) -> dict:
        return {
            "iterator": self.trained_iterator_state or self.iterator.state_dict(), "version": self.version,
            "skipped_steps": self.skipped_steps, "skipped_streak": self.skipped_streak,
            "reward_failure_streak": self.reward_failure_streak,
        }  # fmt: skip

    def load_state(self, data: dict) -> None:
        self.iterator.load_state_dict(data["iterator"])
        self.version = data["version"]
        self.skipped_steps = data["skipped_steps"]
        self.skipped_streak = data["skipped_streak"]
        self.reward_failure_streak = data["reward_failure_streak"]

    def close(self) -> None:
        """Stop the task's producer (the run joins it once the servers are closed, which ends a
        generation under way), reward workers and sync."""
        if self.producer is not None:
            self.producer.stop()
        self.scorer.close()
        if self.sync is not None:
            self.sync.close()
        if isinstance(self.rollout, NativeRolloutEngine):  # the servers are the run's
            self.rollout.close()


class MultiTaskRun:
    def __init__(self, config: GRPOConfig, run_dir: PreparedRunDir | None = None) -> None:
        """`run_dir`: what `prepare_run_dir` returned, when the caller has checked (and holds) the
        run directory already and releases it after the run; by default the check is made here and
        `close` releases the directory."""
        validate(config)
        if not config.tasks:
            raise ValueError("MultiTaskRun needs GRPOConfig.tasks; a run without tasks is archon.rl.loop.RLRun")
        self.config = config
        check_model_dir(config.model.path, "model.path")
        self.run_dir = Path(config.logging.run_dir)
        self.owns_run_dir = run_dir is None
        if run_dir is None:
            run_dir = prepare_run_dir(self.run_dir, config.resume, config.overwrite,
                                      tasks=[task.name for task in config.tasks])  # fmt: skip
        self.prepared_run_dir = run_dir
        try:
            self._build()
        except BaseException:
            self._release_run_dir()
            raise

    def _build(self) -> None:
        """The trainer (one adapter per task), the tasks, and the rollout engines."""
        config = self.config
        self.trainer = Trainer(
            TrainerConfig(
                model_path=config.model.path, lora=None, parallel=config.parallel, dtype=config.model.dtype,
                device=config.model.device, micro_batch_tokens=config.micro_batch_tokens, seed=config.seed,
                moe=config.model.moe,
                tasks=tuple(TrainerTask(t.name, t.lora, t.optim.for_run(config.steps)) for t in config.tasks),
            )
        )  # fmt: skip
        self.device = self.trainer.device
        self.eval_new_tokens = config.eval.max_new_tokens or config.rollout.max_new_tokens
        self.tokenizer = load_tokenizer(config.model.tokenizer or config.model.path,
                                        "model.tokenizer" if config.model.tokenizer else "model.path")  # fmt: skip
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.trainer.loaded.hf_config)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=config.logging.tensorboard)
        self.tasks: dict[str, TaskRun] = {}
        self.teachers: dict[str, torch.nn.Module] = {}
        """The frozen teachers by path: tasks that name the same teacher share one copy."""
        self.servers = self.channel = self.native = None
        """With rollout.engine=vllm: the servers, which serve every task's adapter side by side, and
        the collective transport's channel, shared by the tasks' syncs. With the built-in engine:
        `native`, which generates all tasks' training rollouts in one mixed batch."""
        try:
            for index, task in enumerate(config.tasks):
                self.tasks[task.name] = TaskRun(self, index, task)
            if config.rollout.engine == "vllm":
                self._launch_servers()
            else:  # generates every task's prompts in one batch (each task's own engine evaluates)
                self.native = NativeRolloutEngine(self.trainer.model, self.device,
                                                  max_batch_sequences=config.rollout.max_batch_sequences)  # fmt: skip
            for task in self.tasks.values():
                task.connect(self)
        except BaseException:
            self.close()
            raise

    def _launch_servers(self) -> None:
        from archon.rollout.vllm import VLLMRolloutEngine
        from archon.sync.vllm import WorkerChannel

        cfg = self.config
        lora_rank = max(task.lora.max_rank for task in cfg.tasks)
        # sized for the longest request of any task: training prompt + rollout tokens, or held-out
        # prompt + evaluation tokens
        requests = []
        for task in self.tasks.values():
            requests.append((max(map(len, self._prompt_ids(task, task.train_set.examples)), default=0),
                             cfg.rollout.max_new_tokens))  # fmt: skip
            if task.eval_set is not None:
                held_out = task.eval_set.examples[: cfg.eval.max_prompts]
                requests.append((max(map(len, self._prompt_ids(task, held_out)), default=0), self.eval_new_tokens))
        longest_prompt, max_new_tokens = max(requests, key=sum)
        self.servers = VLLMRolloutEngine(
            cfg.rollout.vllm, model_path=cfg.model.path, lora_rank=lora_rank, log_dir=self.run_dir,
            longest_prompt_tokens=longest_prompt, max_new_tokens=max_new_tokens,
        )  # fmt: skip
        if cfg.rollout.vllm.transport == "collective":
            vllm = cfg.rollout.vllm
            self.channel = WorkerChannel(self.servers.servers, vllm.sync_host, vllm.sync_port, vllm.bucket_mb)

    # ---- helpers ------------------------------------------------------------------------------
    def teacher(self, path: str, option: str) -> torch.nn.Module:
        """The frozen teacher model at `path` (`option` names the setting, for errors), built once."""
        key = str(Path(path).resolve())
        if key not in self.teachers:
            self.teachers[key] = load_teacher(path, option, self.trainer.loaded, self.tokenizer, self.device)
        return self.teachers[key]

    def _prompt_ids(self, task: TaskRun, examples) -> list[list[int]]:
        return prompt_ids(self.tokenizer, examples, task.config.data.apply_chat_template)

    def _generate(self, task: TaskRun, examples, sampling: SamplingParams) -> list[Sample]:
        if isinstance(task.rollout, NativeRolloutEngine):
            with task_view(self.trainer.model, task.name):
                return task.rollout.generate(self._prompt_ids(task, examples), sampling)
        # vLLM applies the adapter; this may run on the task's producer thread, so no model view
        return task.rollout.generate(self._prompt_ids(task, examples), sampling)

    def _sampling(self, task: TaskRun | None, task_step: int) -> SamplingParams:
        """Training sampling for `task`'s step `task_step` (its seed follows the task's name), or
        with task None for a mixed generation at RL step `task_step`."""
        cfg = self.config
        return SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k, n=cfg.rollout.group_size, stop_token_ids=self.stop_token_ids,
            seed=cfg.seed * 1_000_003 + task_step * 1009 + (0 if task is None else task.seed_offset),
        )  # fmt: skip

    def _generate_rollouts(self, task: TaskRun, task_step: int) -> Rollouts:
        """The task's next prompts and their samples, from its adapter version in service now
        (`task_step`: the task's own step count, which its versions follow)."""
        start = time.perf_counter()
        examples = next(task.iterator)
        iterator_state = task.iterator.state_dict()
        samples = self._generate(task, examples, self._sampling(task, task_step))
        return Rollouts(task_step, examples, samples, iterator_state, generate_s=time.perf_counter() - start)

    def _collect_all(self, step: int) -> dict[str, Rollouts]:
        """Every active task's rollouts for RL step `step`. The built-in engine generates all tasks'
        prompts in one mixed batch, each sequence with its task's adapter; on vLLM each task's
        requests go out on their own (or come from its producer)."""
        if self.servers is not None:
            return {task.name: self._collect(task) for task in self.active()}
        start = time.perf_counter()
        drawn = {task.name: next(task.iterator) for task in self.active()}
        prompts, adapters = [], []
        for task in self.active():
            ids = self._prompt_ids(task, drawn[task.name])
            prompts += ids
            adapters += [task.index] * len(ids)
        # each task samples from its own generators, seeded from its name: its samples depend on its
        # prompts and the step, not on the other tasks or its place among them
        sampling = self._sampling(None, step)
        seeds = {task.index: self._sampling(task, step).seed for task in self.active()}
        samples = self.native.generate(prompts, sampling, adapters=adapters, adapter_seeds=seeds) if prompts else []
        generate_s = time.perf_counter() - start
        collected, first = {}, 0
        for task in self.active():
            count = len(drawn[task.name])
            mine = [s for s in samples if first <= s.prompt_index < first + count]
            for sample in mine:
                sample.prompt_index -= first
                # the engine's policy is not the task's: in-process, the task's version is in service
                sample.version, sample.token_versions = task.version, [task.version] * len(sample.completion_ids)
            collected[task.name] = Rollouts(task.version, drawn[task.name], mine, task.iterator.state_dict(),
                                            generate_s=generate_s)  # fmt: skip
            first += count
        return collected

    def _collect(self, task: TaskRun) -> Rollouts:
        """The rollouts of the task's next step: made now, or (tasks[i].max_staleness N >= 1) by its
        producer ahead of time, with any group sampled by a version older than the task's version
        - N dropped and sampled again."""
        if task.producer is None:
            return self._generate_rollouts(task, task.version)
        rollouts = task.producer.take(task.version)
        replace_stale_groups(
            rollouts, self.config.rollout.group_size, task.version, task.config.max_staleness,
            lambda examples: self._generate(task, examples, self._sampling(task, task.version)),
        )  # fmt: skip
        return rollouts

    def _start_producers(self, first: int) -> None:
        """A background producer for each task with max_staleness >= 1 (vLLM rollouts): it makes
        the task's later steps while the current one trains, at most max_staleness ahead."""
        remaining = self.config.steps - first
        for task in self.active():
            if task.config.max_staleness > 0:
                task.producer = RolloutProducer(
                    lambda task_step, task=task: self._generate_rollouts(task, task_step), task.version,
                    task.version + remaining, task.config.max_staleness, version=task.version,
                )  # fmt: skip

    def _score(self, task: TaskRun, examples, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        completions = self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
        return task.scorer.score(
            [examples[s.prompt_index].prompt for s in samples], completions,
            [examples[s.prompt_index].reference for s in samples],
        )  # fmt: skip

    def active(self) -> list[TaskRun]:
        return [task for task in self.tasks.values() if task.stopped is None]

    # ---- one step -----------------------------------------------------------------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step `step` (0-based) of every active task, trained in one mixed batch."""
        start = time.perf_counter()
        cfg = self.config
        G = cfg.rollout.group_size
        metrics: dict[str, float] = {}
        batches: list[PackedBatch] = []
        trained: list[TaskRun] = []
        collected = self._collect_all(step)
        for task in self.active():
            prefix = f"{task.name}/"
            rollouts = collected[task.name]
            task.trained_iterator_state = rollouts.iterator_state
            examples, samples = rollouts.examples, rollouts.samples
            metrics[prefix + "stale_samples_dropped"] = float(rollouts.stale_dropped)
            rewards, reward_metrics = self._score(task, examples, samples)
            failed = reward_metrics["reward_errors"] + reward_metrics["reward_timeouts"] >= len(samples)
            task.reward_failure_streak = task.reward_failure_streak + [step + 1] if failed else []
            lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
            metrics.update({
                prefix + "reward_mean": float(rewards.mean()),
                prefix + "accuracy": float((rewards >= 1.0).float().mean()),
                prefix + "response_length": float(lengths.mean()),
                prefix + "reward_errors": reward_metrics["reward_errors"],
                prefix + "reward_timeouts": reward_metrics["reward_timeouts"],
            })  # fmt: skip
            if failed:  # nothing to learn from: no update for this task this step
                continue
            shaped = task.algorithm.prepare(rewards, lengths, G, batch_sum=lambda totals: totals.double())
            kept = [s for s, k in zip(samples, shaped.keep.tolist()) if k]
            metrics[prefix + "groups_kept"] = float(shaped.keep.sum()) / G
            if not kept:
                continue
            batch = rollout_batch(kept, shaped.advantages[shaped.keep], trainer_version=task.version)
            batch.extras[TASK_EXTRA] = torch.full((batch.num_tokens,), task.index, dtype=torch.long)
            metrics[prefix + "version_lag_max"] = float(batch.extras["version_lag"][batch.loss_mask].max())
            batches.append(batch)
            trained.append(task)
        train_s = 0.0
        if batches:
            batch = self._prepare(concat_batches(batches), trained)
            train_start = time.perf_counter()
            updates = self._train(batch, trained)
            train_s = time.perf_counter() - train_start
            for task in trained:
                metrics.update({f"{task.name}/{k}": v for k, v in updates[task.name].items()})
                skipped = updates[task.name]["skipped_updates"] > 0
                task.skipped_steps += int(skipped)
                task.skipped_streak = task.skipped_streak + [step + 1] if skipped else []
            metrics["tokens_per_s"] = batch.num_tokens / max(time.perf_counter() - start, 1e-9)
        for task in self.active():
            task.version += 1  # a step of the task, whether or not it had anything to train on
            sent = self._publish(task)
            if task.producer is not None:
                task.producer.published(task.version)
            metrics.update({f"{task.name}/sync_{k}": v for k, v in sent.items() if k.endswith("_bytes")})
            metrics[f"{task.name}/adapter_version"] = float(task.version)
        metrics.update(train_s=train_s, step_s=time.perf_counter() - start, active_tasks=float(len(self.active())))
        return metrics

    def _publish(self, task: TaskRun) -> dict[str, float]:
        """Serve `task`'s adapter at its current version (under its own name on vLLM)."""
        with task_view(self.trainer.model, task.name):
            return task.sync.publish(self.trainer.model, self.trainer.converter, task.config.lora, task.version)

    def _prepare(self, batch: PackedBatch, tasks: list[TaskRun]) -> PackedBatch:
        """Proximal (and, where a task needs it, reference) log-probs of the mixed batch in one
        forward each; a task's teacher turns its advantages into per-token ones."""
        temperature = self.config.rollout.temperature
        batch.old_logprobs = self.trainer.logprobs(batch, temperature).logprobs
        if any(t.config.algorithm.recompute_old_logprobs is False for t in tasks):
            sequence_task = batch.extras[TASK_EXTRA]
            for task in tasks:
                if not task.config.algorithm.recompute_old_logprobs:
                    mine = sequence_task == task.index
                    batch.old_logprobs[mine] = batch.rollout_logprobs[mine]
        if any(t.algorithm.needs_reference for t in tasks):
            batch.ref_logprobs = self.trainer.logprobs(batch, temperature, use_adapter=False).logprobs
        sequences_by_task = self.trainer.task_sequences(batch)
        for task in tasks:
            if task.teacher is None:
                continue
            mine = batch.extras[TASK_EXTRA] == task.index
            sub = batch.select(sequences_by_task[task.name])
            batch.advantages[mine] = task.algorithm.token_advantages(
                sub.advantages, sub.old_logprobs, teacher_logprobs(task.teacher, sub, self.device, temperature),
                sub.loss_mask,
            )
        return batch

    def _train(self, batch: PackedBatch, tasks: list[TaskRun]) -> dict[str, dict[str, float]]:
        """ppo_epochs x minibatches updates (the same for every task); minibatch m holds the m-th
        share of every task's sequences, and each update steps each task's own optimizer."""
        algo = tasks[0].config.algorithm
        by_task = self.trainer.task_sequences(batch)
        loss_fns = {task.name: task.algorithm.loss for task in tasks}
        updates: dict[str, list[dict[str, float]]] = {task.name: [] for task in tasks}
        for _ in range(algo.ppo_epochs):
            for m in range(algo.minibatches):
                chosen = []
                for sequences in by_task.values():
                    per = -(-len(sequences) // algo.minibatches)
                    chosen += sequences[m * per : (m + 1) * per] or sequences[-1:]
                out = self.trainer.train_step_tasks(
                    batch.select(chosen), loss_fns, self.config.rollout.temperature, with_entropy=True,
                    advance_schedule=False,
                )  # fmt: skip
                for name, metrics in out.items():
                    updates[name].append(metrics)
        summary = {}
        for task in tasks:
            self.trainer.advance_schedule(task.name)
            done = updates[task.name]
            summary[task.name] = {
                **update_summary(done), "skipped_updates": sum(u["skipped"] for u in done),
                "skipped_steps": float(task.skipped_steps + int(any(u["skipped"] for u in done))),
            }  # fmt: skip
        return summary

    def _stop_failed_tasks(self, step: int, metrics: dict[str, float]) -> None:
        """Stop (alone) each task past its limit of failed-reward or skipped steps in a row."""
        for task in self.active():
            reward_limit = task.config.reward.max_failed_steps
            skip_limit = task.config.algorithm.max_skipped_steps
            if len(task.reward_failure_streak) >= reward_limit:
                error = RewardFunctionError(
                    f"RL step {step}: task {task.name!r}: the reward function {task.config.reward.function!r} failed "
                    f"on every sample for {len(task.reward_failure_streak)} steps in a row (reward.max_failed_steps="
                    f"{reward_limit}). First failure:\n{task.scorer.last_traceback}"
                )
            elif len(task.skipped_streak) >= skip_limit:
                error = NonFiniteError(
                    f"RL step {step}: task {task.name!r}: the loss or gradient norm was NaN or inf on "
                    f"{len(task.skipped_streak)} RL steps in a row (algorithm.max_skipped_steps={skip_limit})"
                )
            else:
                continue
            task.stopped = str(error)
            task.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_json(task.dir / STOPPED_FILE, {"step": step, "reason": task.stopped})
            if task.producer is not None:
                task.producer.stop()
            logger.error("stopping task %r; the other tasks go on: %s", task.name, error)
            metrics[f"{task.name}/stopped"] = 1.0

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, task: TaskRun) -> float:
        examples = task.eval_set.examples[: self.config.eval.max_prompts]
        sampling = SamplingParams(
            max_new_tokens=self.eval_new_tokens, temperature=0, stop_token_ids=self.stop_token_ids
        )
        samples = self._generate(task, examples, sampling)
        rewards, _ = self._score(task, examples, samples)
        return float((rewards >= 1.0).float().mean()) if len(samples) else 0.0

    def _evaluate_all(self, step: int, metrics: dict[str, float]) -> None:
        for task in self.active():
            if task.eval_set is not None:
                metrics[f"{task.name}/eval_accuracy"] = self.evaluate(task)

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        try:
            return self._train_steps(self._resume() if self.config.resume else 0)
        finally:
            self.close()

    def _resume(self) -> int:
        """Load each task's latest checkpoint; tasks without one (added now) start fresh. Returns
        the RL step to go on from: the newest step any task was saved at."""
        resumed = {}
        for task in self.tasks.values():
            stopped = task.dir / STOPPED_FILE
            if stopped.exists():
                record = read_stopped_record(stopped)
                task.stopped = record["reason"]
                logger.warning(
                    "task %r stays stopped (since RL step %s; delete %s to train it again): %s",
                    task.name, record["step"], stopped, task.stopped,
                )
            latest = task.checkpoints.latest()
            if latest is None:
                continue
            state = self.trainer.load_checkpoint(task.checkpoints, latest, task=task.name)
            task.load_state(state["data"])
            resumed[task.name] = state["step"]
        if not resumed:
            raise ValueError(
                f"--resume: none of the tasks {list(self.tasks)} has a checkpoint in "
                f"{self.run_dir / TASKS_DIR}/<name>/checkpoints"
            )
        first = max(resumed.values())
        if first > self.config.steps:
            raise ValueError(f"--resume: the checkpoints are at step {first}, beyond steps={self.config.steps}")
        behind = {name: at for name, at in resumed.items() if at < first and self.tasks[name].stopped is None}
        if behind:
            logger.warning(
                "tasks %s were last saved before step %d (the run ended while saving): each goes on from its "
                "own checkpoint, without the steps in between", behind, first,
            )
        added = [name for name in self.tasks if name not in resumed]
        logger.warning("resumed tasks %s at step %d; new tasks %s start from a fresh adapter", resumed, first, added)
        self.metrics.drop_after(first)
        for task in self.tasks.values():
            self._publish(task)
        return first

    def _train_steps(self, first: int) -> dict[str, float]:
        cfg = self.config
        last: dict[str, float] = {}
        eval_every = cfg.eval.every
        if eval_every and first == 0:
            self._evaluate_all(0, last)
            self.metrics.log(0, dict(last))
        self._start_producers(first)
        for step in range(first, cfg.steps):
            metrics = self.step(step)
            done = step + 1
            if eval_every and (done % eval_every == 0 or done == cfg.steps):
                self._evaluate_all(done, metrics)
            self._stop_failed_tasks(done, metrics)
            self.metrics.log(done, metrics)
            last.update(metrics)
            if not self.active():
                reasons = "\n".join(f"{t.name}: {t.stopped}" for t in self.tasks.values())
                raise RuntimeError(f"RL step {done}: every task has stopped:\n{reasons}")
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
                self.save(done)
        self.save(cfg.steps, final=True)
        return last

    def save(self, step: int, final: bool = False) -> None:
        """Each active task's checkpoint and PEFT adapter (TASK_DIR/adapter at the end,
        TASK_DIR/adapters/step_NNNNNN before); a stopped task keeps its last ones."""
        for task in self.active():
            self.trainer.save_checkpoint(task.checkpoints, step, task.state(), task=task.name)
            out = task.dir / ("adapter" if final else f"adapters/step_{step:06d}")
            self.trainer.export_peft(out, base_model_name_or_path=self.config.model.path, task=task.name)
            if not final:
                prune_adapter_exports(task.dir / "adapters", self.config.checkpoint.keep_last_adapters)

    def close(self) -> None:
        """Close the metrics file, the tasks' engines and workers and the servers, and release the run
        directory if this run checked it."""
        try:
            self.metrics.close()
            if self.native is not None:
                self.native.close()
            for task in self.tasks.values():
                task.close()
            if self.channel is not None:
                self.channel.close()
            if self.servers is not None:
                self.servers.close()
            for task in self.tasks.values():
                if task.producer is not None:
                    task.producer.join()
        finally:
            self._release_run_dir()

    def _release_run_dir(self) -> None:
        if self.owns_run_dir:
            self.prepared_run_dir.release()
