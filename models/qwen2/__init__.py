from archon.models.qwen2 import spec  # noqa: F401  (registers the family)
