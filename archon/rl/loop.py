"""The GRPO-family RL loop. Each RL step runs named phases: collect (the step's rollouts) ->
score (rewards) -> prepare (advantages, filters, the packed batch, the log-probs the loss needs) ->
train (PPO epochs x minibatches) -> publish (the weight sync serves the new adapter version) ->
log; then evaluation and checkpoints. With rollout.max_staleness >= 1 a producer thread makes the
rollouts of later steps while the current one trains (archon.rl.producer).

Every rank runs this; data-parallel ranks take their own share of each step's prompts, and the
metrics are reduced over them before rank 0 logs. With vLLM rollouts, the first rank of each
tensor-parallel group generates and sends the rollouts to its peers.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from archon.batch import PackedBatch
from archon.checkpoint.hf import check_model_dir, load_tokenizer
from archon.checkpoint.resume import CheckpointManager
from archon.rl.algorithms import get_algorithm
from archon.rl.config import RLConfig as GRPOConfig
from archon.rl.config import validate
from archon.rl.data import (
    DataConfig,
    PromptBatchIterator,
    load_prompt_dataset,
    tokenize_prompt,
)
from archon.rl.metrics import MetricsLogger
from archon.rl.producer import RolloutProducer, Rollouts
from archon.rl.rewards import RewardScorer
from archon.rl.run_dir import ADAPTER_EXPORT, PreparedRunDir, prepare_run_dir
from archon.rl.versions import AdapterHistory, stale_groups
from archon.rollout.base import Sample, SamplingParams
from archon.rollout.native import NativeRolloutEngine
from archon.sync.weight_sync import build_weight_sync
from archon.trainer import NonFiniteError, Trainer, TrainerConfig

logger = logging.getLogger("archon.rl")
UPDATE_BOOKKEEPING = {
    "lr", "skipped", "tokens", "sequences", "total_tokens", "micro_batches", "optimizer_steps", "time_s", "num_tokens",
}  # fmt: skip
"""What Trainer.train_step reports about an update itself; the step logs its own counts and times."""


class RewardFunctionError(RuntimeError):
    """The reward function failed on every sample for too many steps in a row."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt (see terminate_as_interrupt)."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within the block, SIGTERM (what Slurm and Kubernetes send to stop a job) raises Terminated,
    a KeyboardInterrupt, on the main thread, so that a run stops as on Ctrl-C: it closes the vLLM
    servers it launched (in their own process groups, which the signal does not reach) and its
    reward workers. The previous handler is restored after the block. Off the main thread, where
    Python runs no signal handlers, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise Terminated(f"received {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


@dataclass
class Scores:
    """Per-sample rewards, whether each is correct (reward >= 1), response lengths, and the reward
    workers' error counts."""

    rewards: torch.Tensor
    correct: torch.Tensor
    lengths: torch.Tensor
    reward_metrics: dict[str, float]


@dataclass
class Prepared:
    """What the prepare phase decided beside the batch: the shaped rewards, which samples the batch
    filters kept, the trainer-rollout log-prob gaps (archon.rl.loop.RLRun._logprob_gaps) and the
    seconds spent scoring with the trainer."""

    rewards: torch.Tensor
    keep: torch.Tensor
    gaps: dict[str, torch.Tensor]
    score_s: float


def rollout_batch(samples: list[Sample], advantages: torch.Tensor, trainer_version: int) -> PackedBatch:
    """The samples packed for training, with every completion token's behaviour (rollout) log-prob
    and its version lag (`extras["version_lag"]`: trainer_version minus the version that sampled it)."""
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        advantages=advantages.tolist(),
    )
    rollout_lp = torch.zeros(batch.num_tokens)
    version_lag = torch.zeros(batch.num_tokens, dtype=torch.long)
    for i, s in enumerate(samples):
        start = int(batch.cu_seqlens[i]) + len(s.prompt_ids) - 1
        span = slice(start, start + len(s.completion_ids))
        rollout_lp[span] = torch.tensor(s.logprobs)
        version_lag[span] = trainer_version - torch.tensor(s.token_versions, dtype=torch.long)
    batch.rollout_logprobs = rollout_lp
    batch.extras["version_lag"] = version_lag
    return batch


def stop_token_ids(tokenizer, hf_config) -> tuple[int, ...]:
    """The token ids that end a completion: the tokenizer's EOS and the model config's (one id or a
    list of them)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


def prompt_ids(tokenizer, examples, apply_chat_template: bool) -> list[list[int]]:
    """Each example's prompt token ids (pre-tokenized, or tokenized now)."""
    return [
        ex.prompt_ids if ex.prompt_ids is not None else tokenize_prompt(tokenizer, ex.prompt, apply_chat_template)
        for ex in examples
    ]


