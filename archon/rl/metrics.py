"""archon.rl.metrics, at its old path for one release: see archon.rl.logging.metrics."""

from archon.rl.logging.metrics import (  # noqa: F401 - at its old path for one release
    METRICS_FILE,
    MetricsLogger,
    read_metrics,
)
