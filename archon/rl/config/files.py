"""Typed values from YAML and TOML config files.

A file's values are converted by each field's type hint with the rules tyro applies to a flag's
text, so `lr: 1e-3` (a string to PyYAML) is the float a flag would give, and anything a flag would
refuse is an error that names the field.
"""

from __future__ import annotations

import dataclasses
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

from archon.rl.algorithms import AlgorithmName
from archon.rl.config.schema import AlgorithmConfig, LoggingConfig, RLConfig, both_spellings_error, warn_renamed

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the backport
    import tomli as tomllib


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_none(value: Any) -> bool:
    """None, or "None": tyro's spelling of None on the command line (TOML has no null)."""
    return value is None or value == "None"


def _shown(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def _expected(tp: Any) -> str:
    """What a value of type `tp` looks like, for error messages."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "null"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if origin is Literal:
        return "one of " + ", ".join(repr(choice) for choice in typing.get_args(tp))
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return f"a list, each {_expected(args[0])}"
        return f"a list of {len(args)} items ({', '.join(_expected(a) for a in args)})"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_expected(member) for member in typing.get_args(tp))
    if _is_dataclass_type(tp):
        return f"a section (a mapping of {tp.__name__} fields)"
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"a mapping of {_expected(key_tp)} to {_expected(value_tp)}"
    return repr(tp)


class _WrongType(ValueError):
    """A value that does not fit its field's type (within a union, the next member is tried)."""


def _wrong(value: Any, tp: Any, where: str) -> _WrongType:
    hint = " (quote it to make it a string)" if tp is str and value is not None else ""
    return _WrongType(f"{where}: expected {_expected(tp)}, got {_shown(value)}{hint}")


def _convert(value: Any, tp: Any, where: str, current: Any = None) -> Any:
    """`value` (as read from a file) as type `tp`; raises ValueError naming `where`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, tp, where, current)
    if tp is type(None):
        if _is_none(value):
            return None
        raise _wrong(value, tp, where)
    if _is_dataclass_type(tp):
        if not isinstance(value, dict):
            raise _wrong(value, tp, where)
        return merge_into(current if isinstance(current, tp) else tp(), value, where)
    if origin is Literal:
        for choice in typing.get_args(tp):
            if type(value) is type(choice) and value == choice:
                return choice
            if isinstance(value, str) and not isinstance(choice, str) and value == str(choice):
                return choice
        raise _wrong(value, tp, where)
    if origin is tuple or origin is dict:
        return _convert_container(value, tp, where)
    if tp is bool or tp is int or tp is float or tp is str:
        return _convert_scalar(value, tp, where)
    if tp is Any:
        return value
    raise TypeError(f"{where}: config files cannot set a field of type {tp!r}")


def _convert_union(value: Any, tp: Any, where: str, current: Any) -> Any:
    """`value` as the first member of union `tp` that takes it (None for "None" when `tp` allows it)."""
    members = [member for member in typing.get_args(tp) if member is not type(None)]
    if len(members) < len(typing.get_args(tp)) and _is_none(value):
        return None
    if len(members) == 1:
        return _convert(value, members[0], where, current)
    for member in members:
        try:
            return _convert(value, member, where, current)
        except _WrongType:
            continue
    raise _wrong(value, tp, where)


def _convert_container(value: Any, tp: Any, where: str) -> Any:
    """A list as a tuple `tp` (fixed length, or `tuple[X, ...]`), a mapping as a dict `tp`, item by item."""
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            raise _wrong(value, tp, where)
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            args = (args[0],) * len(value)
        elif len(value) != len(args):
            raise _WrongType(f"{where}: expected {_expected(tp)}, got {len(value)} items: {list(value)!r}")
        return tuple(_convert(item, item_tp, f"{where}[{i}]") for i, (item, item_tp) in enumerate(zip(value, args)))
    if not isinstance(value, dict):
        raise _wrong(value, tp, where)
    key_tp, value_tp = typing.get_args(tp)
    return {
        _convert(key, key_tp, f"{where} key {key!r}"): _convert(item, value_tp, f"{where}[{key!r}]")
        for key, item in value.items()
    }


def _convert_scalar(value: Any, tp: type, where: str) -> Any:
    """`value` as a bool, int, float or str `tp`, taking the text of one as a flag's text is taken."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise _wrong(value, tp, where)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise _wrong(value, tp, where)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise _wrong(value, tp, where)
    if isinstance(value, str):
        return value
    raise _wrong(value, tp, where)


def merge_into(instance: Any, values: dict[str, Any], where: str = "") -> Any:
    """A copy of dataclass `instance` with `values` (nested mappings, as read from a file) applied.

    Each value is converted to its field's type; an unknown key, a value of the wrong type, a
    scalar given for a section or a mapping given for a plain field is a ValueError that names the
    field (dotted path from the root).
    """
    if not isinstance(values, dict):
        raise _WrongType(f"{where or 'the config'}: expected {_expected(type(instance))}, got {_shown(values)}")
    if isinstance(instance, AlgorithmConfig):
        values = _algorithm_name_alias(values, where)
    if isinstance(instance, LoggingConfig) and "tensorboard" in values:
        warn_renamed(f"{where}.tensorboard", f"{where}.backends")
    hints = typing.get_type_hints(type(instance))
    names = [f.name for f in dataclasses.fields(instance) if f.init]
    changes = {}
    for key, value in values.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in names:
            raise ValueError(f"unknown config key {path!r}; valid keys here: {', '.join(sorted(names))}")
        if path == "resume" and isinstance(value, bool):  # as on the command line: a bare --resume is "latest"
            value = "latest" if value else None
        changes[key] = _convert(value, hints[key], path, getattr(instance, key))
    try:
        return dataclasses.replace(instance, **changes)
    except (TypeError, ValueError) as e:  # the dataclass's own checks (__post_init__)
        raise ValueError(f"{where or 'the config'}: {e}") from None


def _algorithm_name_alias(values: dict[str, Any], where: str) -> dict[str, Any]:
    """An algorithm section's values with `loss: {algorithm: X}`, the spelling before algorithm.name,
    read as `name: X` (with a FutureWarning)."""
    loss = values.get("loss")
    if not isinstance(loss, dict) or "algorithm" not in loss:
        return values
    old, new = f"{where}.loss.algorithm", f"{where}.name"
    name = _convert(loss["algorithm"], AlgorithmName, old)
    warn_renamed(old, new)
    if "name" in values and _convert(values["name"], AlgorithmName, new) != name:
        raise both_spellings_error(old, name, new, values["name"])
    loss = {key: value for key, value in loss.items() if key != "algorithm"}
    return {**values, "name": name, "loss": loss}


def _read_values(path: Path) -> Any:
    """The parsed contents of a YAML or TOML file; a syntax error is a ValueError (with its line)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".toml":
        return tomllib.loads(text)  # TOMLDecodeError is a ValueError
    import yaml

    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML: {e}") from None
    return {} if values is None else values


def load_config_file(path: str | Path, base: RLConfig | None = None) -> RLConfig:
    """`base` (default: RLConfig()) with the values of a YAML or TOML file; errors and warnings (a
    setting spelled as before a rename) name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    if path.suffix not in (".yaml", ".yml", ".toml"):
        raise ValueError(f"config file {str(path)!r} must end in .yaml, .yml or .toml")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            config = merge_into(base or RLConfig(), _read_values(path))
    except ValueError as e:  # UnicodeDecodeError included
        raise ValueError(f"config file {path}: {e}") from None
    for warning in caught:
        warnings.warn(f"config file {path}: {warning.message}", warning.category, stacklevel=2)
    return config
