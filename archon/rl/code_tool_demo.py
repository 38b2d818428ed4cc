"""archon.rl.code_tool_demo, at its old path for one release: see archon.demos.code_tool (and
archon.rl.config.demo for its settings)."""

from archon.demos.code_tool import (  # noqa: F401 - at its old path for one release
    END_OF_TEXT,
    END_OF_TURN,
    TOKENIZER_FILE,
    build_tokenizer,
    demo_renderer,
    episode_success,
    hf_tokenizer,
    operands,
    plan_conversations,
    run_tool_calls,
    sft_trajectories,
    train_tokenizer,
)
from archon.rl.config.demo import (  # noqa: F401 - at its old path for one release
    RENDERER,
    SPECIAL_TOKENS,
    TOOL,
    CodeToolDemoConfig,
    demo_environment_problems,
)
