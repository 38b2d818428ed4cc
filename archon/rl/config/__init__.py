"""The RL recipe's configuration: one tree of dataclasses (schema), exposed on the command line with
tyro (cli: parse_config) and loadable from a YAML or TOML file (files: `--config FILE`, then
command-line overrides), checked together before anything is built (validation: validate).

A file's values are converted by each field's type as tyro converts a flag's text (merge_into), and
validate() checks the settings together; both name the field at fault. Each rule validate() runs has
one home: beside its section's dataclass (schema, demo, archon.rl.algorithms.config,
archon.rl.rewards.config; lower_sections for the sections of the layers below), across sections
(cross_section), or reading files (model_files).
"""

from typing import Any

from archon.rl.config.cli import parse_config
from archon.rl.config.cross_section import MAX_STALENESS, TASK_NAME, TASK_NAME_MAX_CHARS
from archon.rl.config.files import load_config_file, merge_into
from archon.rl.config.schema import (
    AlgorithmConfig,
    CheckpointConfig,
    DemoConfig,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    RLConfig,
    RolloutConfig,
    TaskConfig,
    TeacherConfig,
    warn_renamed,
)
from archon.rl.config.validation import validate

__all__ = [
    "MAX_STALENESS",
    "TASK_NAME",
    "TASK_NAME_MAX_CHARS",
    "AlgorithmConfig",
    "CheckpointConfig",
    "DemoConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "RLConfig",
    "RolloutConfig",
    "TaskConfig",
    "TeacherConfig",
    "load_config_file",
    "merge_into",
    "parse_config",
    "validate",
]


def __getattr__(name: str) -> Any:
    if name == "GRPOConfig":  # the name of RLConfig before the rename, until the next release
        warn_renamed("archon.rl.config.GRPOConfig", "archon.rl.config.RLConfig")
        return RLConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
