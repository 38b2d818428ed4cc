"""archon.rl.tasks, at its old path for one release: see archon.rl.data.tasks."""

from archon.rl.data.tasks import (  # noqa: F401 - at its old path for one release
    CHARACTERS,
    CHAT_TEMPLATE,
    END_TOKEN,
    OPERATIONS,
    PAD_TOKEN,
    ROLE_TOKENS,
    SPECIAL_TOKENS,
    UNK_TOKEN,
    ArithmeticTaskConfig,
    arithmetic_splits,
    build_char_tokenizer,
    num_distinct_problems,
    write_jsonl,
)
