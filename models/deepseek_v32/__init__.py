from archon.models.deepseek_v32 import renderer, spec  # noqa: F401  (registers the family and its renderer)
