"""The rollout engines of a run: the built-in engine on the training model (and, for
asynchronous rollouts, its lanes beside the trainer), or the vLLM servers that serve every task's
adapters side by side; and the token ids that end a completion.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import torch
from torch import nn

from archon.distributed import first_rank_then_broadcast
from archon.lora import lora_parameters
from archon.rl.config import RLConfig
from archon.rollout.native import NativeRolloutEngine
from archon.rollout.policy import ServedPolicy
from archon.rollout.speculative import build_drafter
from archon.rollout.vllm import VLLMRolloutEngine
from archon.trainer import Trainer


def stop_token_ids(tokenizer, hf_config) -> tuple[int, ...]:
    """The token ids that end a completion: the tokenizer's EOS and the model config's (one id or a
    list of them)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    return tuple(sorted(ids))


def native_engine(
    config: RLConfig, trainer: Trainer, record_routing: bool, model: nn.Module | None = None
) -> NativeRolloutEngine:
    """The built-in engine on the training model (or `model`, a lane_model of it); a multi-task
    model generates every task's prompts in one batch. `record_routing`: record the experts each
    token was routed to (routing replay)."""
    model = trainer.model if model is None else model
    return NativeRolloutEngine(
        model,
        trainer.device,
        max_batch_sequences=config.rollout.max_batch_sequences,
        prefill_chunk_tokens=config.rollout.prefill_chunk_tokens,
        prepack_linears=config.rollout.prepack_linears,
        record_routing=record_routing,
        drafter=build_drafter(config.rollout.speculative, model, trainer.device),
        update_policy=config.rollout.update_policy,
        speculative_max_rows=config.rollout.speculative.max_rows,
    )


def lane_model(model: nn.Module) -> nn.Module:
    """A copy of `model` that generates beside the trainer: the same base weights, parameters and
    buffers (shared, not copied) and LoRA factors of its own, which the trainer's updates leave
    alone until they are handed over."""
    own = {id(p) for p in lora_parameters(model).values()}
    shared = {}
    for module in model.modules():
        attributes = (v for v in vars(module).values() if isinstance(v, torch.Tensor))
        for tensor in (*module._parameters.values(), *module._buffers.values(), *attributes):
            if tensor is not None and id(tensor) not in own:
                shared[id(tensor)] = tensor
    copied = copy.deepcopy(model, shared)
    for factor in lora_parameters(copied).values():
        factor.requires_grad_(False)
    return copied


class RolloutLanes:
    """The built-in engine's asynchronous rollouts (max_staleness >= 1; one process, one adapter):
    one engine for each step that may generate at once (max_staleness + 1), each on a lane_model of
    the training model, so that steps generate while the trainer trains and beside each other. Step
    k generates on lane k mod lanes: the producer starts step k once step k - lanes is trained, so
    its lane is free. `publish(version)` hands the trainer's factors to every lane
    (NativeRolloutEngine.update_adapter): an idle lane takes them at once; a generating one at its
    next step boundary under rollout.update_policy 'continue' (the cached context computed again
    under them), at its end under 'finish'. The lanes decode eagerly (no CUDA graphs); on CUDA
    untested on hardware."""

    def __init__(self, config: RLConfig, trainer: Trainer, record_routing: bool, version: int) -> None:
        self.trainer = trainer
        lanes = config.rollout.max_staleness + 1
        self.engines = [native_engine(config, trainer, record_routing, lane_model(trainer.model)) for _ in range(lanes)]
        for engine in self.engines:
            # no CUDA graph capture while the trainer's thread runs its own work on the device
            engine.cuda_graphs = False
        self.publish(version)

    def engine(self, step: int) -> NativeRolloutEngine:
        return self.engines[step % len(self.engines)]

    def publish(self, version: int) -> None:
        """Serve the trainer's adapter as it is now as `version` (on the trainer's thread, between
        its updates)."""
        factors = {name: p.detach().clone() for name, p in lora_parameters(self.trainer.model).items()}
        for engine in self.engines:
            engine.update_adapter(version, factors)


def task_servers(servers):
    """A task's handle on the shared vLLM servers (a VLLMRolloutEngine): the same servers and
    session, with a policy of its own, so that its requests name its own adapter version."""
    view = copy.copy(servers)
    view.policy = ServedPolicy()
    return view


def _longest_request(config, tasks, longest_prompt, eval_new_tokens: int) -> tuple[int, int]:
    """(prompt tokens, new tokens) of the longest request of the run: the longest of (longest
    training prompt + rollout tokens) and (longest held-out prompt + eval tokens) over the tasks."""
    requests = []
    for task in tasks:
        if task.episodes is not None:  # whole trajectories: the first prompt, then turns and additions
            framing = task.episodes.framing_tokens(task.config.environment.system_prompt)
            examples = task.train_set.examples + (task.eval_set.examples if task.eval_set is not None else [])
            prompt_tokens = longest_prompt(task, examples) + framing
            new_tokens = task.config.environment.limits.max_tokens
            context = task.episodes.context_tokens
            if context is not None:  # a trajectory never grows past the model's context
                new_tokens = max(min(new_tokens, context - prompt_tokens), 1)
            requests.append((prompt_tokens, new_tokens))
            continue
        requests.append((longest_prompt(task, task.train_set.examples), config.rollout.max_new_tokens))
        if task.eval_set is not None:
            held_out = task.eval_set.examples[: config.eval.max_prompts]
            requests.append((longest_prompt(task, held_out), eval_new_tokens))
    return max(requests, key=sum)


def rollout_servers(config, tasks, longest_prompt, eval_new_tokens: int, rank: int, log_dir: Path):
    """The vLLM servers of a run (a VLLMRolloutEngine), which serve every task's adapters side by
    side: rank 0 launches (or connects to) them, the other ranks connect to the same URLs for their
    share of the generation; rank 0's error, if it has one, is raised on every rank (instead of the
    others waiting for the URLs). Only rank 0 sends adapters (see build_weight_sync).
    `longest_prompt(task, examples)`: the longest prompt of `examples` in tokens."""
    vllm_config = config.rollout.vllm
    ranks = [task.config.lora.max_rank for task in tasks if task.config.lora is not None]
    kwargs = dict(
        model_path=config.model.path,
        lora_rank=max(ranks) if ranks else None,
        log_dir=log_dir,
        update_policy=config.rollout.update_policy,
    )
    launched = []
    if rank == 0:
        # launched servers are sized for the longest request of the run (see VLLMConfig.max_model_len)
        prompt_tokens, new_tokens = _longest_request(config, tasks, longest_prompt, eval_new_tokens)

    def launch() -> list[str]:
        launched.append(
            VLLMRolloutEngine(
                vllm_config, rank=0, longest_prompt_tokens=prompt_tokens, max_new_tokens=new_tokens, **kwargs
            )
        )
        return [s.url for s in launched[0].servers]

    urls = first_rank_then_broadcast(launch)
    if launched:
        return launched[0]
    return VLLMRolloutEngine(dataclasses.replace(vllm_config, urls=tuple(urls)), rank=rank, **kwargs)


def speculative_acceptance(native: NativeRolloutEngine) -> float | None:
    """The share of the draft tokens proposed since the last call that the built-in engine
    accepted (its counts start again); None when it proposed none (every generation past
    rollout.speculative.max_rows)."""
    stats = native.stats
    proposed, accepted = stats.speculative_proposed, stats.speculative_accepted
    stats.speculative_proposed = stats.speculative_accepted = 0
    return accepted / proposed if proposed else None
