from archon.models.deepseek_v32 import spec  # noqa: F401  (registers the family)
