from archon.models.qwen3 import spec  # noqa: F401  (registers the family)
