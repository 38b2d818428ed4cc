from archon.models.nemotron_h import spec  # noqa: F401  (registers the family)
