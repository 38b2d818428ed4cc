from archon.models.qwen3_5 import spec  # noqa: F401  (registers the family)
