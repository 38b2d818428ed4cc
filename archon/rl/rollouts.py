"""Moved: what the RL loop does with rollouts lives in archon.rl.run (batches, teachers, engines,
collect, context); its names stay importable from here for one release."""

from archon.rl.run.batches import (  # noqa: F401 - at its old path for one release
    concat_batches,
    filler_batch,
    packed_routed_experts,
    rollout_batch,
)
from archon.rl.run.collect import mixed_rollouts, replace_stale_groups  # noqa: F401 - at its old path for one release
from archon.rl.run.context import prompt_ids  # noqa: F401 - at its old path for one release
from archon.rl.run.engines import (  # noqa: F401 - at its old path for one release
    rollout_servers,
    stop_token_ids,
    task_servers,
)
from archon.rl.run.teachers import (  # noqa: F401 - at its old path for one release
    distill_from_teachers,
    load_teacher,
    teacher_logprobs,
)
