"""What the config checks find: one line a problem, `field=value: rule`. Each section's rules sit
beside its dataclass and the rules across sections in archon.rl.config; archon.rl.config.validation
runs them all and raises with every problem at once."""

from __future__ import annotations

from typing import Any


class Problems(list):
    """Problems found, one line each, `field=value: rule`."""

    def require(self, ok: bool, name: str, value: Any, rule: str) -> None:
        if not ok:
            self.append(f"{name}={value!r}: {rule}")
