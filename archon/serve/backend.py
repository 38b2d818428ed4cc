"""What the Tinker-compatible server computes: training clients (one LoRA adapter each on the shared
frozen base) with forward, forward_backward (several clients' requests in one forward, see
training.py) and optim_step; their checkpoints; and samplers (a snapshot of an adapter, or the base)
served by the built-in engine or by vLLM (vllm_sampler.py). Under torchrun every rank holds one
Backend, its models laid out by config.parallel (FSDP2, TP, EP), and runs the calls rank 0
broadcasts (ranks.py).

Every method runs on the server's one worker thread (archon/serve/server.py), so the models see one
request at a time, in the order they arrived. A refused request raises UserError naming what is
wrong and changes nothing.
"""

from __future__ import annotations

import functools
import random
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from archon.build import build_model
from archon.lora import LoRAConfig, lora_parameters
from archon.parallel import ParallelDims, reduce_partial_grads
from archon.parallel.grad import clip_grad_norm
from archon.parallel.parallelize import DTYPES
from archon.rollout.native import NativeRolloutEngine
from archon.serve import adapters as ckpt
from archon.serve.adapters import TrainingModel, UserError
from archon.serve.config import ServeConfig
from archon.serve.losses import FLOAT_INPUTS, LOSS_INPUTS, check_config
from archon.serve.sampling import SampleCall, run_samples
from archon.serve.training import CheckedCall, ClientBatcher, Result, run_alone
from archon.serve.vllm_sampler import VLLMSampler
from archon.serve.wire import ForwardBackwardCall, SampledOut, WireTensor


@dataclass
class Session:
    session_id: str
    last_heartbeat: float = field(default_factory=time.monotonic)
    ended: bool = False
    model_seq_ids: set[int] = field(default_factory=set)


@dataclass
class Sampler:
    sampling_session_id: str
    session_id: str
    model_path: str | None
    lora: LoRAConfig | None
    """None: the base model, no adapter."""
    tensors: dict[str, torch.Tensor] | None


def _lora_key(lora: LoRAConfig) -> tuple:
    return (lora.rank, lora.alpha, tuple(lora.target_modules))


