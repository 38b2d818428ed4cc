from archon.models.nemotron_h import renderer, spec  # noqa: F401  (registers the family and its renderer)
