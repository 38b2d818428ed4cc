from archon.models.olmo3 import renderer, spec  # noqa: F401  (registers the family and its renderer)
