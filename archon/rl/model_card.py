"""archon.rl.model_card, at its old path for one release: see archon.rl.logging.model_card."""

from archon.rl.logging.model_card import (  # noqa: F401 - at its old path for one release
    RESULT_METRICS,
    card_metrics,
    launch_command,
    model_card,
    task_export_dir,
)
