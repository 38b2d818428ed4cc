"""The trainer: what the RL loop uses of a built model.

`Trainer` gives `logprobs` (policy, or reference with the adapter off) and `train_step`
(micro-batches by token budget, accumulation, clipping, AdamW, LR schedule, and skipping any
update whose loss or gradient is not finite), plus resume checkpoints and PEFT export, which
refuse to write NaN or inf.

With `TrainerConfig.tasks` it trains several adapters (multi-LoRA) on the one frozen base: each
task has its own LoRA config, AdamW, LR schedule and optimizer-step count (archon.optim). A packed
batch then mixes tasks (`extras["task"]`, each token's task index) and `train_step` takes one loss
function per task and steps each task's optimizer on its own (a non-finite task is skipped alone);
checkpoints and PEFT exports are per task (`task=`). One adapter is the case of one task.

Data layout: every data-parallel rank passes its own PackedBatch; the ranks of one tensor-parallel
group pass the same one.

Layout: config (TrainerConfig, TrainerTask, the PackedBatch.extras keys), trainer (Trainer: the
model, its adapters, the log-prob forward and scoring), training (its train step), checkpoints
(its resume checkpoints and PEFT export).
"""

from archon.loss_context import LossContext, loss_counts  # noqa: F401 - imported from here by loss functions and tests
from archon.optim import OptimConfig  # noqa: F401 - imported from here with TrainerConfig
from archon.trainer.checkpoints import NonFiniteError
from archon.trainer.config import ROUTED_EXPERTS_EXTRA, SINGLE_ADAPTER, TASK_EXTRA, TrainerConfig, TrainerTask
from archon.trainer.trainer import LogprobOutput, Trainer, mtp_step_loss

__all__ = [
    "ROUTED_EXPERTS_EXTRA",
    "SINGLE_ADAPTER",
    "TASK_EXTRA",
    "LogprobOutput",
    "NonFiniteError",
    "Trainer",
    "TrainerConfig",
    "TrainerTask",
    "mtp_step_loss",
]
