"""archon.rl.reasoning_gym_demo, at its old path for one release: see archon.demos.reasoning_gym (and
archon.rl.config.demo for its settings)."""

from archon.demos.reasoning_gym import ANSWER_FORMAT, sft_rows  # noqa: F401 - at its old path for one release
from archon.rl.config.demo import (  # noqa: F401 - at its old path for one release
    ReasoningGymDemoConfig,
    reasoning_gym_demo_problems,
    same_problems,
)
