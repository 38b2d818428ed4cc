"""forward / forward_backward of training clients: one client's data through its own LoRA model, or
several clients' data in one forward of a multi-LoRA model on the shared frozen base (archon.lora's
task adapters: each client's adapter is one task, and each token is routed to its client's), whose
gradients then go back to each client's own factors. A client's loss and gradients are the same
either way: the rows of one client see only the base and that client's adapter."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from archon.build import LoadedModel, build_model
from archon.lora import adapter_routing, lora_parameters, task_names, task_parameters
from archon.serve.adapters import TrainingModel, share_frozen_base
from archon.serve.losses import datum_loss
from archon.serve.scoring import packed_logprobs
from archon.serve.wire import ForwardBackwardCall

Result = tuple[list[dict[str, np.ndarray]], dict[str, float]]
"""Per datum its outputs by name; the metrics ("loss:sum")."""
CACHED_BATCH_MODELS = 4
"""How many multi-LoRA models (one per list of adapter shapes) are kept for batches."""


@dataclass
class CheckedCall:
    """A forward(_backward) request whose inputs were checked: its client, its datums as (tokens [N],
    loss inputs {name: [N]}) and its loss config."""

    trained: TrainingModel
    call: ForwardBackwardCall
    datums: list[tuple[torch.Tensor, dict[str, torch.Tensor]]]
    config: dict


def _inputs(checked: CheckedCall) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [t for t, _ in checked.datums], [x["target_tokens"] for _, x in checked.datums]


def scored(checked: CheckedCall, logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, list[dict[str, np.ndarray]]]:
    """The call's summed loss (with gradient) and its per-datum outputs, from its datums' log-probs."""
    loss_fn = checked.call.loss_fn
    losses, outputs = [], []
    for lp, (_, inputs) in zip(logprobs, checked.datums):
        inputs = {k: v.to(lp.device, lp.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
        losses.append(datum_loss(loss_fn, lp, inputs, checked.config))
        out = {"logprobs": lp.detach().float().cpu().numpy()}
        if loss_fn == "cross_entropy":
            weights = inputs.get("weights", torch.ones_like(lp))
            out["elementwise_loss"] = (-lp.detach() * weights).float().cpu().numpy()
        outputs.append(out)
    return torch.stack(losses).sum(), outputs


def run_alone(checked: CheckedCall, device, data_parallel: int = 1) -> Result:
    """One client's request through its own model. data_parallel: the ranks that each run this whole
    batch and whose gradients FSDP2 sums (each scales its loss by 1 / data_parallel)."""
    model = checked.trained.model
    model.train()
    with torch.set_grad_enabled(not checked.call.forward_only):
        total, outputs = scored(checked, packed_logprobs(model, *_inputs(checked), device))
        if not checked.call.forward_only:
            (total / data_parallel).backward()
    return outputs, {"loss:sum": float(total.detach())}


class ClientBatcher:
    """Runs several clients' requests (distinct clients, all forward or all forward_backward) in one
    forward of a multi-LoRA model whose task i holds client i's adapter."""

    def __init__(self, base: LoadedModel, path: str, dtype: torch.dtype, device: str) -> None:
        self.base, self.path, self.dtype, self.device = base, path, dtype, device
        self._models: OrderedDict[tuple, tuple[LoadedModel, list[dict[str, torch.nn.Parameter]]]] = OrderedDict()

    def _model(self, clients: list[TrainingModel]) -> tuple[LoadedModel, list[dict[str, torch.nn.Parameter]]]:
        """The multi-LoRA model for these clients' adapter shapes, and each task's factors by the
        single-adapter names the clients' models use."""
        key = tuple((c.lora.rank, c.lora.alpha, tuple(c.lora.target_modules)) for c in clients)
        if key not in self._models:
            task_loras = {f"client{i}": c.lora for i, c in enumerate(clients)}
            loaded = build_model(self.path, task_loras=task_loras, dtype=self.dtype, device=self.device)
            share_frozen_base(loaded.model, self.base.model)
            self._models[key] = (loaded, [task_parameters(loaded.model, t) for t in task_names(loaded.model)])
            while len(self._models) > CACHED_BATCH_MODELS:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return self._models[key]

    def run(self, group: list[CheckedCall]) -> list[Result]:
        loaded, task_params = self._model([c.trained for c in group])
        forward_only = group[0].call.forward_only
        with torch.no_grad():
            for checked, params in zip(group, task_params):
                for name, value in lora_parameters(checked.trained.model).items():
                    params[name].copy_(value)
                    params[name].grad = None
        inputs, targets, tasks = [], [], []
        for i, checked in enumerate(group):
            tokens, labels = _inputs(checked)
            inputs += tokens
            targets += labels
            tasks += [torch.full((int(t.numel()),), i, dtype=torch.long) for t in tokens]
        model = loaded.model
        model.train()
        results, totals = [], []
        with torch.set_grad_enabled(not forward_only), adapter_routing(model, torch.cat(tasks).to(self.device)):
            logprobs = packed_logprobs(model, inputs, targets, self.device)
            start = 0
            for checked in group:
                total, outputs = scored(checked, logprobs[start : start + len(checked.datums)])
                start += len(checked.datums)
                totals.append(total)
                results.append((outputs, {"loss:sum": float(total.detach())}))
            if not forward_only:
                torch.stack(totals).sum().backward()
        if not forward_only:
            self._give_back_gradients(group, task_params)
        return results

    @staticmethod
    def _give_back_gradients(group: list[CheckedCall], task_params: list[dict[str, torch.nn.Parameter]]) -> None:
        """Add each task's gradients to its client's factors (which accumulate until optim_step)."""
        with torch.no_grad():
            for checked, params in zip(group, task_params):
                for name, param in lora_parameters(checked.trained.model).items():
                    grad = params[name].grad
                    if grad is None:
                        continue
                    param.grad = grad.clone() if param.grad is None else param.grad + grad
                    params[name].grad = None
