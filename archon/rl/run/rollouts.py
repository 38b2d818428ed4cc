"""What the RL loop does with rollouts: prompts in, packed training batches out, the teacher's
log-probs, and the staleness bound.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import torch
import torch.distributed as dist

from archon.batch import PER_TOKEN_FIELDS, PackedBatch
from archon.build import build_model, load_hf_config
from archon.checkpoint.hf import TOKENIZER_VOCAB_FILES, load_tokenizer
from archon.head import label_logprobs
from archon.rl.data import tokenize_prompt
from archon.rl.run.producer import Rollouts
from archon.rl.run.versions import stale_groups
from archon.rollout.base import Sample
from archon.rollout.native import ROUTED_EXPERTS
from archon.rollout.policy import ServedPolicy
from archon.rollout.vllm import VLLMRolloutEngine
from archon.spec import get_spec
from archon.trainer import ROUTED_EXPERTS_EXTRA, TASK_EXTRA


def rollout_batch(
    samples: list[Sample], advantages: torch.Tensor, trainer_version: int, routed_experts: bool = False
) -> PackedBatch:
    """The samples packed for training (loss on their completion tokens, but for those a
    completion_mask leaves out), with every completion token's behaviour (rollout) log-prob
    and its version lag (`extras["version_lag"]`: trainer_version minus the version that sampled it).
    routed_experts: also the expert ids the engine routed every token to (`extras["routed_experts"]`,
    [T, L_moe, k] from each sample's `extra["routed_experts"]`), for the trainer to replay.
    The advantages' dtype is the batch's: fp32, or fp64 in a float64 run (an equality test's), whose
    rollout log-probs then keep the engine's fp64 values."""
    batch = PackedBatch.from_sequences(
        [s.prompt_ids + s.completion_ids for s in samples],
        prompt_lens=[len(s.prompt_ids) for s in samples],
        advantages=advantages,
    )
    rollout_lp = torch.zeros(batch.num_tokens, dtype=batch.advantages.dtype)
    version_lag = torch.zeros(batch.num_tokens, dtype=torch.long)
    for i, s in enumerate(samples):
        start = int(batch.cu_seqlens[i]) + len(s.prompt_ids) - 1
        span = slice(start, start + len(s.completion_ids))
        rollout_lp[span] = torch.tensor(s.logprobs, dtype=rollout_lp.dtype)
        version_lag[span] = trainer_version - torch.tensor(s.token_versions, dtype=torch.long)
        if s.completion_mask is not None:  # a multi-turn trajectory: the environment's ids take no loss
            batch.loss_mask[span] &= torch.tensor(s.completion_mask, dtype=torch.bool)
    batch.rollout_logprobs = rollout_lp
    batch.extras["version_lag"] = version_lag
    if routed_experts:
        batch.extras[ROUTED_EXPERTS_EXTRA] = packed_routed_experts(samples, batch)
    return batch


def packed_routed_experts(samples: list[Sample], batch: PackedBatch) -> torch.Tensor:
    """[T, L_moe, k] int16: each sample's recorded expert ids at its tokens' rows of `batch`."""
    missing = [i for i, s in enumerate(samples) if ROUTED_EXPERTS not in s.extra]
    if missing:
        raise ValueError(
            f"algorithm.routing_replay='rollout' needs every sample's routed experts, and sample {missing[0]} "
            f"(of {len(samples)}) has none in Sample.extra[{ROUTED_EXPERTS!r}]; the built-in engine records them "
            "for single-turn rollouts"
        )
    first = samples[0].extra[ROUTED_EXPERTS]
    experts = torch.full((batch.num_tokens, *first.shape[1:]), -1, dtype=torch.int16)
    for i, s in enumerate(samples):
        recorded = s.extra[ROUTED_EXPERTS]
        length = len(s.prompt_ids) + len(s.completion_ids)
        if recorded.shape != (length, *first.shape[1:]):
            raise ValueError(
                f"sample {i} has routed experts of shape {tuple(recorded.shape)}, expected "
                f"({length}, {', '.join(map(str, first.shape[1:]))}) for its {length} tokens"
            )
        start = int(batch.cu_seqlens[i])
        experts[start : start + length] = recorded
    return experts


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
    with torch.no_grad():
        b = batch.to(device)
        hidden = teacher(b.tokens, b.positions, b.cu_seqlens, b.max_seqlen, return_hidden=True)
        lp, _ = label_logprobs(hidden, teacher.output_weight, b.labels, temperature)
    return lp.float().cpu() * batch.loss_mask


def distill_from_teachers(
    batch: PackedBatch,
    sequences: list[int],
    teachers: list[torch.nn.Module],
    sources: list[str],
    algorithm,
    device,
    temperature: float,
) -> dict[str, tuple[float, float]]:
    """On-policy distillation of the sequences `sequences` of `batch`, sequence sequences[k] from the
    teacher teachers[k] (its prompt's data source's, sources[k]): writes their token advantages
    (`algorithm.token_advantages` of the teacher's log-probs and batch.old_logprobs) into
    batch.advantages, with one teacher forward over all the sequences of each distinct teacher
    (sources sharing a teacher share its forward). Returns, by source, the sum over its loss tokens
    of the log-prob gap log pi_student - log pi_teacher and the number of those tokens.

    The teachers are whole, unsharded models on every rank (no collectives in their forward), so a
    rank runs the forwards of the teachers its own samples need, whatever the other ranks run."""
    by_teacher: dict[int, list[int]] = {}
    for k, teacher in enumerate(teachers):
        by_teacher.setdefault(id(teacher), []).append(k)
    bounds = batch.cu_seqlens.tolist()
    gaps: dict[str, tuple[float, float]] = {}
    for ks in by_teacher.values():
        chosen = [sequences[k] for k in ks]
        sub = batch.select(chosen)
        teacher_lp = teacher_logprobs(teachers[ks[0]], sub, device, temperature)
        tokens = torch.cat([torch.arange(bounds[i], bounds[i + 1]) for i in chosen])
        batch.advantages[tokens] = algorithm.token_advantages(
            sub.advantages, sub.old_logprobs, teacher_lp, sub.loss_mask
        )
        gap = (sub.old_logprobs.double() - teacher_lp.double()) * sub.loss_mask
        sub_bounds = sub.cu_seqlens.tolist()
        for j, k in enumerate(ks):
            span = slice(sub_bounds[j], sub_bounds[j + 1])
            total, count = gaps.get(sources[k], (0.0, 0.0))
            gaps[sources[k]] = (total + float(gap[span].sum()), count + float(sub.loss_mask[span].sum()))
    return gaps


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


def filler_batch(multi_task: bool, task_index: int) -> PackedBatch:
    """A batch of one token and no loss token, for a rank with nothing to score or train in a step
    or minibatch that the other data-parallel ranks run: its forward and backward keep this rank's
    collectives in step with theirs and add nothing to any loss or gradient. In a multi-task run its
    token is `task_index`'s."""
    batch = PackedBatch.from_sequences([[0]], prompt_lens=[1], advantages=[0.0])
    batch.old_logprobs, batch.rollout_logprobs, batch.ref_logprobs = torch.zeros(1), torch.zeros(1), torch.zeros(1)
    batch.extras["version_lag"] = torch.zeros(1, dtype=torch.long)
    if multi_task:
        batch.extras[TASK_EXTRA] = torch.full((1,), task_index, dtype=torch.long)
    return batch


def rollout_servers(config, tasks, longest_prompt, eval_new_tokens: int, rank: int, log_dir: Path):
    """The vLLM servers of a run (a VLLMRolloutEngine), which serve every task's adapters side by
    side: rank 0 launches (or connects to) them, the other ranks connect to the same URLs for their
    share of the generation. Only rank 0 sends adapters (see build_weight_sync).
    `longest_prompt(task, examples)`: the longest prompt of `examples` in tokens."""
    vllm_config = config.rollout.vllm
    ranks = [task.config.lora.max_rank for task in tasks if task.config.lora is not None]
    kwargs = dict(
        model_path=config.model.path,
        lora_rank=max(ranks) if ranks else None,
        log_dir=log_dir,
        update_policy=config.rollout.update_policy,
    )
    servers, failure = None, None
    if rank == 0:
        # launched servers are sized for the longest request of the run (see VLLMConfig.max_model_len):
        # the longest of (longest training prompt + rollout tokens) and (longest held-out prompt + eval
        # tokens) over the tasks
        requests = []
        for task in tasks:
            if task.episodes is not None:  # whole trajectories: the first prompt, then turns and additions
                framing = task.episodes.framing_tokens(task.config.environment.system_prompt)
                examples = task.train_set.examples + (task.eval_set.examples if task.eval_set is not None else [])
                limits = task.config.environment.limits
                requests.append((longest_prompt(task, examples) + framing, limits.max_tokens))
                continue
            requests.append((longest_prompt(task, task.train_set.examples), config.rollout.max_new_tokens))
            if task.eval_set is not None:
                held_out = task.eval_set.examples[: config.eval.max_prompts]
                requests.append((longest_prompt(task, held_out), eval_new_tokens))
        longest_prompt, max_new_tokens = max(requests, key=sum)
        try:
            servers = VLLMRolloutEngine(
                vllm_config, rank=0, longest_prompt_tokens=longest_prompt, max_new_tokens=max_new_tokens, **kwargs
            )
        except Exception as e:  # the other ranks wait for the URLs: they must fail too
            failure = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        # rank 0's server URLs, or its error (so that every rank raises it instead of waiting)
        shared = [failure if servers is None else [s.url for s in servers.servers]]
        dist.broadcast_object_list(shared, src=0)
        failure = shared[0] if isinstance(shared[0], BaseException) else None
        if failure is None and servers is None:
            servers = VLLMRolloutEngine(dataclasses.replace(vllm_config, urls=tuple(shared[0])), rank=rank, **kwargs)
    if failure is not None:
        raise failure
    return servers


def mixed_rollouts(native, tasks, prompt_ids, sampling, dp_rank: int, dp: int) -> dict[str, Rollouts]:
    """The next rollouts of every task of `tasks` (this data-parallel rank's share of its prompts),
    from the built-in engine `native` on a multi-task model in one mixed batch, each sequence with
    its task's adapter; `prompt_ids(task, examples)` tokenizes, `sampling(task, step)` is a task's
    sampling at its step. Each task samples from its own generators, seeded from its name: its
    samples depend on its prompts and its step, not on the other tasks or its place among them."""
    start = time.perf_counter()
    drawn = {task.name: next(task.iterator)[dp_rank::dp] for task in tasks}
    prompts, adapters = [], []
    for task in tasks:
        ids = prompt_ids(task, drawn[task.name])
        prompts += ids
        adapters += [task.index] * len(ids)
    seeds = {task.index: sampling(task, task.version).seed for task in tasks}
    sampling = sampling(tasks[0], tasks[0].version)
    samples = native.generate(prompts, sampling, adapters=adapters, adapter_seeds=seeds) if prompts else []
    generate_s = time.perf_counter() - start
    collected, first = {}, 0
    for task in tasks:
        count = len(drawn[task.name])
        mine = [s for s in samples if first <= s.prompt_index < first + count]
        for sample in mine:
            sample.prompt_index -= first
            # the engine's policy is not the task's: in-process, the task's version is in service
            sample.version, sample.token_versions = task.version, [task.version] * len(sample.completion_ids)
        collected[task.name] = Rollouts(
            task.version, drawn[task.name], mine, task.iterator.state_dict(), generate_s=generate_s, wait_s=generate_s
        )
        first += count
    return collected
