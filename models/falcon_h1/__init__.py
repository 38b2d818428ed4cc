from archon.models.falcon_h1 import spec  # noqa: F401  (registers the family)
