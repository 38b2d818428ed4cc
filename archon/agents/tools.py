"""Tools an environment offers the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str | None = None


@dataclass
class ToolResult:
    content: str
    status: str = "ok"
    elapsed_s: float = 0.0


@dataclass
class Tool:
    name: str
    description: str
    parameters: dict
