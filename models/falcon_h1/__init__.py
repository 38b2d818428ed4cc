from archon.models.falcon_h1 import renderer, spec  # noqa: F401  (registers the family and its renderer)
