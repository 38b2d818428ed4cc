from archon.models.minimax_m2 import spec  # noqa: F401