class Backend:
    """dims: the layout under torchrun (config.parallel's, archon/serve/ranks.py), None in one process; rank: this
    process's rank (rank 0 writes the checkpoints). id_seed: the seed of the ids it hands out, the
    same on every rank (default: a random one)."""

    def __init__(
        self, config: ServeConfig, dims: ParallelDims | None = None, rank: int = 0, id_seed: int | None = None
    ) -> None:
        self.config = config
        self.dtype = DTYPES[config.dtype]
        self.dims = dims if dims is not None and dims.distributed else None
        self.layout = {} if self.dims is None else {"dims": self.dims, "parallel": config.parallel}
        self.data_parallel = 1 if self.dims is None else self.dims.dp
        """Every data-parallel rank runs the whole batch and FSDP2 (and EP's all-to-all) sums their
        gradients: each rank's loss is scaled by 1 / this before its backward. Tensor-parallel ranks
        are one data-parallel rank."""
        self.writes = rank == 0
        self._ids = random.Random(uuid.uuid4().int if id_seed is None else id_seed)
        self.base = build_model(config.base_model, lora=None, dtype=self.dtype, device=config.device, **self.layout)
        for param in self.base.model.parameters():
            param.requires_grad_(False)
        self.base.model.eval()
        self.vocab_size = int(self.base.model.output_weight.shape[0])
        text_config = self.base.hf_config.get_text_config()
        self.context_length = config.max_context_length or int(text_config.max_position_embeddings)
        eos = text_config.eos_token_id
        self.eos_token_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        self.model_name = config.model_name or config.base_model
        self.checkpoint_root = Path(config.checkpoint_dir)
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, TrainingModel] = {}
        self.samplers: dict[str, Sampler] = {}
        self._sampling_models: dict[tuple, tuple[NativeRolloutEngine, list]] = {}
        """One model per LoRA shape that samplers of that shape load their factors into, with its
        engine and the id of the sampler whose factors it holds."""
        self._base_engine = NativeRolloutEngine(self.base.model, device=config.device)
        self._batcher = ClientBatcher(self.base, config.base_model, self.dtype, config.device)
        self.training_batch_sizes: list[int] = []
        """How many clients' requests each training forward served (the last 1000)."""
        self.generation_sizes: list[int] = []
        """How many sample requests each generation served (the last 1000)."""
        self._tokenizer = None
        self.vllm = None
        if config.sampler == "vllm":
            if self.dims is not None:
                raise ValueError("--sampler vllm is not served under torchrun yet: start one process")
            self.vllm = VLLMSampler(config, self.context_length, self.checkpoint_root)

    def new_id(self, digits: int) -> str:
        return f"{self._ids.getrandbits(4 * digits):0{digits}x}"

    # ---- sessions -------------------------------------------------------------------------------
    def create_session(self) -> str:
        session_id = f"session-{self.new_id(12)}"
        self.sessions[session_id] = Session(session_id)
        return session_id

    def session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"unknown session id {session_id!r}")
        if session.ended:
            raise UserError(f"session {session_id!r} has ended")
        return session

    def end_session(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"unknown session id {session_id!r}")
        session.ended = True
        for model_id in [m for m, t in self.models.items() if t.session_id == session_id]:
            del self.models[model_id]
        for sampler_id in [s for s, v in self.samplers.items() if v.session_id == session_id]:
            del self.samplers[sampler_id]
            if self.vllm is not None:
                self.vllm.unload(sampler_id)

    def check_base_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.config.base_model):
            raise UserError(f"unknown base model {name!r}: this server holds {self.model_name!r}")

    # ---- training clients -----------------------------------------------------------------------
    def create_model(
        self, session_id: str, model_seq_id: int, base_model: str | None, rank: int, seed: int | None, targets
    ) -> str:
        """targets: (train_attn, train_mlp, train_unembed)."""
        self.session(session_id)
        self.check_base_model(base_model)
        if not 1 <= rank <= self.config.max_lora_rank:
            raise UserError(
                f"lora_config.rank={rank} is outside [1, {self.config.max_lora_rank}] (the server's --max-lora-rank)"
            )
        modules = ckpt.lora_targets(self.base.spec.lora_targets, *targets)
        lora = LoRAConfig(rank=rank, alpha=self.config.lora_alpha, target_modules=modules)
        return self._add_model(session_id, model_seq_id, lora, self.config.seed if seed is None else seed)

    def _add_model(self, session_id: str, model_seq_id: int, lora: LoRAConfig, seed: int) -> str:
        model_id = f"{session_id}:train:{model_seq_id}"
        if model_id in self.models:
            raise UserError(f"model {model_id!r} exists already (model_seq_id {model_seq_id} reused)")
        if lora.max_rank > self.config.max_lora_rank:
            raise UserError(
                f"LoRA rank {lora.max_rank} is above the server's --max-lora-rank {self.config.max_lora_rank}"
            )
        loaded = ckpt.build_adapter_model(
            self.base, self.config.base_model, lora, self.dtype, self.config.device, seed, **self.layout
        )
        self.models[model_id] = TrainingModel(model_id, session_id, loaded, lora, ckpt.new_optimizer(loaded.model))
        self.sessions[session_id].model_seq_ids.add(model_seq_id)
        return model_id

    def model(self, model_id: str) -> TrainingModel:
        trained = self.models.get(model_id)
        if trained is None:
            session_id = model_id.split(":", 1)[0]
            if session_id in self.sessions and self.sessions[session_id].ended:
                raise UserError(f"model {model_id!r} belongs to session {session_id!r}, which has ended")
            raise UserError(f"unknown model id {model_id!r}")
        return trained

    def info(self, model_id: str) -> dict:
        trained = self.model(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_name": self.model_name,
            "is_lora": True,
            "lora_rank": trained.lora.rank,
            "model_data": {
                "arch": self.base.hf_config.model_type,
                "model_name": self.model_name,
                "tokenizer_id": self.config.base_model,
            },
        }

    def _datum_tensors(self, i: int, tokens: list[int], inputs: dict[str, WireTensor], loss_fn: str):
        """(tokens [N], loss inputs [N] each as float64/long tensors), checked against the loss."""
        self.check_tokens(f"data[{i}].model_input", tokens)
        n = len(tokens)
        required, optional = LOSS_INPUTS[loss_fn]
        missing = [name for name in required if name not in inputs]
        if missing:
            raise UserError(
                f"data[{i}].loss_fn_inputs lacks {missing} for loss_fn {loss_fn!r} (needs {list(required)})"
            )
        unknown = sorted(set(inputs) - set(required) - set(optional))
        if unknown:
            raise UserError(f"data[{i}].loss_fn_inputs has {unknown}, which loss_fn {loss_fn!r} does not take")
        out = {}
        for name, tensor in inputs.items():
            want = "float32" if name in FLOAT_INPUTS else "int64"
            if tensor.dtype != want or tensor.array.shape != (n,):
                raise UserError(
                    f"data[{i}].loss_fn_inputs[{name!r}] is {tensor.dtype} of shape {list(tensor.array.shape)}; "
                    f"loss_fn {loss_fn!r} needs {want} of shape [{n}] (one per model_input token)"
                )
            out[name] = torch.from_numpy(np.asarray(tensor.array))
        self.check_tokens(f"data[{i}].loss_fn_inputs['target_tokens']", out["target_tokens"].tolist())
        return torch.tensor(tokens, dtype=torch.long), out

    def check_tokens(self, what: str, tokens: list[int]) -> None:
        if not tokens:
            raise UserError(f"{what} is empty")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise UserError(f"{what} holds token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        if len(tokens) > self.context_length:
            raise UserError(f"{what} has {len(tokens)} tokens, over the context limit of {self.context_length}")

    def _checked(self, call: ForwardBackwardCall) -> CheckedCall:
        trained = self.model(call.model_id)
        if call.loss_fn not in LOSS_INPUTS:
            raise UserError(
                f"loss_fn {call.loss_fn!r} is not served here; served: {sorted(LOSS_INPUTS)} (a custom loss runs "
                "in the SDK: forward_backward_custom, whose forward and backward passes are cross_entropy)"
            )
        if not call.data:
            raise UserError("forward_backward got no data")
        try:
            check_config(call.loss_fn, call.loss_fn_config)
        except ValueError as e:
            raise UserError(str(e)) from None
        datums = [self._datum_tensors(i, d.tokens, d.inputs, call.loss_fn) for i, d in enumerate(call.data)]
        return CheckedCall(trained, call, datums, dict(call.loss_fn_config))

    def forward_backward_many(self, calls: list[ForwardBackwardCall]) -> list[Result]:
        """Requests of distinct clients, all forward or all forward_backward, in one forward (a single
        request: through its client's own model); a bad request among them raises UserError (the
        caller then runs them one by one)."""
        checked = [self._checked(call) for call in calls]
        if len(checked) == 1:
            results = [run_alone(checked[0], self.config.device, self.data_parallel)]
        else:
            clients, passes = {c.call.model_id for c in checked}, {c.call.forward_only for c in checked}
            if len(clients) < len(checked) or len(passes) > 1:
                raise ValueError("a batch of forward_backward requests needs distinct clients and one kind of pass")
            results = self._batcher.run(checked)
        self.training_batch_sizes = [*self.training_batch_sizes[-999:], len(calls)]
        return results

    def forward_backward(self, call: ForwardBackwardCall) -> Result:
        return self.forward_backward_many([call])[0]

    def optim_step(self, model_id: str, params: dict) -> dict:
        trained = self.model(model_id)
        lr, wd = float(params.get("learning_rate", 1e-4)), float(params.get("weight_decay", 0.0))
        clip = float(params.get("grad_clip_norm", 0.0))
        betas = (float(params.get("beta1", 0.9)), float(params.get("beta2", 0.95)))
        eps = float(params.get("eps", 1e-12))
        if lr < 0 or wd < 0 or eps <= 0 or not all(0 <= b < 1 for b in betas):
            raise UserError(
                f"adam_params out of range: learning_rate={lr}, beta1/2={betas}, eps={eps}, weight_decay={wd}"
            )
        reduce_partial_grads(trained.model)  # TP/EP: factors acting on sharded activations hold partial sums
        norm = clip_grad_norm(trained.optimizer.param_groups[0]["params"], clip)
        for group in trained.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=wd)
        trained.optimizer.step()
        trained.optimizer.zero_grad(set_to_none=True)
        trained.steps += 1
        return {"metrics": {"grad_norm:mean": float(norm)}}

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, model_id: str, name: str | None, kind: str, overwrite: bool) -> str:
        """kind "weights" (save_state: adapter and optimizer) or "sampler_weights" (the adapter)."""
        trained = self.model(model_id)
        name = name or f"step-{trained.steps:06d}-{self.new_id(6)}"
        self._check_optimizer_state(kind == "weights", "save_state")
        return ckpt.save_checkpoint(
            self.checkpoint_root, trained, kind, name, self.config.base_model, kind == "weights", overwrite, self.writes
        )

    def _check_optimizer_state(self, with_optimizer: bool, what: str) -> None:
        if with_optimizer and self.dims is not None:
            raise UserError(
                f"{what}: optimizer state checkpoints are not served under torchrun yet (the adapter alone is: "
                "save_weights_for_sampler, load_state without the optimizer)"
            )

    def load(self, model_id: str | None, path: str, optimizer: bool, session_id: str | None, model_seq_id) -> str:
        directory = ckpt.checkpoint_dir(self.checkpoint_root, path)
        self._check_optimizer_state(optimizer, "load_state_with_optimizer")
        if model_id is None:  # create-via-load: the checkpoint's LoRA config makes the model
            if session_id is None or model_seq_id is None:
                raise UserError("load_weights needs model_id, or session_id with model_seq_id")
            self.session(session_id)
            model_id = self._add_model(session_id, model_seq_id, ckpt.checkpoint_lora(directory), self.config.seed)
        ckpt.load_checkpoint(directory, self.model(model_id), optimizer)
        return model_id

    # ---- samplers -------------------------------------------------------------------------------
    def sampler_from_model(self, model_id: str, session_id: str) -> str:
        trained = self.model(model_id)
        sampler_id = self._add_sampler(session_id, None, trained.lora, trained.lora_tensors())
        if self.vllm is not None:
            self.vllm.load_trained(sampler_id, trained)
        return sampler_id

    def create_sampler(self, session_id: str, model_path: str | None, base_model: str | None) -> str:
        self.session(session_id)
        if model_path is None:
            if base_model is None:
                raise UserError("create_sampling_session needs model_path or base_model")
            self.check_base_model(base_model)
            return self._add_sampler(session_id, None, None, None)
        directory = ckpt.checkpoint_dir(self.checkpoint_root, model_path)
        lora = ckpt.checkpoint_lora(directory)
        engine, _ = self._sampling_model(lora)
        ckpt.load_peft_adapter(engine.model, self._sampling_converter, directory / "adapter")
        self._sampling_models[_lora_key(lora)][1][0] = None
        tensors = {name: p.detach().clone() for name, p in lora_parameters(engine.model).items()}
        sampler_id = self._add_sampler(session_id, model_path, lora, tensors)
        if self.vllm is not None:
            self.vllm.load_checkpoint(sampler_id, directory / "adapter")
        return sampler_id

    def _add_sampler(self, session_id, model_path, lora, tensors) -> str:
        sampler_id = f"{session_id}:sample:{self.new_id(8)}"
        self.samplers[sampler_id] = Sampler(sampler_id, session_id, model_path, lora, tensors)
        return sampler_id

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            session_id = sampler_id.split(":", 1)[0]
            if session_id in self.sessions and self.sessions[session_id].ended:
                raise UserError(f"sampler {sampler_id!r} belongs to session {session_id!r}, which has ended")
            raise UserError(f"unknown sampling session id {sampler_id!r}")
        return sampler

    def _sampling_model(self, lora: LoRAConfig) -> tuple[NativeRolloutEngine, list]:
        key = _lora_key(lora)
        if key not in self._sampling_models:
            loaded = ckpt.build_adapter_model(
                self.base, self.config.base_model, lora, self.dtype, self.config.device, self.config.seed, **self.layout
            )
            self._sampling_converter = loaded.converter
            engine = NativeRolloutEngine(loaded.model, device=self.config.device)
            self._sampling_models[key] = (engine, [None])
        return self._sampling_models[key]

    def engine_for(self, sampler: Sampler) -> NativeRolloutEngine:
        """The engine whose model now holds `sampler`'s adapter (or the base's engine)."""
        if sampler.lora is None:
            return self._base_engine
        engine, holder = self._sampling_model(sampler.lora)
        if holder[0] != sampler.sampling_session_id:
            params = lora_parameters(engine.model)
            with torch.no_grad():
                for name, tensor in sampler.tensors.items():
                    params[name].copy_(tensor)
            holder[0] = sampler.sampling_session_id
        return engine

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                self._tokenizer = AutoTokenizer.from_pretrained(self.config.base_model)
            except (OSError, ValueError) as e:
                raise UserError(f"stop strings need the base model's tokenizer, which does not load: {e}") from None
        return self._tokenizer

    def _checked_max_tokens(self, call: SampleCall) -> int:
        self.sampler(call.sampling_session_id)
        self.check_tokens("prompt", call.prompt)
        max_tokens = call.max_tokens or self.config.default_max_tokens
        if len(call.prompt) + max_tokens > self.context_length:
            raise UserError(
                f"prompt of {len(call.prompt)} tokens + max_tokens {max_tokens} is over the context limit of "
                f"{self.context_length}"
            )
        for token in call.stop_token_ids or ():
            if not 0 <= token < self.vocab_size:
                raise UserError(f"stop token id {token} is outside the vocabulary [0, {self.vocab_size})")
        return max_tokens

    def sample_many(self, calls: list[SampleCall]) -> list[tuple[list[SampledOut], dict]]:
        """Requests of one sampling.batch_key (or a single request) in one generation; a bad request
        among them raises UserError (the caller then runs them one by one)."""
        max_tokens = [self._checked_max_tokens(call) for call in calls][0]
        tokenizer = self.tokenizer if calls[0].stop_strings else None
        sampler = self.sampler(calls[0].sampling_session_id)
        engine = self.engine_for(sampler)
        generate = None
        if self.vllm is not None:
            adapter = None if sampler.lora is None else sampler.sampling_session_id
            generate = functools.partial(self.vllm.generate, adapter)
        results = run_samples(engine, calls, max_tokens, self.eos_token_ids, tokenizer, generate)
        self.generation_sizes = [*self.generation_sizes[-999:], len(calls)]
        return results

    def sample(self, call: SampleCall) -> tuple[list[SampledOut], dict]:
        return self.sample_many([call])[0]

    def close(self) -> None:
        """Stop the vLLM servers of --sampler vllm (if any)."""
        if self.vllm is not None:
            self.vllm.close()
