from archon.models.qwen3_next import spec  # noqa: F401  (registers the family)
