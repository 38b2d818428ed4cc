"""The RL loop. A run trains one or several tasks (archon.rl.run.task), each an adapter on the one
frozen base with its own data, reward and algorithm; a run without `tasks` is one unnamed task.
Each RL step runs named phases over every active task: collect (the step's rollouts) -> score
(rewards) -> prepare (advantages, filters, one packed batch of every task's samples, the log-probs
the losses need) -> train (PPO epochs x minibatches, each stepping every task's optimizer) ->
publish (each weight sync serves its task's new adapter version) -> log; then evaluation and
checkpoints. With max_staleness >= 1 a task's producer thread makes the rollouts of its later steps
while the current one trains (archon.rl.run.producer).

Every rank runs this; data-parallel ranks take their own share of each step's prompts of every
task, and the metrics are reduced over them before rank 0 logs. With vLLM rollouts, the first rank
of each tensor-parallel group generates and sends the rollouts to its peers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from archon.agents.setup import build_episode_runner
from archon.batch import PackedBatch
from archon.build import resolve_mtp
from archon.checkpoint.atomic import atomic_write_json
from archon.checkpoint.hf import check_model_dir, load_tokenizer
from archon.checkpoint.resume import STEP_DIR
from archon.load_balance import routers
from archon.lora import lora_parameters, task_view
from archon.parallel import init_distributed
from archon.rl.config import RLConfig, validate
from archon.rl.run.episodes import episode_samples, score_episodes
from archon.rl.metrics import MetricsLogger
from archon.rl.model_card import model_card, task_export_dir
from archon.rl.run.producer import RolloutProducer, Rollouts
from archon.rl.rewards import RewardScorer
from archon.rl.run.rollouts import (
    concat_batches,
    distill_from_teachers,
    filler_batch,
    load_teacher,
    mixed_rollouts,
    prompt_ids,
    replace_stale_groups,
    rollout_batch,
    rollout_servers,
    stop_token_ids,
    task_servers,
)
from archon.rl.run.run_dir import TASKS_DIR, PreparedRunDir, prepare_run_dir, prune_adapter_exports
from archon.rl.samples import merge_rank_rows, sample_rows
from archon.rl.run.step_metrics import Prepared, Scores, every_reward_failed, task_step_metrics
from archon.rl.run.task import STOPPED_FILE, Task, resume_named_tasks
from archon.rl.trackers import close_trackers, open_trackers, remove_tracker_outputs, tracker_outputs
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.speculative import build_drafter
from archon.sync.vllm import WorkerChannel
from archon.sync.weight_sync import build_weight_sync
from archon.trainer import TASK_EXTRA, Trainer, TrainerConfig, TrainerTask

logger = logging.getLogger("archon.rl")


class RLRun:
    def __init__(self, config: RLConfig, run_dir: PreparedRunDir | None = None) -> None:
        """`run_dir`: what `prepare_run_dir` returned, when the caller has checked (and holds) the
        run directory already and releases it after the run (the recipe does, before it prepares
        the demo model); by default the check is made here, before anything is built, and `close`
        releases the directory."""
        validate(config)
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
        self.metrics = self.native = self.servers = self.channel = None
        self.trackers: list = []
        self._eval_rows: dict[str, list[dict]] = {}
        first_rank = (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0
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

    def _build(self) -> None:
        """The trainer, the tasks (data, teacher, reward workers), the rollout engine and the syncs."""
        config = self.config
        task_configs = config.task_configs()
        trains_mtp = any(task.algorithm.mtp_loss_weight > 0 for task in task_configs)
        self.trainer = Trainer(
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
        self.rank = self.trainer.rank
        self.dp_rank, self.dp = self.trainer.dims.dp_rank, self.trainer.dims.dp
        self.device = self.trainer.device
        self.run_dir = Path(config.logging.run_dir)
        self.eval_new_tokens = config.eval.max_new_tokens or config.rollout.max_new_tokens
        self.tokenizer = load_tokenizer(
            config.model.tokenizer or config.model.path, "model.tokenizer" if config.model.tokenizer else "model.path"
        )
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.trainer.loaded.hf_config)
        self.teachers: dict[str, torch.nn.Module] = {}
        """The frozen teachers by path: tasks and data sources that name the same teacher share one copy."""
        for index, task_config in enumerate(task_configs):
            prefix = f"{task_config.name}/" if len(task_configs) > 1 else ""
            self.tasks.append(Task(self, index, task_config, prefix))
        replay = any(task.config.algorithm.routing_replay == "rollout" for task in self.tasks)
        if replay and not routers(self.trainer.model):
            raise ValueError(
                f"algorithm.routing_replay='rollout' needs an MoE model; model.path={config.model.path!r} "
                f"({self.trainer.loaded.hf_config.model_type}) has no MoE layer: set it to 'off'"
            )
        for task in self.tasks:  # processes and servers last, so that a failure above leaves none running
            task.scorer = RewardScorer(task.config.reward, task.data_sources())
            if task.config.environment.enabled:
                task.episodes, task.tool_runner = build_episode_runner(
                    task.config.environment,
                    self.tokenizer,
                    self.trainer.loaded.hf_config.model_type,
                    task.config.data.prompt_field,
                )
        if config.rollout.engine == "vllm":
            self.servers = rollout_servers(
                config, self.tasks, self._longest_prompt, self.eval_new_tokens, self.rank, self.run_dir
            )
            vllm = config.rollout.vllm
            if config.tasks and vllm.transport == "collective":
                self.channel = WorkerChannel(self.servers.servers, vllm.sync_host, vllm.sync_port, vllm.bucket_mb)
        else:  # on the training model; a multi-task model generates every task's prompts in one batch
            self.native = NativeRolloutEngine(
                self.trainer.model,
                self.device,
                max_batch_sequences=config.rollout.max_batch_sequences,
                prefill_chunk_tokens=config.rollout.prefill_chunk_tokens,
                record_routing=replay,
                drafter=build_drafter(config.rollout.speculative, self.trainer.model, self.device),
            )
        for task in self.tasks:
            if self.native is not None:
                task.rollout = self.native
            else:  # a named task's requests name its own adapter versions
                task.rollout = task_servers(self.servers) if task.name else self.servers
            task.sync = build_weight_sync(
                config.rollout,
                task.rollout,
                lora=task.config.lora,
                sync_dir=self.run_dir / "vllm_adapters",
                task=task.name or None,
                channel=self.channel,
            )
        # vLLM serves every rank alike, so the first of the ranks given the same data (the context- and
        # tensor-parallel ranks of one data-parallel rank) generates and sends the rollouts to the others
        # (the built-in engine generates on every rank, in lockstep, with the same seeds)
        dims = self.trainer.dims
        self.share_rollouts = config.rollout.engine == "vllm" and dims.same_data_size > 1
        self.generates_rollouts = not self.share_rollouts or dims.same_data_rank == 0
        self.metrics = MetricsLogger(self.run_dir, tensorboard=False, enabled=self.rank == 0, trackers=self.trackers)

    # ---- helpers ------------------------------------------------------------------------------
    def teacher(self, path: str, option: str) -> torch.nn.Module:
        """The frozen teacher model at `path` (`option` names the setting, for errors), built once."""
        key = str(Path(path).resolve())
        if key not in self.teachers:
            self.teachers[key] = load_teacher(path, option, self.trainer.loaded, self.tokenizer, self.device)
        return self.teachers[key]

    def _longest_prompt(self, task: Task, examples) -> int:
        return max((len(ids) for ids in self._prompt_ids(task, examples)), default=0)

    def _sum(self, *values: float, op=dist.ReduceOp.SUM) -> list[float]:
        """Sum (or another `op`) over the data-parallel ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.dp > 1:
            dist.all_reduce(t, op=op, group=self.trainer.dims.dp_group)
        return t.tolist()

    def _max(self, value: float) -> float:
        return self._sum(value, op=dist.ReduceOp.MAX)[0]

    def _prompt_ids(self, task: Task, examples) -> list[list[int]]:
        return prompt_ids(self.tokenizer, examples, task.config.data.apply_chat_template)

    def active(self) -> list[Task]:
        return [task for task in self.tasks if task.stopped is None]

    def _view(self, task: Task):
        """The model as `task`'s single-adapter model (the model itself for a run without tasks)."""
        return task_view(self.trainer.model, task.name) if self.trainer.multi_task else contextlib.nullcontext()

    def _generate(self, task: Task, examples, sampling: SamplingParams) -> list[Sample]:
        """`task`'s samples of `examples`, with its adapter."""
        if task.episodes is not None:
            engine = self.native if self.native is not None else task.rollout
            return episode_samples(task, examples, sampling, engine, task.index if self.trainer.multi_task else None)
        prompts = self._prompt_ids(task, examples)
        if self.native is not None and self.trainer.multi_task:
            return self.native.generate(
                prompts, sampling, adapters=[task.index] * len(prompts), adapter_seeds={task.index: sampling.seed}
            )
        return task.rollout.generate(prompts, sampling)

    def _sampling(self, task: Task, task_step: int) -> SamplingParams:
        """Training sampling for `task`'s step `task_step` on this rank (the seed follows the task's
        name and the data-parallel rank)."""
        cfg = self.config
        return SamplingParams(
            max_new_tokens=cfg.rollout.max_new_tokens,
            temperature=cfg.rollout.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            n=cfg.rollout.group_size,
            stop_token_ids=self.stop_token_ids,
            seed=cfg.seed * 1_000_003 + task_step * 1009 + task.seed_offset + self.dp_rank,
        )

    # ---- one step: collect -> score -> prepare -> train -> publish -> log -----------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step `step` (0-based) of every active task: each trains on rollouts of its adapter
        versions >= its version - max_staleness and publishes its next version."""
        start = time.perf_counter()
        tasks = self.active()
        collected = self.collect(step)
        rollout_s = time.perf_counter() - start  # a task's rollouts may come from one mixed generation
        scores: dict[str, Scores] = {}
        for task in tasks:
            task.trained_iterator_state = collected[task.name].iterator_state
            scores[task.name] = self.score(task, collected[task.name].examples, collected[task.name].samples)
            task.reward_traceback = task.scorer.last_traceback
        every = self.config.logging.samples_every
        if every and (step + 1) % every == 0:
            rows = []
            for task in tasks:
                rollouts = collected[task.name]
                rows += self._table_rows(task, rollouts.examples, rollouts.samples, scores[task.name])
            self.metrics.log_samples(step + 1, rows)
        batch, prepared, score_s = self.prepare(tasks, collected, scores)
        train_start = time.perf_counter()
        updates = self.train(batch, [task for task in tasks if prepared[task.name].trains])
        train_s = time.perf_counter() - train_start
        sync = {task.name: self.publish(task, task.version + 1) for task in tasks}
        timings = {
            "rollout_s": rollout_s,
            "score_s": score_s,
            "train_s": train_s,
            "sync_s": sum(s["sync_s"] for s in sync.values()),
            "step_s": time.perf_counter() - start,
        }
        metrics: dict[str, float] = {}
        tokens = 0.0
        for task in tasks:
            task_metrics = task_step_metrics(
                task,
                collected[task.name],
                scores[task.name],
                prepared[task.name],
                updates.get(task.name, []),
                sync[task.name],
                timings["step_s"],
                self.config.rollout.group_size,
                self._sum,
                self._max,
            )
            tokens += task_metrics.pop("tokens")
            metrics.update({task.prefix + key: value for key, value in task_metrics.items()})
        metrics.update(timings)
        metrics["tokens_per_s"] = tokens / timings["step_s"]  # the step's training batch, all ranks
        if len(self.tasks) > 1:
            metrics["active_tasks"] = float(len(tasks))
        if self.native is not None and self.native.drafter is not None:  # this step's draft tokens
            stats = self.native.stats
            proposed, accepted = stats.speculative_proposed, stats.speculative_accepted
            stats.speculative_proposed = stats.speculative_accepted = 0
            metrics["speculative_acceptance"] = accepted / proposed if proposed else 0.0
        return metrics

    def _table_rows(self, task: Task, examples, samples: list[Sample], scores: Scores | None) -> list[dict]:
        """The sample-table rows (archon.rl.samples) of the task's scored samples, whole groups of
        every data-parallel rank's, at most logging.samples_per_table rows (on every rank)."""
        limit = self.config.logging.samples_per_table
        rows = sample_rows(task.name, examples, samples, scores, self.tokenizer, task.version, limit, self.dp)
        per_rank = [rows]
        if self.dp > 1:
            per_rank = [None] * self.dp
            dist.all_gather_object(per_rank, rows, group=self.trainer.dims.dp_group)
        return merge_rank_rows(per_rank, limit)

    def generate_rollouts(self, task: Task, task_step: int) -> Rollouts:
        """The task's next prompt batch (this rank's share) and its samples, from its adapter version
        in service now (`task_step`: the task's own step count, which its versions follow). Runs on
        the task's producer thread in the asynchronous mode."""
        start = time.perf_counter()
        examples = next(task.iterator)[self.dp_rank :: self.dp]
        iterator_state = task.iterator.state_dict()
        samples = self._generate(task, examples, self._sampling(task, task_step))
        return Rollouts(task_step, examples, samples, iterator_state, generate_s=time.perf_counter() - start)

    def collect(self, step: int) -> dict[str, Rollouts]:
        """Collect: every active task's rollouts for this step. Synchronously they are made now; with
        max_staleness N >= 1 the task's producer made them ahead, and any group sampled with a version
        older than the task's version - N is dropped and sampled again. A failure on any rank stops
        every rank here, before the step's collectives."""
        rollouts, failure = None, None
        if self.generates_rollouts:
            try:
                rollouts = self._own_rollouts(step)
            except Exception as error:  # raised below, once every rank knows
                failure = error
        self._stop_if_any_rank_failed(step, failure)
        if self.share_rollouts:
            shared = [rollouts]
            dist.broadcast_object_list(shared, group=self.trainer.dims.same_data_group, group_src=0)
            rollouts = shared[0]
        return rollouts

    def _own_rollouts(self, step: int) -> dict[str, Rollouts]:
        if self.native is not None and self.trainer.multi_task and all(t.episodes is None for t in self.active()):
            return mixed_rollouts(self.native, self.active(), self._prompt_ids, self._sampling, self.dp_rank, self.dp)
        collected = {}
        for task in self.active():
            if task.producer is None:
                rollouts = self.generate_rollouts(task, task.version)
                rollouts.wait_s = rollouts.generate_s
            else:
                rollouts = task.producer.take(task.version)
                replace_stale_groups(
                    rollouts,
                    self.config.rollout.group_size,
                    task.version,
                    task.config.max_staleness,
                    lambda examples, task=task: self._generate(task, examples, self._sampling(task, task.version)),
                )
            collected[task.name] = rollouts
        return collected

    def _stop_if_any_rank_failed(self, step: int, failure: Exception | None) -> None:
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)  # over every rank: all generate or none
        if failure is not None:
            raise failure
        if failed.item() > 0:
            raise RuntimeError(
                f"RL step {step + 1}: generating the rollouts failed on another rank (its log has the cause)"
            )

    def score(self, task: Task, examples, samples: list[Sample]) -> Scores:
        """Score: the task's rewards of the samples (its reward workers), whether each is correct,
        response lengths."""
        if task.episodes is not None:
            return score_episodes(task, examples, samples)
        completions = self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)
        rows = [examples[s.prompt_index] for s in samples]
        scored = task.scorer.score_batch(
            [row.prompt for row in rows],
            completions,
            [row.reference for row in rows],
            [row.data_source for row in rows],
            [row.extra_info for row in rows],
            [s.prompt_index for s in samples],
        )
        lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
        return Scores(
            scored.rewards,
            (scored.rewards >= 1.0).float(),
            lengths,
            scored.metrics,
            scored.parts,
            reward_sums=scored.sums,
        )

    def prepare(
        self, tasks: list[Task], collected: dict[str, Rollouts], scores: dict[str, Scores]
    ) -> tuple[PackedBatch, dict[str, Prepared], float]:
        """Prepare: each task's advantages and batch filters, every task's kept samples packed in one
        batch (`extras["task"]` in a multi-task run), and the log-probs the losses need: proximal
        policy and reference in one forward each, each sequence's teacher (its data source's) on it;
        and the seconds spent scoring with the trainer. A task whose reward function failed on every
        sample (on every rank) has nothing to learn from and takes no update this step."""
        G = self.config.rollout.group_size
        parts: list[PackedBatch] = []
        sources: list[str] = []  # the data source of each sequence of the batch (its prompt's row's)
        prepared: dict[str, Prepared] = {}
        for task in tasks:
            s = scores[task.name]
            errors, samples = self._sum(
                s.reward_metrics["reward_errors"] + s.reward_metrics["reward_timeouts"], float(len(s.rewards))
            )
            shaped = task.algorithm.prepare(
                s.rewards,
                s.lengths,
                G,
                batch_sum=lambda totals: torch.tensor(self._sum(*totals.tolist()), dtype=torch.float64),
            )
            rewards, advantages, keep = shaped.rewards, shaped.advantages, shaped.keep
            task.extremes = {
                "reward_abs_max": self._max(float(rewards.abs().max()) if rewards.numel() else 0.0),
                "advantage_abs_max": self._max(float(advantages.abs().max()) if advantages.numel() else 0.0),
            }
            trains = not every_reward_failed(errors, samples)
            kept = [sample for sample, k in zip(collected[task.name].samples, keep.tolist()) if k] if trains else []
            if kept:
                part = rollout_batch(
                    kept,
                    advantages[keep],
                    trainer_version=task.version,
                    routed_experts=task.config.algorithm.routing_replay == "rollout",
                )
                if self.trainer.multi_task:
                    part.extras[TASK_EXTRA] = torch.full((part.num_tokens,), task.index, dtype=torch.long)
                parts.append(part)
                examples = collected[task.name].examples
                sources += [examples[sample.prompt_index].data_source for sample in kept]
            prepared[task.name] = Prepared(rewards, keep, trains=trains)
        batch = concat_batches(parts) if parts else filler_batch(self.trainer.multi_task, 0)
        trained = [task for task in tasks if prepared[task.name].trains]
        if not trained:
            return batch, prepared, 0.0
        score_start = time.perf_counter()
        temperature = self.config.rollout.temperature
        recompute = [task for task in trained if task.config.algorithm.recompute_old_logprobs]
        batch.old_logprobs = batch.rollout_logprobs.clone()
        if recompute:
            scored = self.trainer.logprobs(batch, temperature).logprobs
            batch.old_logprobs = torch.where(self._tokens_of(batch, recompute), scored, batch.old_logprobs)
        if any(task.algorithm.needs_reference for task in trained):
            batch.ref_logprobs = self.trainer.logprobs(batch, temperature, use_adapter=False).logprobs
        sequences = self.trainer.sequences_by_adapter(batch)
        for task in trained:
            of_task = self._tokens_of(batch, [task])
            mine = batch.loss_mask & of_task
            prepared[task.name].gaps = self._logprob_gaps(task, batch, mine)
            prepared[task.name].lag = batch.extras["version_lag"][mine].double()
            prepared[task.name].tokens = float(of_task.sum()) if parts else 0.0
            if not task.teachers or not parts or task.name not in sequences:
                continue
            mine = sequences[task.name]
            prepared[task.name].distill_gaps = distill_from_teachers(
                batch,
                mine,
                [task.teachers[sources[i]] for i in mine],
                [sources[i] for i in mine],
                task.algorithm,
                self.device,
                temperature,
            )
        return batch, prepared, time.perf_counter() - score_start

    def _tokens_of(self, batch: PackedBatch, tasks: list[Task]) -> torch.Tensor:
        """[T] bool: the batch's tokens of `tasks`."""
        if not self.trainer.multi_task:
            return (
                torch.ones(batch.num_tokens, dtype=torch.bool)
                if tasks
                else torch.zeros(batch.num_tokens, dtype=torch.bool)
            )
        return torch.isin(batch.extras[TASK_EXTRA], torch.tensor([task.index for task in tasks]))

    def _logprob_gaps(self, task: Task, batch: PackedBatch, mask: torch.Tensor) -> dict[str, torch.Tensor]:
        """|trainer - rollout| log-prob gap over the task's completion tokens, split in two when
        samples lag the trainer: `numerics`, the gap to the trainer's log-probs under the very adapter
        version that sampled (kernels, precision, batching), and `lag`, the part due to the adapter
        having moved on since. Without lag (or without the version-gap measurement) all of it is
        numerics. `mask`: [T] bool, the task's loss tokens."""
        total = (batch.old_logprobs - batch.rollout_logprobs).abs()
        gaps = {"total": total[mask], "numerics": total[mask], "lag": torch.zeros(int(mask.sum()))}
        if task.adapter_history is None:  # synchronous, or the measurement is off
            return gaps
        lags = self._lags_present(task, batch, mask)
        if not lags:
            return gaps
        at_sampling = batch.old_logprobs.clone()
        with self._view(task):
            params = lora_parameters(self.trainer.model)
        for lag in lags:
            with task.adapter_history.swapped_in(params, task.version - lag):
                scored = self.trainer.logprobs(batch, self.config.rollout.temperature).logprobs
            at_sampling = torch.where(batch.extras["version_lag"] == lag, scored, at_sampling)
        gaps["numerics"] = (at_sampling - batch.rollout_logprobs).abs()[mask]
        gaps["lag"] = (batch.old_logprobs - at_sampling).abs()[mask]
        return gaps

    def _lags_present(self, task: Task, batch: PackedBatch, mask: torch.Tensor) -> list[int]:
        """The version lags > 0 of the task's tokens present on any data-parallel rank (so that every
        rank runs the same forwards), of versions the adapter history still holds."""
        present = torch.zeros(task.config.max_staleness + 1, dtype=torch.float64, device=self.device)
        lags = batch.extras["version_lag"][mask].unique()
        present[lags[(lags > 0) & (lags < present.numel())].to(present.device)] = 1.0
        if self.dp > 1:
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.trainer.dims.dp_group)
        return [
            lag for lag in range(1, present.numel()) if present[lag] > 0 and task.version - lag in task.adapter_history
        ]

    def train(self, batch: PackedBatch, tasks: list[Task]) -> dict[str, list[dict[str, float]]]:
        """Train: algorithm.ppo_epochs passes over the batch in algorithm.minibatches updates (the
        same for every task); minibatch m holds the m-th share of every task's sequences and steps
        each task's own optimizer. Then each task's LR schedule advances once (it is a function of
        the RL step). A rank whose share of a minibatch is empty runs a filler batch in step with
        the others; a task with no sequence in a minibatch on any rank takes no update from it."""
        updates: dict[str, list[dict[str, float]]] = {task.name: [] for task in tasks}
        if tasks:
            algo = tasks[0].config.algorithm
            by_adapter = self.trainer.sequences_by_adapter(batch)
            losses = {task.name: task.algorithm.loss for task in tasks}
            for _ in range(algo.ppo_epochs):
                for m in range(algo.minibatches):
                    chosen = []
                    for name, sequences in by_adapter.items():
                        if name in losses:
                            per = -(-len(sequences) // algo.minibatches)
                            chosen += sequences[m * per : (m + 1) * per]
                    minibatch = (
                        batch.select(chosen) if chosen else filler_batch(self.trainer.multi_task, tasks[0].index)
                    )
                    out = self.trainer.train_step(
                        minibatch, losses, self.config.rollout.temperature, with_entropy=True, advance_schedule=False
                    )
                    for name, metrics in out.items():
                        updates[name].append(metrics)
        for task in self.active():
            self.trainer.advance_schedule(task.name)
        return updates

    def publish(self, task: Task, version: int) -> dict[str, float]:
        """Publish: the weight sync makes the task's trained adapter version `version` on the
        rollout side (under its own name on vLLM); returns what it sent (sync_adapter_bytes or
        sync_weight_bytes; rank 0 knows) and sync_s."""
        start = time.perf_counter()
        with self._view(task):
            sent = task.sync.publish(self.trainer.model, self.trainer.converter, task.config.lora, version)
            task.version = version
            if task.adapter_history is not None:
                task.adapter_history.record(self.trainer.model, version)
        if task.producer is not None:
            task.producer.published(version)
        metrics = {f"sync_{k}": v for k, v in sent.items() if k.endswith("_bytes")}
        return {"sync_s": time.perf_counter() - start, **metrics}

    def _check_progress(self, step: int, metrics: dict[str, float]) -> None:
        """Count each task's step (Task.record_step) and stop a task past its limits of skipped
        updates or failed rewards in a row. With several tasks the task is stopped alone (its last
        checkpoint and adapter stay as they were; STOPPED_FILE records why) and the others go on;
        a run's only task stops the run with the error, and so does the last active one."""
        for task in self.active():
            error = task.record_step(step, metrics)
            if error is None:
                continue
            if len(self.tasks) == 1:
                raise error
            task.stopped = str(error)
            if self.rank == 0:
                task.dir.mkdir(parents=True, exist_ok=True)
                atomic_write_json(task.dir / STOPPED_FILE, {"step": step, "reason": task.stopped})
            if task.producer is not None:
                task.producer.stop()
            logger.error("stopping task %r; the other tasks go on: %s", task.name, error)
            metrics[task.prefix + "stopped"] = 1.0
        if not self.active():
            reasons = "\n".join(f"{task.name}: {task.stopped}" for task in self.tasks)
            raise RuntimeError(f"RL step {step}: every task has stopped:\n{reasons}")

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self, task: Task) -> float:
        """The task's greedy accuracy on its held-out prompts (this rank's share; summed over ranks)."""
        examples = task.eval_set.examples[: self.config.eval.max_prompts][self.dp_rank :: self.dp]
        sampling = SamplingParams(
            max_new_tokens=self.eval_new_tokens, temperature=0, stop_token_ids=self.stop_token_ids
        )
        samples = self._generate(task, examples, sampling) if examples else []
        if not examples:  # keep the collectives of the generation in step with the other ranks
            self._generate(task, [task.eval_set.examples[0]], sampling)
        scores = self.score(task, examples, samples) if samples else None
        rewards = scores.rewards if scores is not None else torch.zeros(0)
        if self.config.logging.samples_every:
            self._eval_rows[task.name] = self._table_rows(task, examples, samples, scores)
        correct, total = self._sum(float((rewards >= 1.0).sum()), float(len(samples)))
        return correct / max(total, 1.0)

    def _evaluate_all(self, metrics: dict[str, float], step: int) -> None:
        """Each active task's held-out accuracy into `metrics`, and the evaluation's sample table."""
        self._eval_rows = {}
        for task in self.active():
            if task.eval_set is not None:
                metrics[task.prefix + "eval_accuracy"] = self.evaluate(task)
        self.metrics.log_samples(step, [row for rows in self._eval_rows.values() for row in rows], evaluation=True)

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        try:
            resuming = self.resume_from is not None or (self.config.tasks and self.config.resume is not None)
            return self._train(self._resume() if resuming else 0)
        finally:
            self.close()

    def _resume(self) -> int:
        """Load each task's checkpoint (a run without tasks: the one prepare_run_dir chose; named
        tasks: each its own newest, and tasks without one, added now, start fresh). Returns the RL
        step to go on from."""
        if self.config.tasks:
            step = None if self.resume_from is None else int(STEP_DIR.fullmatch(self.resume_from.name).group(1))
            first = resume_named_tasks(self.tasks, self.trainer, self.run_dir / TASKS_DIR, self.config.steps, step)
        else:
            (task,) = self.tasks
            state = self.trainer.load_checkpoint(task.checkpoints, self.resume_from)
            first = state["step"]
            if first > self.config.steps:
                raise ValueError(
                    f"--resume {self.resume_from}: the checkpoint is at step {first}, beyond this run's steps="
                    f"{self.config.steps}; raise --steps to continue it"
                )
            task.load_state(state["data"], first)
        self.metrics.drop_after(first)  # steps the killed run logged past its checkpoint are run again
        for task in self.tasks:
            self.publish(task, task.version)
        if self.rank == 0:
            print(f"resumed from step {first} (checkpoint {self.resume_from or self.run_dir / TASKS_DIR})", flush=True)
        return first

    def _start_producers(self, first: int) -> None:
        """A background producer for each task with max_staleness >= 1 (on the ranks that generate):
        it makes the task's later steps while the current one trains, at most max_staleness ahead."""
        if not self.generates_rollouts:
            return
        remaining = self.config.steps - first
        for task in self.active():
            if task.config.max_staleness > 0:
                task.producer = RolloutProducer(
                    lambda task_step, task=task: self.generate_rollouts(task, task_step),
                    task.version,
                    task.version + remaining,
                    task.config.max_staleness,
                    version=task.version,
                )

    def _train(self, first: int) -> dict[str, float]:
        """RL steps first+1 .. steps (1-based), then the final checkpoints and adapters."""
        cfg = self.config
        progress = None
        if self.rank == 0 and cfg.logging.progress:
            progress = tqdm(total=cfg.steps, initial=first, desc="rl", unit="step", dynamic_ncols=True)
        last: dict[str, float] = {}
        evaluates = cfg.eval.every and any(task.eval_set is not None for task in self.tasks)
        if evaluates and first == 0:
            self._evaluate_all(last, 0)
            self.metrics.log(0, dict(last))
        for task in self.tasks:  # every rank: the version-gap forwards run on all of them
            if task.adapter_history is not None:
                with self._view(task):
                    task.adapter_history.record(self.trainer.model, task.version)
        # after the first evaluation, so that the rollouts of the first steps are made (and timed)
        # while training, as all later ones are
        self._start_producers(first)
        for step in range(first, cfg.steps):
            metrics = self.step(step)
            done = step + 1
            if evaluates and (done % cfg.eval.every == 0 or done == cfg.steps):
                self._evaluate_all(metrics, done)
            try:
                self._check_progress(done, metrics)
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

    def save(self, step: int, final: bool = False) -> None:
        """Each active task's resume checkpoint for RL step `step` and its PEFT adapter with its model
        card (README.md, archon.rl.model_card): TASK_DIR/adapter at the end, TASK_DIR/adapters/step_NNNNNN
        before it (the newest checkpoint.keep_last_adapters kept), where TASK_DIR is the run directory
        for a run without tasks and RUN_DIR/tasks/<name> for a named task. A stopped task keeps its
        last ones.

        The data position saved is that of the last trained step: rollouts a producer made ahead
        are not saved, and a resumed run samples their prompts again (nothing lost, nothing trained
        twice)."""
        for task in self.active():
            self.trainer.save_checkpoint(task.checkpoints, step, task.state(), task=task.name)
            out = task_export_dir(task, step, final)
            card = model_card(self, task, step, final) if self.rank == 0 else None
            self.trainer.export_peft(
                out, base_model_name_or_path=self.config.model.path, task=task.name, model_card=card
            )
            if not final and self.rank == 0:
                prune_adapter_exports(task.dir / "adapters", self.config.checkpoint.keep_last_adapters)
