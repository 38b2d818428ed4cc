from archon.models.olmo3 import spec  # noqa: F401  (registers the family)
