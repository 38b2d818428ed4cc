from archon.models.gemma3 import spec  # noqa: F401  (registers the family)
