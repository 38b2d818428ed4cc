"""Secrets in the configuration, kept out of everything a run writes.

A config field that holds a secret is marked in its dataclass (`secret_field`): an API key or token
(`kind="value"`), URLs whose credentials (`scheme://user:password@host`) are secret (`kind="url"`),
or the name of an environment variable that holds a key (`kind="env"`). `register_secrets(config)`
collects the secrets of a config once it is checked; from then on `redact` replaces each of them,
and every URL's credentials, by REDACTED in any text: config dumps (`redacted_config`), tracker
params, model cards and their command line, metrics and sample files, log records
(`RedactingFilter`) and error messages.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import urllib.parse
from typing import Any, Literal

REDACTED = "***"
SECRET = "archon.secret"
"""The key of a dataclass field's metadata that marks it secret; its value is the kind."""
SecretKind = Literal["value", "url", "env"]

URL_CREDENTIALS = re.compile(r"(?P<scheme>\b[A-Za-z][A-Za-z0-9+.\-]*://)(?P<userinfo>[^\s/@'\"<>]+)@")
"""`scheme://USERINFO@`: the credentials part of a URL, wherever it stands in a text."""
_SECRET_EDGE = r"A-Za-z0-9_\-"
"""A registered secret is replaced where it stands as a whole word of these characters (so that a
short key such as `abc` does not also blank the middle of `tabcase`)."""

_registered: set[str] = set()
_lock = threading.Lock()
_pattern: re.Pattern | None = None


def secret_field(default: Any = None, *, kind: SecretKind = "value") -> Any:
    """A dataclass field whose value is secret (`kind`: the value itself, the credentials of the
    URL(s) it holds, or the value of the environment variable it names)."""
    return dataclasses.field(default=default, metadata={SECRET: kind})


def secret_kind(f: dataclasses.Field) -> SecretKind | None:
    return f.metadata.get(SECRET)


def url_credentials(url: str) -> list[str]:
    """The secret parts of `url`'s credentials: `user:password` and the password (or the token of a
    `scheme://TOKEN@host` URL)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        parts = None
    found = [m.group("userinfo") for m in URL_CREDENTIALS.finditer(url)]
    if parts is not None and parts.password:
        found.append(parts.password)
    return [value for value in found if value]


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [s for v in value for s in _strings(v)]
    if isinstance(value, dict):
        return [s for v in value.values() for s in _strings(v)]
    return []


def secret_values(config: Any) -> set[str]:
    """Every secret in the dataclass tree `config` (nested dataclasses, and those in lists, tuples
    and dict values): the values of fields marked secret, the credentials of URL fields, and the
    values of the environment variables that env fields name (those set)."""
    found: set[str] = set()
    if isinstance(config, (list, tuple)):
        for item in config:
            found |= secret_values(item)
        return found
    if isinstance(config, dict):
        for item in config.values():
            found |= secret_values(item)
        return found
    if not dataclasses.is_dataclass(config) or isinstance(config, type):
        return found
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        kind = secret_kind(f)
        if kind == "value":
            found.update(s for s in _strings(value) if s)
        elif kind == "url":
            found.update(c for s in _strings(value) for c in url_credentials(s))
        elif kind == "env":
            found.update(os.environ[s] for s in _strings(value) if s and os.environ.get(s))
        else:
            found |= secret_values(value)
    return found


def register_secrets(config_or_values: Any) -> None:
    """Add the secrets of a config (a dataclass tree), or these strings, to those `redact` replaces
    for the rest of the process."""
    global _pattern
    values = secret_values(config_or_values) if not isinstance(config_or_values, (set, list, tuple)) else None
    if values is None:
        values = {v for v in config_or_values if isinstance(v, str) and v}
    with _lock:
        if values <= _registered:
            return
        _registered.update(values)
        alternatives = "|".join(re.escape(v) for v in sorted(_registered, key=len, reverse=True))
        _pattern = re.compile(rf"(?<![{_SECRET_EDGE}])(?:{alternatives})(?![{_SECRET_EDGE}])")


def forget_secrets() -> None:
    """Drop every registered secret (for tests)."""
    global _pattern
    with _lock:
        _registered.clear()
        _pattern = None


def redact_url(url: str) -> str:
    """`url` with its credentials, if any, replaced: `http://user:pw@host` -> `http://***@host`."""
    return URL_CREDENTIALS.sub(lambda m: f"{m.group('scheme')}{REDACTED}@", url)


def redact(text: str) -> str:
    """`text` with every registered secret and every URL's credentials replaced by REDACTED."""
    text = redact_url(text)
    pattern = _pattern
    return pattern.sub(REDACTED, text) if pattern is not None else text


def redact_value(value: Any) -> Any:
    """A copy of `value` (strings inside dicts, lists and tuples) with `redact` applied to every string."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: redact_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_value(v) for v in value)
    return value


def redacted_config(config: Any) -> dict[str, Any]:
    """`dataclasses.asdict(config)` with each secret field's value (when set) replaced by REDACTED,
    and `redact` applied to every other string."""
    return redact_value(_redacted_fields(config))


def _redacted_fields(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            out[f.name] = REDACTED if secret_kind(f) == "value" and item else _redacted_fields(item)
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(_redacted_fields(v) for v in value)
    if isinstance(value, dict):
        return {k: _redacted_fields(v) for k, v in value.items()}
    return value


class RedactingFilter(logging.Filter):
    """A handler filter that writes each record's message with `redact` applied."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact(message)
        if redacted != message:
            record.msg, record.args = redacted, None
        return True


def redact_logs(logger: logging.Logger | None = None) -> None:
    """Redact every record that `logger`'s handlers (default: the root logger's) write."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())
