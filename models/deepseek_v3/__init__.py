from archon.models.deepseek_v3 import spec  # noqa: F401  (registers the family)
