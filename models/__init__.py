"""Model families. Each import registers a family with archon.spec."""

from models import qwen3  # noqa: F401
from models import llama  # noqa: F401
from models import gpt_oss  # noqa: F401
from models import qwen2  # noqa: F401
from models import glm4_moe  # noqa: F401
from models import deepseek_v3  # noqa: F401
