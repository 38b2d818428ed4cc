"""Model families. Each import registers a family with archon.spec."""

from archon.models import (
    deepseek_v3,  # noqa: F401
    deepseek_v32,  # noqa: F401
    falcon_h1,  # noqa: F401
    gemma3,  # noqa: F401
    glm4,  # noqa: F401
    glm4_moe,  # noqa: F401
    gpt_oss,  # noqa: F401
    kimi_linear,  # noqa: F401
    llama,  # noqa: F401
    minimax_m2,  # noqa: F401
    nemotron_h,  # noqa: F401
    olmo3,  # noqa: F401
    qwen2,  # noqa: F401
    qwen3,  # noqa: F401
    qwen3_5,  # noqa: F401
    qwen3_next,  # noqa: F401
)
