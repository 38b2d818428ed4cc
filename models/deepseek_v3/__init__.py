from archon.models.deepseek_v3 import kimi_k2_renderer, renderer, spec  # noqa: F401  (registers the family and its renderers)
