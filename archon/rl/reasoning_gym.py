"""archon.rl.reasoning_gym, at its old path for one release: see archon.rl.data.reasoning_gym."""

from archon.rl.data.reasoning_gym import (  # noqa: F401 - at its old path for one release
    DEFAULT_SEED,
    DEFAULT_SIZE,
    REFERENCE_KEY,
    SOURCE_PREFIX,
    ReasoningGymSource,
    default_system_prompt,
    extract_answer,
    is_source,
    load_entries,
    parse_source,
    reasoning_gym_overlap,
    reasoning_gym_reward,
    source_problem,
    task_problem,
)
