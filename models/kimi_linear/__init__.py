from archon.models.kimi_linear import spec  # noqa: F401  (registers the family)
