from archon.models.glm4_moe import spec  # noqa: F401  (registers the family)
