from archon.models.minimax_m2 import renderer, spec  # noqa: F401  (registers the family and its renderer)