def replace_stale_groups(rollouts: Rollouts, group_size: int, version: int, max_staleness: int, generate) -> None:
    """Drop every group of `rollouts` with a sample (or token) made by an adapter version older than
    version - max_staleness and put in its place `generate(examples)`'s fresh samples of the same
    prompts (counted in rollouts.stale_dropped)."""
    G = group_size
    oldest = [min(s.token_versions, default=s.version) for s in rollouts.samples]
    stale = stale_groups(oldest, G, version, max_staleness)
    if not stale:
        return
    regenerated = generate([rollouts.examples[g] for g in stale])
    for slot, group in enumerate(stale):
        for i, sample in enumerate(regenerated[slot * G : (slot + 1) * G]):
            sample.prompt_index = group
            rollouts.samples[group * G + i] = sample
    rollouts.stale_dropped = len(stale) * G


def load_teacher(path: str, option: str, policy, policy_tokenizer, device) -> torch.nn.Module:
    """The frozen teacher model at `path` (`option` names the setting). Distillation compares the
    teacher's and the policy's (`policy`, a LoadedModel) log-probs of the same token ids, so the
    teacher must have the policy's vocabulary size and, when its directory holds a tokenizer, give
    every token the two tokenizers share the same id; both are checked before the weights are read."""
    from archon.build import build_model, load_hf_config
    from archon.checkpoint.hf import TOKENIZER_VOCAB_FILES
    from archon.spec import get_spec

    hf_config = load_hf_config(path, option)
    vocab_size = get_spec(hf_config.model_type).args_cls.from_hf_config(hf_config).vocab_size
    if vocab_size != policy.args.vocab_size:
        raise ValueError(
            f"{option}={path!r}: the teacher's vocabulary has {vocab_size} tokens (vocab_size in "
            f"{Path(path) / 'config.json'}) and the policy's {policy.args.vocab_size} (in "
            f"{policy.path / 'config.json'}); distillation compares log-probs of the same token ids, so they must "
            "share a vocabulary"
        )
    if any((Path(path) / name).exists() for name in TOKENIZER_VOCAB_FILES):
        teacher_ids = load_tokenizer(path, option).get_vocab()
        policy_ids = policy_tokenizer.get_vocab()
        differing = sorted(t for t in teacher_ids.keys() & policy_ids.keys() if teacher_ids[t] != policy_ids[t])
        if differing:
            token = differing[0]
            raise ValueError(
                f"{option}={path!r}: the teacher's tokenizer gives {len(differing)} of the tokens it shares with "
                f"the policy's another id (e.g. {token!r}: {teacher_ids[token]} for the teacher, "
                f"{policy_ids[token]} for the policy); distillation compares log-probs of the same token ids, "
                "so they must share a tokenizer"
            )
    teacher = build_model(path, device=device, path_option=option)
    return teacher.model.eval().requires_grad_(False)


def teacher_logprobs(teacher: torch.nn.Module, batch: PackedBatch, device, temperature: float) -> torch.Tensor:
    """The teacher's log-probs of the batch's labels, [T] on the host, zero outside the loss mask."""
    from archon.head import label_logprobs

    with torch.no_grad():
        b = batch.to(device)
        hidden = teacher(b.tokens, b.positions, b.cu_seqlens, b.max_seqlen, return_hidden=True)
        lp, _ = label_logprobs(hidden, teacher.output_weight, b.labels, temperature)
    return lp.float().cpu() * batch.loss_mask


def update_summary(updates: list[dict[str, float]]) -> dict[str, float]:
    """An RL step's training metrics: the loss, the gradient norm and every metric the loss reports,
    averaged over the applied updates (`*_max` / `*_min`: the extreme); with every update skipped,
    the last update's (non-finite) values. `lr` is the step's (the schedule moves once per RL step)."""
    applied = [u for u in updates if not u["skipped"]] or updates[-1:]
    summary = {"lr": updates[0]["lr"]}
    for key in applied[0]:
        if key in UPDATE_BOOKKEEPING:
            continue
        values = [u[key] for u in applied]
        if key.endswith("_max") or key.endswith("_min"):
            summary[key] = max(values) if key.endswith("_max") else min(values)
        else:
            summary[key] = sum(values) / len(values)
    return summary


def prune_adapter_exports(adapters_dir: Path, keep: int) -> None:
    """Delete all but the newest `keep` step_NNNNNN adapter exports in `adapters_dir`."""
    exports = [p for p in adapters_dir.iterdir() if ADAPTER_EXPORT.fullmatch(p.name)]
    exports.sort(key=lambda p: int(ADAPTER_EXPORT.fullmatch(p.name).group(1)))
    for stale in exports[:-keep]:
        shutil.rmtree(stale)


