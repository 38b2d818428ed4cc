from archon.models.deepseek_v3 import renderer, spec  # noqa: F401  (registers the family and its renderer)
