from archon.models.qwen3_5 import (
    renderer,  # noqa: F401  (registers the renderer)
    spec,  # noqa: F401  (registers the family)
)
