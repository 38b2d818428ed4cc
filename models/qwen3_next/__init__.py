from archon.models.qwen3_next import renderer, spec  # noqa: F401  (registers the family and its renderer)