class RLRun:
    def __init__(self, config: GRPOConfig, run_dir: PreparedRunDir | None = None) -> None:
        """`run_dir`: what `prepare_run_dir` returned, when the caller has checked (and holds) the
        run directory already and releases it after the run (the recipe does, before it prepares
        the demo model); by default the check is made here, before anything is built, and `close`
        releases the directory."""
        validate(config)
        self.config = config
        check_model_dir(config.model.path, "model.path")
        self.owns_run_dir = run_dir is None
        if run_dir is None:
            run_dir = prepare_run_dir(config.logging.run_dir, config.resume, config.overwrite, config.lora)
        self.prepared_run_dir = run_dir
        self.resume_from = run_dir.resume_from
        try:
            self._build()
        except BaseException:
            self._release_run_dir()
            raise

    def _build(self) -> None:
        """The trainer, data, teacher, reward workers, rollout engine and weight sync of the run."""
        config = self.config
        # Schedules count RL steps and last the run unless set.
        optim = config.optim.for_run(config.steps)
        self.algorithm = get_algorithm(config.algorithm, config.rollout.max_new_tokens, config.rollout.max_staleness)
        self.trainer = Trainer(
            TrainerConfig(
                model_path=config.model.path,
                lora=config.lora,
                parallel=config.parallel,
                optim=optim,
                dtype=config.model.dtype,
                device=config.model.device,
                micro_batch_tokens=config.micro_batch_tokens,
                seed=config.seed,
                moe=config.model.moe,
            )
        )
        self.rank = self.trainer.rank
        self.dp_rank, self.dp = self.trainer.dims.dp_rank, self.trainer.dims.dp
        self.device = self.trainer.device
        self.run_dir = Path(config.logging.run_dir)
        self.eval_new_tokens = config.eval.max_new_tokens or config.rollout.max_new_tokens

        if config.model.tokenizer:
            self.tokenizer = load_tokenizer(config.model.tokenizer, "model.tokenizer")
        else:
            self.tokenizer = load_tokenizer(config.model.path, "model.path")
        self.stop_token_ids = stop_token_ids(self.tokenizer, self.trainer.loaded.hf_config)
        context = self.trainer.loaded.hf_config.max_position_embeddings
        self.train_set = load_prompt_dataset(config.data, self.tokenizer, context, config.rollout.max_new_tokens)
        self._report_dataset("train", self.train_set)
        self.iterator = PromptBatchIterator(
            self.train_set.examples, batch_size=config.rollout.prompts_per_step, seed=config.data.seed,
            shuffle=config.data.shuffle, drop_last=config.data.drop_last,
        )  # fmt: skip
        self.eval_set = None
        if config.eval.path and config.eval.every:
            eval_data = DataConfig(**{**asdict(config.data), "path": config.eval.path})
            self.eval_set = load_prompt_dataset(eval_data, self.tokenizer, context, self.eval_new_tokens)
            self._report_dataset("held-out", self.eval_set)
        self.teacher = None
        if self.algorithm.needs_teacher:
            self.teacher = load_teacher(config.algorithm.teacher_path, "algorithm.teacher_path",
                                        self.trainer.loaded, self.tokenizer, self.device)  # fmt: skip
        # processes and servers last, so that a failure above leaves none running
        self.scorer = RewardScorer(config.reward)
        if config.rollout.engine == "vllm":
            self.rollout = self._vllm_rollout()
        else:
            self.rollout = NativeRolloutEngine(
                self.trainer.model, self.device, max_batch_sequences=config.rollout.max_batch_sequences
            )
        self.sync = build_weight_sync(config.rollout, self.rollout, lora=config.lora, sync_dir=self.run_dir / "vllm_adapters")
        # vLLM serves every rank alike, so the first rank of each tensor-parallel group generates and
        # sends the rollouts to its peers (the built-in engine generates on every rank, in lockstep)
        self.share_rollouts_over_tp = config.rollout.engine == "vllm" and self.trainer.dims.tp > 1
        self.generates_rollouts = not self.share_rollouts_over_tp or self.trainer.dims.tp_rank == 0
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints", keep_last=config.checkpoint.keep_last)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=config.logging.tensorboard, enabled=self.rank == 0)
        self._skipped_streak: list[int] = []
        """RL steps in a row (the latest last) with an update skipped for a non-finite loss or gradient."""
        self._skipped_steps = 0
        """RL steps of the run so far with a skipped update (the `skipped_steps` metric)."""
        self._reward_failure_streak: list[int] = []
        """RL steps in a row on which the reward function failed on every sample."""
        self._step_extremes: dict[str, float] = {}
        self._reward_traceback: str | None = None
        self.version = 0
        """The adapter version the trainer holds: the number of RL steps trained."""
        self.producer: RolloutProducer | None = None
        """Generates later steps' rollouts in the background (rollout.max_staleness >= 1)."""
        self.adapter_history: AdapterHistory | None = None
        """The adapters of the last versions, kept on every rank when samples may lag and the version
        gap is measured (rollout.max_staleness >= 1 and rollout.measure_version_gap)."""
        if config.rollout.max_staleness > 0 and config.rollout.measure_version_gap:
            self.adapter_history = AdapterHistory(keep=config.rollout.max_staleness + 1)
        self._trained_iterator_state: dict | None = None
        """The data iterator as of the last trained step's prompts (the producer draws ahead)."""

    def _vllm_rollout(self):
        """Rank 0 launches (or connects to) the servers; the other ranks connect to the same URLs
        for their share of the generation. Only rank 0 sends adapters (see build_weight_sync)."""
        import dataclasses

        from archon.rollout.vllm import VLLMRolloutEngine

        vllm_config = self.config.rollout.vllm
        kwargs = dict(
            model_path=self.config.model.path, lora_rank=self.config.lora.max_rank if self.config.lora else None,
            log_dir=self.run_dir,
        )  # fmt: skip
        rollout, failure = None, None
        if self.rank == 0:
            # launched servers are sized for the longest request of the run (see VLLMConfig.max_model_len):
            # the longer of (longest training prompt + rollout tokens) and (longest held-out prompt + eval tokens)
            requests = [(self._longest_prompt(self.train_set.examples), self.config.rollout.max_new_tokens)]
            if self.eval_set is not None:
                eval_prompts = self.eval_set.examples[: self.config.eval.max_prompts]
                requests.append((self._longest_prompt(eval_prompts), self.eval_new_tokens))
            longest_prompt, max_new_tokens = max(requests, key=sum)
            try:
                rollout = VLLMRolloutEngine(
                    vllm_config, rank=0, longest_prompt_tokens=longest_prompt, max_new_tokens=max_new_tokens, **kwargs
                )
            except Exception as e:  # the other ranks wait for the URLs: they must fail too
                failure = e
        if dist.is_initialized() and dist.get_world_size() > 1:
            # rank 0's server URLs, or its error (so that every rank raises it instead of waiting)
            shared = [failure if rollout is None else [s.url for s in rollout.servers]]
            dist.broadcast_object_list(shared, src=0)
            failure = shared[0] if isinstance(shared[0], BaseException) else None
            if failure is None and rollout is None:
                rollout = VLLMRolloutEngine(dataclasses.replace(vllm_config, urls=tuple(shared[0])), rank=self.rank, **kwargs)
        if failure is not None:
            raise failure
        return rollout

    # ---- helpers ------------------------------------------------------------------------------
    def _longest_prompt(self, examples) -> int:
        return max((len(ids) for ids in self._prompt_ids(examples)), default=0)

    def _report_dataset(self, name: str, dataset) -> None:
        if (dataset.malformed or dataset.too_long) and self.rank == 0:
            logger.warning("%s data: %s", name, dataset.report())

    def _sum(self, *values: float) -> list[float]:
        """Sum over the data-parallel ranks."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        if self.dp > 1:
            dist.all_reduce(t, group=self.trainer.dims.dp_group)
        return t.tolist()

    def _max(self, value: float) -> float:
        t = torch.tensor(value, dtype=torch.float64, device=self.device)
        if self.dp > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.trainer.dims.dp_group)
        return t.item()

    def _prompt_ids(self, examples) -> list[list[int]]:
        return prompt_ids(self.tokenizer, examples, self.config.data.apply_chat_template)

    def _completions(self, samples: list[Sample]) -> list[str]:
        return self.tokenizer.batch_decode([s.completion_ids for s in samples], skip_special_tokens=True)

    # ---- one step: collect -> score -> prepare -> train -> publish -> log -----------------------
    def step(self, step: int) -> dict[str, float]:
        """RL step `step` (0-based): trains on rollouts of adapter versions >= step - max_staleness and
        publishes adapter version step + 1."""
        start = time.perf_counter()
        rollouts = self.collect(step)
        self._trained_iterator_state = rollouts.iterator_state
        scores = self.score(rollouts.examples, rollouts.samples)
        self._reward_traceback = self.scorer.last_traceback
        batch, prepared = self.prepare(step, rollouts, scores)
        train_start = time.perf_counter()
        updates = self.train(batch)
        train_s = time.perf_counter() - train_start
        sync = self.publish(step + 1)
        timings = {"rollout_s": rollouts.wait_s, "score_s": prepared.score_s, "train_s": train_s,
                   "sync_s": sync["sync_s"], "step_s": time.perf_counter() - start}  # fmt: skip
        return self.log_metrics(rollouts, scores, batch, prepared, updates, sync, timings)

    def _sampling(self, step: int) -> SamplingParams:
        cfg = self.config.rollout
        return SamplingParams(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
            n=cfg.group_size, stop_token_ids=self.stop_token_ids,
            seed=self.config.seed * 1_000_003 + step * 1009 + self.dp_rank,
        )  # fmt: skip

    def generate_rollouts(self, step: int) -> Rollouts:
        """The next prompt batch (this rank's share) and its samples, from the adapter version in
        service now. Runs on the producer thread in the asynchronous mode."""
        start = time.perf_counter()
        examples = next(self.iterator)[self.dp_rank :: self.dp]
        iterator_state = self.iterator.state_dict()
        samples = self.rollout.generate(self._prompt_ids(examples), self._sampling(step))
        return Rollouts(step, examples, samples, iterator_state, generate_s=time.perf_counter() - start)

    def collect(self, step: int) -> Rollouts:
        """Collect: the rollouts this step trains on. Synchronously they are made now; with
        rollout.max_staleness N >= 1 the producer made them ahead, and any group sampled with a
        version older than step - N is dropped and sampled again. A failure on any rank stops every
        rank here, before the step's collectives."""
        rollouts, failure = None, None
        if self.generates_rollouts:
            try:
                rollouts = self._own_rollouts(step)
            except Exception as error:  # raised below, once every rank knows
                failure = error
        self._stop_if_any_rank_failed(step, failure)
        if self.share_rollouts_over_tp:
            shared = [rollouts]
            dist.broadcast_object_list(shared, group=self.trainer.dims.tp_group, group_src=0)
            rollouts = shared[0]
        return rollouts

    def _own_rollouts(self, step: int) -> Rollouts:
        if self.producer is None:
            rollouts = self.generate_rollouts(step)
            rollouts.wait_s = rollouts.generate_s
            return rollouts
        rollouts = self.producer.take(step)
        replace_stale_groups(
            rollouts, self.config.rollout.group_size, step, self.config.rollout.max_staleness,
            lambda examples: self.rollout.generate(self._prompt_ids(examples), self._sampling(step)),
        )  # fmt: skip
        return rollouts

    def _stop_if_any_rank_failed(self, step: int, failure: Exception | None) -> None:
        failed = torch.tensor([0.0 if failure is None else 1.0], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failure is not None:
            raise failure
        if failed.item() > 0:
            raise RuntimeError(f"RL step {step + 1}: generating the rollouts failed on another rank (its log has the cause)")

    def score(self, examples, samples: list[Sample]) -> Scores:
        """Score: rewards of the samples (reward workers), whether each is correct, response lengths."""
        completions = self._completions(samples)
        rewards, reward_metrics = self.scorer.score(
            [examples[s.prompt_index].prompt for s in samples], completions,
            [examples[s.prompt_index].reference for s in samples],
        )  # fmt: skip
        lengths = torch.tensor([len(s.completion_ids) for s in samples], dtype=torch.float32)
        return Scores(rewards, (rewards >= 1.0).float(), lengths, reward_metrics)

    def prepare(self, step: int, rollouts: Rollouts, scores: Scores) -> tuple[PackedBatch, Prepared]:
        """Prepare: advantages and batch filters, the packed batch, and the log-probs the loss needs
        (proximal policy, reference, teacher)."""
        cfg, algo = self.config, self.config.algorithm
        G = cfg.rollout.group_size
        shaped = self.algorithm.prepare(
            scores.rewards, scores.lengths, G,
            batch_sum=lambda totals: torch.tensor(self._sum(*totals.tolist()), dtype=torch.float64),
        )  # fmt: skip
        rewards, advantages, keep = shaped.rewards, shaped.advantages, shaped.keep
        self._step_extremes = {
            "reward_abs_max": self._max(float(rewards.abs().max()) if rewards.numel() else 0.0),
            "advantage_abs_max": self._max(float(advantages.abs().max()) if advantages.numel() else 0.0),
        }
        kept = [s for s, k in zip(rollouts.samples, keep.tolist()) if k]
        batch = rollout_batch(kept, advantages[keep], trainer_version=step)

        score_start = time.perf_counter()
        if algo.recompute_old_logprobs:
            batch.old_logprobs = self.trainer.logprobs(batch, cfg.rollout.temperature).logprobs
        else:
            batch.old_logprobs = batch.rollout_logprobs.clone()
        mask = batch.loss_mask
        gaps = self._logprob_gaps(batch)
        if self.algorithm.needs_reference:
            batch.ref_logprobs = self.trainer.logprobs(batch, cfg.rollout.temperature, use_adapter=False).logprobs
        if self.teacher is not None:
            teacher = teacher_logprobs(self.teacher, batch, self.device, cfg.rollout.temperature)
            batch.advantages = self.algorithm.token_advantages(batch.advantages, batch.old_logprobs, teacher, mask)
        return batch, Prepared(rewards, keep, gaps, score_s=time.perf_counter() - score_start)

    def _logprob_gaps(self, batch: PackedBatch) -> dict[str, torch.Tensor]:
        """|trainer - rollout| log-prob gap over the completion tokens, split in two when samples
        lag the trainer: `numerics`, the gap to the trainer's log-probs under the very adapter
        version that sampled (kernels, precision, batching), and `lag`, the part due to the adapter
        having moved on since. Without lag (or without the version-gap measurement) all of it is
        numerics."""
        mask = batch.loss_mask
        total = (batch.old_logprobs - batch.rollout_logprobs).abs()
        gaps = {"total": total[mask], "numerics": total[mask], "lag": torch.zeros(int(mask.sum()))}
        if self.adapter_history is None:  # synchronous, or the measurement is off
            return gaps
        lags = self._lags_present(batch)
        if not lags:
            return gaps
        at_sampling = batch.old_logprobs.clone()
        for lag in lags:
            with self.adapter_history.swapped_in(self.trainer.model, self.version - lag):
                scored = self.trainer.logprobs(batch, self.config.rollout.temperature).logprobs
            at_sampling = torch.where(batch.extras["version_lag"] == lag, scored, at_sampling)
        gaps["numerics"] = (at_sampling - batch.rollout_logprobs).abs()[mask]
        gaps["lag"] = (batch.old_logprobs - at_sampling).abs()[mask]
        return gaps

    def _lags_present(self, batch: PackedBatch) -> list[int]:
        """The version lags > 0 present on any data-parallel rank (so that every rank runs the same
        forwards), of versions the adapter history still holds."""
        present = torch.zeros(self.config.rollout.max_staleness + 1, dtype=torch.float64, device=self.device)
        lags = batch.extras["version_lag"][batch.loss_mask].unique()
        present[lags[(lags > 0) & (lags < present.numel())].to(present.device)] = 1.0
        if self.dp > 1:
            dist.all_reduce(present, op=dist.ReduceOp.MAX, group=self.trainer.dims.dp_group)
        return [lag for lag in range(1, present.numel()) if present[lag] > 0 and self.version - lag in self.adapter_history]

    def train(self, batch: PackedBatch) -> list[dict[str, float]]:
        """Train: algorithm.ppo_epochs passes over the batch in algorithm.minibatches updates, then
        the LR schedule advances once (it is a function of the RL step)."""
        algo = self.config.algorithm
        updates: list[dict[str, float]] = []
        groups = list(range(batch.num_sequences))
        per_minibatch = -(-len(groups) // algo.minibatches)
        for _ in range(algo.ppo_epochs):
            for m in range(algo.minibatches):
                chosen = groups[m * per_minibatch : (m + 1) * per_minibatch] or groups[-1:]
                updates.append(
                    self.trainer.train_step(
                        batch.select(chosen), self.algorithm.loss, self.config.rollout.temperature, with_entropy=True,
                        advance_schedule=False,
                    )  # fmt: skip
                )
        self.trainer.advance_schedule()
        return updates

    def publish(self, version: int) -> dict[str, float]:
        """Publish: the weight sync makes the trained adapter version `version` on the rollout side;
        returns what it sent (sync_adapter_bytes or sync_weight_bytes; rank 0 knows) and sync_s."""
        start = time.perf_counter()
        sent = self.sync.publish(self.trainer.model, self.trainer.converter, self.trainer.lora, version)
        self.version = version
        if self.adapter_history is not None:
            self.adapter_history.record(self.trainer.model, version)
        if self.producer is not None:
            self.producer.published(version)
        metrics = {f"sync_{k}": v for k, v in sent.items() if k.endswith("_bytes")}
        return {"sync_s": time.perf_counter() - start, **metrics}

    def log_metrics(self, rollouts, scores, batch, prepared, updates, sync, timings) -> dict[str, float]:
        """Log: the step's metrics, summed or maxed over the data-parallel ranks."""
        G = self.config.rollout.group_size
        rewards, lengths, gaps = prepared.rewards, scores.lengths, prepared.gaps
        lag = batch.extras["version_lag"][batch.loss_mask].double()
        (n, reward_sum, reward_sq, correct_sum, length_sum, gap_sum, gap_n, numerics_sum, lag_gap_sum,
         kept_groups, errors, timeouts, tokens, lag_sum, stale) = self._sum(
            len(rollouts.samples), float(rewards.double().sum()), float((rewards.double() ** 2).sum()),
            float(scores.correct.sum()), float(lengths.sum()), float(gaps["total"].sum()),
            float(gaps["total"].numel()), float(gaps["numerics"].sum()), float(gaps["lag"].sum()),
            float(prepared.keep.sum()) / G, scores.reward_metrics["reward_errors"],
            scores.reward_metrics["reward_timeouts"], float(batch.num_tokens), float(lag.sum()),
            float(rollouts.stale_dropped),
        )  # fmt: skip
        reward_mean = reward_sum / n
        step_s = timings["step_s"]
        metrics = {
            "reward_mean": reward_mean,
            "reward_std": max(reward_sq / n - reward_mean**2, 0.0) ** 0.5,
            "accuracy": correct_sum / n,
            "response_length": length_sum / n,
            "logprob_abs_diff_mean": gap_sum / max(gap_n, 1.0),
            "logprob_abs_diff_max": self._max(float(gaps["total"].max()) if gaps["total"].numel() else 0.0),
            "groups_kept": kept_groups,
            "reward_errors": errors,
            "reward_timeouts": timeouts,
            "reward_samples": n,
            **timings,
            "tokens_per_s": tokens / step_s,  # the step's training batch, all ranks
            "adapter_version": float(self.version),
            "skipped_updates": sum(u["skipped"] for u in updates),
        }
        # version lag of the trained tokens, the log-prob gap split by cause, stale groups dropped and
        # sampled again, and how long each side waited for the other
        if self.producer is not None:  # over the time since the previous step's rollouts were taken
            idle, elapsed = self.producer.idle_since_last()
        else:  # synchronously the rollout side waits while the trainer scores, trains and publishes
            idle, elapsed = step_s - rollouts.generate_s, step_s
        metrics.update({
            "version_lag_mean": lag_sum / max(gap_n, 1.0),
            "version_lag_max": self._max(float(lag.max()) if lag.numel() else 0.0),
            "logprob_gap_numerics": numerics_sum / max(gap_n, 1.0),
            "logprob_gap_lag": lag_gap_sum / max(gap_n, 1.0),
            "stale_samples_dropped": stale,
            "trainer_idle_s": rollouts.wait_s,
            "rollout_idle_s": idle,
            "trainer_idle_fraction": rollouts.wait_s / step_s,
            "rollout_idle_fraction": min(max(idle, 0.0) / elapsed, 1.0) if elapsed > 0 else 0.0,
        })  # fmt: skip
        metrics.update(sync)
        metrics.update(update_summary(updates))
        return metrics

    def _count_skipped(self, step: int, metrics: dict[str, float]) -> None:
        """`skipped_steps`: RL steps of the run so far on which an update was skipped."""
        skipped = metrics["skipped_updates"] > 0
        self._skipped_steps += int(skipped)
        metrics["skipped_steps"] = self._skipped_steps
        self._skipped_streak = self._skipped_streak + [step] if skipped else []

    def _check_progress(self, step: int, metrics: dict[str, float]) -> None:
        """Stop the run (the same decision on every rank: the counts are global) after
        algorithm.max_skipped_steps RL steps in a row with a skipped update, or
        reward.max_failed_steps steps in a row on which the reward function failed on every sample."""
        limit = self.config.algorithm.max_skipped_steps
        if len(self._skipped_streak) >= limit:
            extremes = self._step_extremes
            raise NonFiniteError(
                f"RL step {step}: the loss or gradient norm was NaN or inf on {len(self._skipped_streak)} RL steps "
                f"in a row (steps {self._skipped_streak[0]}-{step}, algorithm.max_skipped_steps={limit}); those "
                "updates were skipped and left the adapter and optimizer unchanged. Last step: "
                f"loss {metrics.get('loss')}, grad_norm {metrics.get('grad_norm')}, lr {metrics.get('lr')}, "
                f"largest |reward| {extremes.get('reward_abs_max')}, largest |advantage| "
                f"{extremes.get('advantage_abs_max')}. Likely causes: rewards so large that the loss overflows "
                "(rescale the reward function), or a learning rate too high (lower optim.lr)."
            )
        failed = metrics["reward_samples"] > 0 and metrics["reward_errors"] + metrics["reward_timeouts"] >= (
            metrics["reward_samples"]
        )
        self._reward_failure_streak = self._reward_failure_streak + [step] if failed else []
        limit = self.config.reward.max_failed_steps
        if len(self._reward_failure_streak) >= limit:
            cause = self._reward_traceback or "(every sample timed out, or failed on another rank)"
            raise RewardFunctionError(
                f"RL step {step}: the reward function {self.config.reward.function!r} failed on every sample for "
                f"{len(self._reward_failure_streak)} steps in a row (steps {self._reward_failure_streak[0]}-{step}, "
                f"reward.max_failed_steps={limit}). First failure of step {step}:\n{cause}"
            )

    # ---- evaluation -----------------------------------------------------------------------------
    def evaluate(self) -> float:
        cfg = self.config
        examples = self.eval_set.examples[: cfg.eval.max_prompts][self.dp_rank :: self.dp]
        sampling = SamplingParams(
            max_new_tokens=self.eval_new_tokens, temperature=0,
            stop_token_ids=self.stop_token_ids,
        )  # fmt: skip
        samples = self.rollout.generate(self._prompt_ids(examples), sampling) if examples else []
        if not examples:  # keep the collectives of the generation in step with the other ranks
            self.rollout.generate([[self.stop_token_ids[0] if self.stop_token_ids else 0]], sampling)
        rewards = self.score(examples, samples).rewards if samples else torch.zeros(0)
        correct, total = self._sum(float((rewards >= 1.0).sum()), float(len(samples)))
        return correct / max(total, 1.0)

    # ---- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        try:
            return self._train(self._resume() if self.resume_from is not None else 0)
        finally:
            self.close()

    def _resume(self) -> int:
        """Load the checkpoint chosen by prepare_run_dir; returns its RL step."""
        trainer_state = self.trainer.load_checkpoint(self.checkpoints, self.resume_from)
        first = trainer_state["step"]
        if first > self.config.steps:
            raise ValueError(
                f"--resume {self.resume_from}: the checkpoint is at step {first}, beyond this run's steps="
                f"{self.config.steps}; raise --steps to continue it"
            )
        data = trainer_state["data"]
        self.iterator.load_state_dict(data["iterator"])
        self._skipped_streak = data.get("skipped_streak", [])
        self._reward_failure_streak = data.get("reward_failure_streak", [])
        self._skipped_steps = data.get("skipped_steps", 0)
        self.metrics.drop_after(first)  # steps the killed run logged past its checkpoint are run again
        self.publish(first)
        if self.rank == 0:
            print(f"resumed from step {first} (checkpoint {self.resume_from})", flush=True)
        return first

    def _start_producer(self, first: int) -> RolloutProducer | None:
        """The background producer of rollouts for steps first.. (rollout.max_staleness >= 1; on the
        ranks that generate)."""
        max_staleness = self.config.rollout.max_staleness
        if max_staleness == 0 or not self.generates_rollouts:
            return None
        return RolloutProducer(self.generate_rollouts, first, self.config.steps, max_staleness, version=self.version)

    def _train(self, first: int) -> dict[str, float]:
        """RL steps first+1 .. steps (1-based), then the final checkpoint and adapter."""
        cfg = self.config
        progress = None
        if self.rank == 0 and cfg.logging.progress:
            from tqdm import tqdm

            progress = tqdm(total=cfg.steps, initial=first, desc="grpo", unit="step", dynamic_ncols=True)
        last: dict[str, float] = {}
        eval_every = cfg.eval.every if self.eval_set is not None else 0
        if eval_every and first == 0:
            last["eval_accuracy"] = self.evaluate()
            self.metrics.log(0, {"eval_accuracy": last["eval_accuracy"]})
        if self.adapter_history is not None:  # every rank: the version-gap forwards run on all of them
            self.adapter_history.record(self.trainer.model, self.version)
        # after the first evaluation, so that the rollouts of the first steps are made (and timed)
        # while training, as all later ones are
        self.producer = self._start_producer(first)
        for step in range(first, cfg.steps):
            metrics = self.step(step)
            done = step + 1
            self._count_skipped(done, metrics)
            if eval_every and (done % eval_every == 0 or done == cfg.steps):
                metrics["eval_accuracy"] = self.evaluate()
            self.metrics.log(done, metrics)
            last.update(metrics)
            self._check_progress(done, metrics)
            if cfg.checkpoint.every and done % cfg.checkpoint.every == 0 and done != cfg.steps:
                self.save(done)
            if progress is not None:
                postfix = {"reward": f"{metrics['reward_mean']:.3f}", "acc": f"{metrics['accuracy']:.2f}"}
                if "eval_accuracy" in metrics:
                    postfix["eval"] = f"{metrics['eval_accuracy']:.2f}"
                progress.set_postfix(postfix)
                progress.update(1)
        if progress is not None:
            progress.close()
        self.save(cfg.steps, final=True)
        return last

    def close(self) -> None:
        """Close the metrics files, reward workers and rollout servers (also when a step fails), and
        release the run directory if this run checked it."""
        try:
            if self.producer is not None:
                self.producer.stop()  # no new steps; the servers' closing ends a generation under way
            self.metrics.close()
            self.scorer.close()
            self.sync.close()
            self.rollout.close()
            if self.producer is not None:
                self.producer.join()
        finally:
            self._release_run_dir()

    def _release_run_dir(self) -> None:
        if self.owns_run_dir:
            self.prepared_run_dir.release()

    def save(self, step: int, final: bool = False) -> None:
        """A resume checkpoint for RL step `step` and the PEFT adapter: RUN_DIR/adapter at the end,
        RUN_DIR/adapters/step_NNNNNN before it (the newest checkpoint.keep_last_adapters kept).

        The data position saved is that of the last trained step: rollouts the producer made ahead
        are not saved, and a resumed run samples their prompts again (nothing lost, nothing trained
        twice)."""
        data_state = {
            "iterator": self._trained_iterator_state or self.iterator.state_dict(), "skipped_steps": self._skipped_steps,
            "skipped_streak": self._skipped_streak, "reward_failure_streak": self._reward_failure_streak,
        }  # fmt: skip
        self.trainer.save_checkpoint(self.checkpoints, step, data_state)
        out = self.run_dir / ("adapter" if final else f"adapters/step_{step:06d}")
        self.trainer.export_peft(out, base_model_name_or_path=self.config.model.path)
        if not final and self.rank == 0:
            prune_adapter_exports(self.run_dir / "adapters", self.config.checkpoint.keep_last_adapters)
