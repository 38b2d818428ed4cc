from archon.models.llama import spec  # noqa: F401  (registers the family)
from archon.models.llama import renderer  # noqa: F401  (registers the renderer)
