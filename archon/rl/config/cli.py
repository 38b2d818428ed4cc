"""The recipe's command line: every field of RLConfig is a flag (tyro); `--config FILE` supplies the
defaults the other flags override."""

from __future__ import annotations

import sys

from archon.rl.config.files import load_config_file
from archon.rl.config.schema import RLConfig, both_spellings_error, warn_renamed
from archon.rl.config.validation import validate

ALGORITHM_NAME_FLAG = "--algorithm.name"
OLD_ALGORITHM_NAME_FLAG = "--algorithm.loss.algorithm"
"""The spelling of --algorithm.name before the rename, read as it until the next release."""


def _bare_resume_means_latest(argv: list[str]) -> list[str]:
    """`--resume` followed by nothing or by another flag is `--resume latest`."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("--")):
            out.append("latest")
    return out


def _flag_value(argv: list[str], i: int, flag: str) -> str | None:
    """The value given to `flag` at argv[i] (`--flag value` or `--flag=value`); None when there is none."""
    if argv[i] != flag:
        return argv[i].removeprefix(flag + "=")
    return argv[i + 1] if i + 1 < len(argv) else None


def _algorithm_name_alias(argv: list[str]) -> list[str]:
    """`--algorithm.loss.algorithm X`, the spelling before --algorithm.name, as `--algorithm.name X`
    (with a FutureWarning)."""
    old_value = new_value = None
    out = []
    for i, arg in enumerate(argv):
        if arg == ALGORITHM_NAME_FLAG or arg.startswith(ALGORITHM_NAME_FLAG + "="):
            new_value = _flag_value(argv, i, ALGORITHM_NAME_FLAG)
        if arg == OLD_ALGORITHM_NAME_FLAG or arg.startswith(OLD_ALGORITHM_NAME_FLAG + "="):
            old_value = _flag_value(argv, i, OLD_ALGORITHM_NAME_FLAG)
            warn_renamed(OLD_ALGORITHM_NAME_FLAG, ALGORITHM_NAME_FLAG)
            arg = ALGORITHM_NAME_FLAG + arg.removeprefix(OLD_ALGORITHM_NAME_FLAG)
        out.append(arg)
    if old_value is not None and new_value is not None and old_value != new_value:
        raise both_spellings_error(OLD_ALGORITHM_NAME_FLAG, old_value, ALGORITHM_NAME_FLAG, new_value)
    return out


def _warn_on_tensorboard_flag(argv: list[str]) -> None:
    """`--logging.no-tensorboard`, the spelling before --logging.backends, still works until the next
    release (with a FutureWarning)."""
    for arg in argv:
        if arg in ("--logging.tensorboard", "--logging.no-tensorboard") or arg.startswith("--logging.tensorboard="):
            warn_renamed(arg.split("=")[0], "--logging.backends")


def parse_config(argv: list[str] | None = None) -> RLConfig:
    """`--config FILE` (optional) supplies defaults; every other flag overrides them. The result is
    checked with validate(), once: RLRun does not check it again."""
    import tyro

    argv = _bare_resume_means_latest(list(sys.argv[1:] if argv is None else argv))
    argv = _algorithm_name_alias(argv)
    _warn_on_tensorboard_flag(argv)
    default = RLConfig()
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise SystemExit("--config needs a file path")
        default = load_config_file(argv[i + 1])
        del argv[i : i + 2]
    config = tyro.cli(RLConfig, default=default, args=argv)
    validate(config)
    return config
