from archon.models.glm4 import (
    renderer,  # noqa: F401  (registers the renderer)
    spec,  # noqa: F401  (registers the family)
)
