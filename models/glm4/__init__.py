from archon.models.glm4 import (
    spec,  # noqa: F401  (registers the family)
)
