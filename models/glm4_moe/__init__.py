from archon.models.glm4_moe import renderer, spec  # noqa: F401  (registers the family and its renderer)
