from archon.models.gpt_oss import spec  # noqa: F401  (registers the family)
