from models.qwen2 import spec  # noqa: F401  (registers the family)
