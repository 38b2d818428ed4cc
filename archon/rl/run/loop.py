"""The RL loop. A run trains one or several tasks (archon.rl.run.task), each an adapter on the one
frozen base with its own data, reward and algorithm; a run without `tasks` is one unnamed task.
Each RL step runs named phases over every active task: collect (the step's rollouts, .collect) ->
score (rewards, .score) -> prepare (advantages, filters, one packed batch of every task's samples,
the log-probs the losses need; .prepare) -> update (PPO epochs x minibatches, each stepping every
task's optimizer) -> publish (each weight sync serves its task's new adapter version; both in
.update) -> log (.step_metrics); then evaluation (.evaluate) and checkpoints (.checkpoints). The
phases are functions of the run's context (.context.RunContext, built once) and fill in one record
per task and step (.step_metrics.TaskStep); RLRun keeps their order, the run's progress (which
tasks go on) and the lifetime of what the run starts. With max_staleness >= 1 a task's producer
thread makes the rollouts of its later steps while the current one trains (.producer).

Every rank runs this; data-parallel ranks take their own share of each step's prompts of every
task, and the metrics are reduced over them before rank 0 logs. With vLLM rollouts, the first rank
of each tensor-parallel group generates and sends the rollouts to its peers.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from tqdm import tqdm

from archon.batch import PackedBatch
from archon.build import resolve_mtp
from archon.checkpoint.hf import check_model_dir, load_tokenizer
from archon.distributed import is_first_rank
from archon.load_balance import routers
from archon.parallel import init_distributed
from archon.rl.config import RLConfig, TaskConfig, validate
from archon.rl.metrics import MetricsLogger
from archon.rl.run.checkpoints import load_checkpoints
from archon.rl.run.checkpoints import save as save_checkpoints
from archon.rl.run.collect import collect as collect_phase
from archon.rl.run.collect import generate_rollouts as generate_task_rollouts
from archon.rl.run.collect import own_rollouts, start_producers
from archon.rl.run.context import RunContext, eval_new_tokens, prompt_ids
from archon.rl.run.engines import native_engine, rollout_servers, speculative_acceptance, stop_token_ids, task_servers
from archon.rl.run.evaluate import evaluate
from archon.rl.run.fidelity import fidelity_guards
from archon.rl.run.launcher_watch import watch_launcher
from archon.rl.run.prepare import prepare as prepare_phase
from archon.rl.run.producer import Rollouts
from archon.rl.run.run_dir import TASKS_DIR, PreparedRunDir, prepare_run_dir
from archon.rl.run.score import score, table_rows
from archon.rl.run.step_metrics import Prepared, Scores, TaskStep, step_metrics
from archon.rl.run.task import Task
from archon.rl.run.teachers import load_teacher
from archon.rl.run.update import publish as publish_phase
from archon.rl.run.update import update
from archon.rl.trackers import close_trackers, open_trackers, remove_tracker_outputs, tracker_outputs
from archon.sync.vllm import WorkerChannel
from archon.trainer import Trainer, TrainerConfig, TrainerTask

logger = logging.getLogger("archon.rl")


def _trainer(config: RLConfig, task_configs: tuple[TaskConfig, ...]) -> Trainer:
    """The run's trainer: the base model with every task's adapter and optimizer."""
    trains_mtp = any(task.algorithm.mtp_loss_weight > 0 for task in task_configs)
    return Trainer(
        TrainerConfig(
            model_path=config.model.path,
            lora=None if config.tasks else config.lora,
            parallel=config.parallel,
            optim=config.optim.for_run(config.steps),  # schedules count RL steps and last the run unless set
            dtype=config.model.dtype,
            quantized_base=config.model.quantized_base,
            device=config.model.device,
            micro_batch_tokens=config.micro_batch_tokens,
            seed=config.seed,
            moe=config.model.moe,
            tasks=tuple(TrainerTask(t.name, t.lora, t.optim.for_run(config.steps)) for t in config.tasks),
            mtp=resolve_mtp(
                config.model.path, config.model.mtp, used=trains_mtp or config.rollout.speculative.method == "mtp"
            ),
            mtp_loss_weight=0.0 if config.tasks else config.algorithm.mtp_loss_weight,
        )
    )


class RLRun:
    def __init__(self, config: RLConfig, run_dir: PreparedRunDir | None = None) -> None:
        """`run_dir`: what `prepare_run_dir` returned, when the caller has checked (and holds) the
        run directory already and releases it after the run (the recipe does, before it prepares
        the demo model); by default the check is made here, before anything is built, and `close`
        releases the directory."""
        validate(config)
        watch_launcher()  # under torchrun: this rank stops when its launcher is gone
        self.config = config
        check_model_dir(config.model.path, "model.path")
        self.owns_run_dir = run_dir is None
        if run_dir is None:
            init_distributed(config.model.device)  # under torchrun, rank 0 alone takes the directory's lock
            run_dir = prepare_run_dir(
                config.logging.run_dir,
                config.resume,
                config.overwrite,
                config.lora,
                tasks=[task.name for task in config.tasks],
            )
        self.prepared_run_dir = run_dir
        self.resume_from = run_dir.resume_from
        self.tasks: list[Task] = []
        self.teachers: dict[str, torch.nn.Module] = {}
        """The frozen teachers by path: tasks and data sources that name the same teacher share one copy."""
        self.ctx: RunContext | None = None
        self.metrics = self.native = self.servers = self.channel = None
        self.trackers: list = []
        first_rank = is_first_rank()
        logs, tracker_files = config.logging, tracker_outputs(config.logging.run_dir)
        try:
            if first_rank:  # before the model is built, so that a tracker that cannot start stops the run at once
                self.trackers = open_trackers(logs, logs.run_dir, dataclasses.asdict(config))
            self._build()
        except BaseException:
            self.close()
            if first_rank:  # a run that did not start leaves no tracker files of its own
                remove_tracker_outputs(logs.run_dir, tracker_outputs(logs.run_dir) - tracker_files)
            raise

    # ---- lifetime: what the run builds, starts and closes ---------------------------------------
    def _build(self) -> None:
        """The trainer, the tasks (data, teachers, reward workers), the rollout engine and the syncs,
        then the run's context."""
        config = self.config
        task_configs = config.task_configs()
        self.trainer = _trainer(config, task_configs)
        run_dir = Path(config.logging.run_dir)
        hf_config = self.trainer.loaded.hf_config
        self.tokenizer = load_tokenizer(
            config.model.tokenizer or config.model.path, "model.tokenizer" if config.model.tokenizer else "model.path"
        )
        self.stop_token_ids = stop_token_ids(self.tokenizer, hf_config)
        several = len(task_configs) > 1
        self.tasks = [
            Task(
                index,
                task_config,
                f"{task_config.name}/" if several else "",
                shared=config,
                tokenizer=self.tokenizer,
                context=hf_config.max_position_embeddings,
                eval_new_tokens=eval_new_tokens(config),
                teacher=self.teacher,
                run_dir=run_dir,
                reports=self.trainer.rank == 0,
            )
            for index, task_config in enumerate(task_configs)
        ]
        replay = any(task.config.algorithm.routing_replay == "rollout" for task in self.tasks)
        if replay and not routers(self.trainer.model):
            raise ValueError(
                f"algorithm.routing_replay='rollout' needs an MoE model; model.path={config.model.path!r} "
                f"({hf_config.model_type}) has no MoE layer: set it to 'off'"
            )
        for task in self.tasks:  # processes and servers last, so that a failure above leaves none running
            task.start_workers(self.tokenizer, hf_config.model_type)
            if task.episodes is not None:  # trajectories and environment prompts stay inside the context
                task.episodes.context_tokens = hf_config.max_position_embeddings
        self._start_engines(run_dir, replay)
        dims = self.trainer.dims
        share = config.rollout.engine == "vllm" and dims.same_data_size > 1
        self.ctx = RunContext(
            config,
            self.trainer,
            self.tokenizer,
            run_dir,
            self.stop_token_ids,
            self.native,
            self.servers,
            share_rollouts=share,
            generates_rollouts=not share or dims.same_data_rank == 0,
        )
        self.metrics = MetricsLogger(run_dir, tensorboard=False, enabled=self.trainer.rank == 0, trackers=self.trackers)
        self.guards = fidelity_guards(config, self.tasks)

    def _start_engines(self, run_dir: Path, replay: bool) -> None:
        """The rollout engine (the vLLM servers, or the built-in engine on the training model), and
        each task's weight sync to it. `replay`: the engine records the routed experts."""
        config = self.config
        if config.rollout.engine == "vllm":
            self.servers = rollout_servers(
                config, self.tasks, self._longest_prompt, eval_new_tokens(config), self.trainer.rank, run_dir
            )
            vllm = config.rollout.vllm
            if config.tasks and vllm.transport == "collective":
                self.channel = WorkerChannel(self.servers.servers, vllm.sync_host, vllm.sync_port, vllm.bucket_mb)
        else:
            self.native = native_engine(config, self.trainer, record_routing=replay)
        for task in self.tasks:
            if self.native is not None:
                rollout = self.native
            else:  # a named task's requests name its own adapter versions
                rollout = task_servers(self.servers) if task.name else self.servers
            task.connect(rollout, config.rollout, run_dir / "vllm_adapters", self.channel)

    def teacher(self, path: str, option: str) -> torch.nn.Module:
        """The frozen teacher model at `path` (`option` names the setting, for errors), built once."""
        key = str(Path(path).resolve())
        if key not in self.teachers:
            self.teachers[key] = load_teacher(path, option, self.trainer.loaded, self.tokenizer, self.trainer.device)
        return self.teachers[key]

    def _longest_prompt(self, task: Task, examples) -> int:
        ids = prompt_ids(self.tokenizer, examples, task.config.data.apply_chat_template)
        return max((len(prompt) for prompt in ids), default=0)

    def close(self) -> None:
        """Close the metrics files, the tasks' reward workers and syncs and the rollout engine (also
        when a step fails), and release the run directory if this run checked it."""
        try:
            for task in self.tasks:
                task.close()  # stops the producers: no new steps; the servers' closing ends a generation under way
            if self.metrics is not None:
                self.metrics.close()  # and the trackers
            else:
                close_trackers(self.trackers)
            if self.native is not None:
                self.native.close()
            if self.channel is not None:
                self.channel.close()
            if self.servers is not None:
                self.servers.close()
            for task in self.tasks:
                if task.producer is not None:
                    task.producer.join()
        finally:
            if self.owns_run_dir:
                self.prepared_run_dir.release()

    @property
    def dp(self) -> int:
        return self.ctx.dp

    @property
    def dp_rank(self) -> int:
        return self.ctx.dp_rank

    def active(self) -> list[Task]:
        return [task for task in self.tasks if task.stopped is None]

    # ---- one step: collect -> score -> prepare -> update -> publish -> log ----------------------
    def step(self, step: int) -> tuple[dict[str, float], list[TaskStep]]:
        """RL step `step` (0-based) of every active task: each trains on rollouts of its adapter
        versions >= its version - max_staleness and publishes its next version. Returns the step's
        metrics and each active task's record of it."""
        ctx, start = self.ctx, time.perf_counter()
        tasks = self.active()
        collected = self.collect(step)
        rollout_s = time.perf_counter() - start  # a task's rollouts may come from one mixed generation
        task_steps = [self._score(task, collected[task.name]) for task in tasks]
        every = self.config.logging.samples_every
        if every and (step + 1) % every == 0:
            rows = []
            for task_step in task_steps:
                rollouts = task_step.rollouts
                rows += table_rows(ctx, task_step.task, rollouts.examples, rollouts.samples, task_step.scores)
            self.metrics.log_samples(step + 1, rows)
        batch, prepared, score_s = self.prepare(tasks, collected, {t.task.name: t.scores for t in task_steps})
        for task_step in task_steps:
            task_step.prepared = prepared[task_step.task.name]
        # before the update: a step whose rollouts are not the trained policy's is not trained on
        fidelity = {t.task.name: self.guards[t.task.name].check_step(ctx, t) for t in task_steps}
        train_start = time.perf_counter()
        updates = update(ctx, batch, [t.task for t in task_steps if t.prepared.trains], tasks)
        train_s = time.perf_counter() - train_start
        for task_step in task_steps:
            task_step.updates = updates.get(task_step.task.name, [])
            task_step.sync = self.publish(task_step.task, task_step.task.version + 1)
            fidelity[task_step.task.name].update(self.guards[task_step.task.name].after_publish(ctx, task_step))
        timings = {
            "rollout_s": rollout_s,
            "score_s": score_s,
            "train_s": train_s,
            "sync_s": sum(task_step.sync["sync_s"] for task_step in task_steps),
            "step_s": time.perf_counter() - start,
        }
        group_size, several = self.config.rollout.group_size, len(self.tasks) > 1
        metrics = step_metrics(task_steps, timings, group_size, ctx.dp_sum, ctx.dp_max, several_tasks=several)
        for task_metrics in fidelity.values():
            metrics.update(task_metrics)
        if self.native is not None and self.native.drafter is not None:  # this step's draft tokens, if any
            acceptance = speculative_acceptance(self.native)
            if acceptance is not None:
                metrics["speculative_acceptance"] = acceptance
        return metrics, task_steps

    def collect(self, step: int) -> dict[str, Rollouts]:
        """The collect phase (archon.rl.run.collect) of the active tasks."""
        return collect_phase(self.ctx, step, lambda: self._own_rollouts(step))

    def _own_rollouts(self, step: int) -> dict[str, Rollouts]:
        """This rank's rollouts of the active tasks for RL step `step`."""
        return own_rollouts(self.ctx, self.active(), step)

    def generate_rollouts(self, task: Task, task_step: int) -> Rollouts:
        """The task's next prompt batch and its samples (archon.rl.run.collect.generate_rollouts)."""
        return generate_task_rollouts(self.ctx, task, task_step)

    def _score(self, task: Task, rollouts: Rollouts) -> TaskStep:
        """The score phase of the task's step: its record of the step, from its rollouts and scores."""
        task.trained_iterator_state = rollouts.iterator_state
        scores = score(self.ctx, task, rollouts.examples, rollouts.samples)
        return TaskStep(task, rollouts, scores, reward_traceback=task.scorer.last_traceback)

    def prepare(
        self, tasks: list[Task], collected: dict[str, Rollouts], scores: dict[str, Scores]
    ) -> tuple[PackedBatch, dict[str, Prepared], float]:
        """The prepare phase (archon.rl.run.prepare) of `tasks`."""
        return prepare_phase(self.ctx, tasks, collected, scores)

    def publish(self, task: Task, version: int) -> dict[str, float]:
        """The publish phase (archon.rl.run.update.publish) of `task`'s adapter version `version`."""
        return publish_phase(self.ctx, task, version)

    # ---- progress: which tasks go on ------------------------------------------------------------
    def _check_progress(self, step: int, metrics: dict[str, float], task_steps: list[TaskStep]) -> None:
        """Count each task's step (Task.record_step) and stop a task past its limits of skipped
        updates or failed rewards in a row. With several tasks the task is stopped alone (its last
        checkpoint and adapter stay as they were; STOPPED_FILE records why) and the others go on;
        a run's only task stops the run with the error, and so does the last active one."""
        for task_step in task_steps:
            task = task_step.task
            error = task.record_step(step, task_step, metrics)
            if error is None:
                continue
            if len(self.tasks) == 1:
                raise error
            task.stop(step, str(error), writes_record=self.trainer.rank == 0)
            logger.error("stopping task %r; the other tasks go on: %s", task.name, error)
            metrics[task.prefix + "stopped"] = 1.0
        if not self.active():
            reasons = "\n".join(f"{task.name}: {task.stopped}" for task in self.tasks)
            raise RuntimeError(f"RL step {step}: every task has stopped:\n{reasons}")

    def _evaluate(self, metrics: dict[str, float], step: int) -> None:
        """Each active task's held-out accuracy into `metrics`, and the evaluation's sample table."""
        accuracies, rows = evaluate(self.ctx, self.active())
        metrics.update(accuracies)
        self.metrics.log_samples(step, rows, evaluation=True)

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        try:
            resuming = self.resume_from is not None or (self.config.tasks and self.config.resume is not None)
            return self._run_steps(self._resume() if resuming else 0)
        finally:
            self.close()

    def _resume(self) -> int:
        """Load each task's checkpoint (archon.rl.run.checkpoints.load_checkpoints) and serve its
        adapter. Returns the RL step to go on from."""
        first = load_checkpoints(self.ctx, self.tasks, self.resume_from)
        for task in self.tasks:
            self.guards[task.name].load_state_dict(task.resumed_fidelity)
        self.metrics.drop_after(first)  # steps the killed run logged past its checkpoint are run again
        for task in self.tasks:
            self.publish(task, task.version)
        if self.trainer.rank == 0:
            where = self.resume_from or self.ctx.run_dir / TASKS_DIR
            print(f"resumed from step {first} (checkpoint {where})", flush=True)
        return first

    def _run_steps(self, first: int) -> dict[str, float]:
        """RL steps first+1 .. steps (1-based), then the final checkpoints and adapters."""
        cfg = self.config
        progress = None
        if self.trainer.rank == 0 and cfg.logging.progress:
            progress = tqdm(total=cfg.steps, initial=first, desc="rl", unit="step", dynamic_ncols=True)
        last: dict[str, float] = {}
        evaluates = cfg.eval.every and any(task.eval_set is not None for task in self.tasks)
        if evaluates and first == 0:
            self._evaluate(last, 0)
            self.metrics.log(0, dict(last))
        for task in self.tasks:  # every rank: the version-gap forwards run on all of them
            if task.adapter_history is not None:
                with self.ctx.view(task):
                    task.adapter_history.record(self.trainer.model, task.version)
        # after the first evaluation, so that the rollouts of the first steps are made (and timed)
        # while training, as all later ones are
        start_producers(self.ctx, self.active(), cfg.steps - first)
        for step in range(first, cfg.steps):
            metrics, task_steps = self.step(step)
            done = step + 1
            if evaluates and (done % cfg.eval.every == 0 or done == cfg.steps):
                self._evaluate(metrics, done)
            try:
                self._check_progress(done, metrics, task_steps)
            finally:
                self.metrics.log(done, metrics)
            last.update(metrics)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
                self.save(done)
            if progress is not None:
                progress.set_postfix(self._postfix(metrics))
                progress.update(1)
        if progress is not None:
            progress.close()
        self.save(cfg.steps, final=True)
        return last

    def _postfix(self, metrics: dict[str, float]) -> dict[str, str]:
        """The progress bar's figures: each task's reward and accuracy (and held-out accuracy)."""
        postfix = {}
        for task in self.active():
            for key, short in (("reward_mean", "reward"), ("accuracy", "acc"), ("eval_accuracy", "eval")):
                if task.prefix + key in metrics:
                    digits = 3 if key == "reward_mean" else 2
                    postfix[task.prefix + short] = f"{metrics[task.prefix + key]:.{digits}f}"
        return postfix

    def save(self, step: int, final: bool = False) -> None:
        """Each active task's resume checkpoint and adapter for RL step `step`
        (archon.rl.run.checkpoints.save); a stopped task keeps its last ones."""
        save_checkpoints(self.ctx, self.active(), step, self.guards, final)
