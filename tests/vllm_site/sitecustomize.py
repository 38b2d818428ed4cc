import vllm_engine_core_fork  # noqa: F401
