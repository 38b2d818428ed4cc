"""archon.rl.demo, at its old path for one release: see archon.demos.warm_start."""

from archon.demos.warm_start import (  # noqa: F401 - at its old path for one release
    CODE_TOOL_CONTEXT,
    CONTEXT,
    HELD_OUT_FILE,
    PACKAGED_WARM_STARTS,
    SFT_CONVERSATIONS_FILE,
    SFT_MODEL,
    TRAIN_FILE,
    DemoFiles,
    WarmStartSettings,
    main,
    packaged_tokenizer,
    packaged_warm_start,
    prepare_demo,
)

if __name__ == "__main__":
    main()
