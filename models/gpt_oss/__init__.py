from archon.models.gpt_oss import renderer, spec  # noqa: F401  (registers the family and its renderer)
