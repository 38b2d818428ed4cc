"""Model families. Each import registers a family with archon.spec."""

from archon.models import (
    deepseek_v3,  # noqa: F401
    glm4_moe,  # noqa: F401
    gpt_oss,  # noqa: F401
    llama,  # noqa: F401
    qwen2,  # noqa: F401
    qwen3,  # noqa: F401
    qwen3_5,  # noqa: F401
)
from archon.models import qwen3_next  # noqa: F401
from archon.models import deepseek_v32  # noqa: F401
from archon.models import minimax_m2  # noqa: F401
from archon.models import kimi_linear  # noqa: F401
from archon.models import olmo3  # noqa: F401
from archon.models import gemma3  # noqa: F401
