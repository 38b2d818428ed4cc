from archon.models.llama import spec  # noqa: F401  (registers the family)
