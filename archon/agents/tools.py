"""Tools a model may call: their JSON schemas, and a runner that runs calls in worker processes.

    tool = Tool.from_function("my_tools:lookup")          # or the function itself
    with ToolRunner([tool], timeout_s=10.0) as runner:
        result = runner.call(ToolCall("lookup", {"word": "archon"}))   # ToolResult(content, status, elapsed_s)

A tool function takes JSON-typed, annotated parameters and returns a string or a JSON-able value.
The runner never runs it in this process: calls go to `num_workers` worker processes
(`python -m archon.agents.tools PARENT_PID`, speaking the framing of archon.workers) under
an address-space limit; a worker that times out or dies is killed and replaced. Every failure is a
`ToolResult` with a status, never an exception, so one bad call cannot stop a rollout.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import pickle
import re
import resource
import threading
import time
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Literal, Sequence

from archon.agents.renderer import ToolCall
from archon.workers import WorkerPool, import_function, run_on_workers, serve

ToolStatus = Literal["ok", "error", "timeout", "unknown_tool", "bad_arguments", "output_truncated", "memory"]

PEAK_MEMORY_FRACTION = 0.8
"""A worker that dies with its peak resident memory at this fraction of its limit or more died of the limit."""

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
_ARGS_HEADER = re.compile(r"^(Args|Arguments|Parameters):\s*$")
_SECTION_HEADER = re.compile(r"^[A-Z][A-Za-z ]*:\s*$")


def _type_schema(hint: Any, where: str) -> dict[str, Any]:
    """The JSON schema of a parameter's type hint; `where` names the parameter in errors."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    if hint is list or origin is list:
        return {"type": "array", "items": _type_schema(args[0], where)} if args else {"type": "array"}
    if hint is dict or origin is dict:
        if args and args[0] is not str:
            raise ValueError(f"{where}: a dict's keys must be str (JSON object keys), got {hint}")
        return {"type": "object", "additionalProperties": _type_schema(args[1], where)} if args else {"type": "object"}
    if origin is Literal:
        schema: dict[str, Any] = {"enum": list(args)}
        kinds = {type(value) for value in args}
        if len(kinds) == 1 and next(iter(kinds)) in _JSON_TYPES:
            schema = {"type": _JSON_TYPES[next(iter(kinds))], **schema}
        elif not kinds <= set(_JSON_TYPES) | {type(None)}:
            raise ValueError(f"{where}: Literal values must be str, int, float, bool or None, got {hint}")
        return schema
    if origin in (typing.Union, types.UnionType) and type(None) in args and len(args) == 2:
        (inner,) = [arg for arg in args if arg is not type(None)]
        return {"anyOf": [_type_schema(inner, where), {"type": "null"}]}
    raise ValueError(
        f"{where}: unsupported type hint {hint!r}; use str, int, float, bool, list[...], dict, Literal[...] or X | None"
    )


def _docstring_parts(doc: str | None) -> tuple[str, dict[str, str]]:
    """A Google-style docstring -> (its first paragraph, {parameter: description from `Args:`})."""
    lines = inspect.cleandoc(doc or "").split("\n")
    paragraph = []
    for line in lines:
        if not line.strip() or _ARGS_HEADER.match(line.strip()):
            break
        paragraph.append(line.strip())
    descriptions: dict[str, str] = {}
    in_args, current, entry_indent = False, None, None
    for line in lines:
        stripped, indent = line.strip(), len(line) - len(line.lstrip())
        if _ARGS_HEADER.match(line):
            in_args, current, entry_indent = True, None, None
            continue
        if not in_args or not stripped:
            continue
        if indent == 0 and _SECTION_HEADER.match(line):
            in_args = False
            continue
        entry = re.match(r"^(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$", stripped)
        if entry and (entry_indent is None or indent <= entry_indent):
            entry_indent = indent
            current = entry.group(1).lstrip("*")
            descriptions[current] = entry.group(2)
        elif current is not None:
            descriptions[current] = f"{descriptions[current]} {stripped}".strip()
    return " ".join(paragraph), descriptions


def _function_label(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


@dataclass
class Tool:
    """A tool: what the model is told (`name`, `description`, `parameters`, a JSON schema object)
    and what runs it (`function`: a callable that can be pickled by reference, such as a module's
    top-level function, or its spec "package.module:function")."""

    name: str
    description: str
    parameters: dict[str, Any]
    function: Callable[..., Any] | str

    @classmethod
    def from_function(cls, fn_or_spec: Callable[..., Any] | str, name: str | None = None) -> "Tool":
        """A tool whose schema comes from the function's signature and its Google-style docstring:
        the description is the docstring's first paragraph, a parameter's description its `Args:`
        entry, and the parameters without a default are required."""
        fn = resolve_function(fn_or_spec) if isinstance(fn_or_spec, str) else fn_or_spec
        label = f"tool function {_function_label(fn)}"
        try:
            hints = typing.get_type_hints(fn)
        except Exception as exc:  # noqa: BLE001 - an annotation that does not evaluate
            raise ValueError(f"{label}: its type hints cannot be evaluated: {type(exc).__name__}: {exc}") from exc
        description, documented = _docstring_parts(fn.__doc__)
        properties: dict[str, Any] = {}
        required = []
        for parameter in inspect.signature(fn).parameters.values():
            where = f"{label}, parameter {parameter.name!r}"
            if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
                raise ValueError(f"{where}: *args and **kwargs cannot be described to the model; name each parameter")
            if parameter.kind is parameter.POSITIONAL_ONLY:
                raise ValueError(f"{where}: positional-only parameters cannot be passed by name")
            if parameter.name not in hints:
                raise ValueError(f"{where} has no type hint")
            schema = _type_schema(hints[parameter.name], where)
            if parameter.name in documented:
                schema["description"] = documented[parameter.name]
            properties[parameter.name] = schema
            if parameter.default is parameter.empty:
                required.append(parameter.name)
        parameters = {"type": "object", "properties": properties, "required": required}
        return cls(name=name or fn.__name__, description=description, parameters=parameters, function=fn_or_spec)

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-tool form that HF chat templates take as `tools=`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


def resolve_function(spec: str) -> Callable[..., Any]:
    """ "package.module:function" -> the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"tool function {spec!r} must be 'module:function'")
    return import_function(module_name, attr, f"tool function {spec!r}")


@dataclass
class ToolResult:
    """What a call gave: `content` is what the model is shown; `status` says how the call went."""

    content: str
    status: ToolStatus
    elapsed_s: float = 0.0


def truncated(text: str, max_chars: int, total_chars: int | None = None) -> str:
    """`text` cut to `max_chars` characters, with a marker saying how many of `total_chars`
    (default: len(text)) were cut; `text` itself when nothing was."""
    total = len(text) if total_chars is None else total_chars
    if total <= max_chars:
        return text
    return f"{text[:max_chars]}\n[output truncated: {total - max_chars} of {total} characters not shown]"


def _type_problem(value: Any, schema: dict[str, Any], where: str) -> str | None:
    """What makes `value` not match `schema` (the subset `_type_schema` writes), or None."""
    if "anyOf" in schema:
        if value is None:
            return None
        return _type_problem(value, schema["anyOf"][0], where)
    if "enum" in schema and value not in schema["enum"]:
        return f"{where} must be one of {json.dumps(schema['enum'])}, got {json.dumps(value)}"
    expected = schema.get("type")
    checks = {
        "string": lambda v: isinstance(v, str),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "boolean": lambda v: isinstance(v, bool),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
        "null": lambda v: v is None,
    }
    if expected is not None and not checks[expected](value):
        return f"{where} must be of type {expected}, got {_json_type(value)} {json.dumps(value)[:100]}"
    if expected == "array" and "items" in schema:
        for i, item in enumerate(value):
            if problem := _type_problem(item, schema["items"], f"{where}[{i}]"):
                return problem
    if expected == "object" and "additionalProperties" in schema:
        for key, item in value.items():
            if problem := _type_problem(item, schema["additionalProperties"], f"{where}[{key!r}]"):
                return problem
    return None


def _json_type(value: Any) -> str:
    for kind, check in (("boolean", bool), ("integer", int), ("number", float), ("string", str), ("array", list)):
        if isinstance(value, check):
            return kind
    return "object" if isinstance(value, dict) else "null" if value is None else type(value).__name__


def arguments_problem(tool: Tool, arguments: Any) -> tuple[dict[str, Any] | None, str | None]:
    """(the arguments as an object, None), or (None, what is wrong with them against the tool's schema)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            return None, f"the arguments of {tool.name!r} are not valid JSON: {exc}"
    if not isinstance(arguments, dict):
        return None, f"the arguments of {tool.name!r} must be a JSON object, got {_json_type(arguments)}"
    properties = tool.parameters.get("properties", {})
    missing = [name for name in tool.parameters.get("required", []) if name not in arguments]
    if missing:
        return None, f"{tool.name!r} is missing required argument(s): {', '.join(missing)}"
    unexpected = [name for name in arguments if name not in properties]
    if unexpected:
        return None, (
            f"{tool.name!r} got unexpected argument(s): {', '.join(unexpected)}; "
            f"it takes: {', '.join(properties) or 'none'}"
        )
    for name, value in arguments.items():
        if problem := _type_problem(value, properties[name], f"argument {name!r} of {tool.name!r}"):
            return None, problem
    return arguments, None


class ToolRunner(WorkerPool):
    """Runs tool calls in `num_workers` worker processes, with limits on each call:

    - `timeout_s`: wall-clock time; the worker is killed and replaced (status "timeout");
    - `memory_mb`: the worker's address space (RLIMIT_AS, imports included): a MemoryError, or the
      worker's death near the limit, is status "memory";
    - `max_output_chars`: what the tool printed to stdout, then its return value, cut to this many
      characters with a marker saying how many were cut (status "output_truncated").

    A tool that raises is "error" (the content names the exception, without the traceback), one
    that kills its worker (a segfault) is "error" too, and the worker is replaced. Unknown tools
    ("unknown_tool") and arguments that do not fit the schema ("bad_arguments") are answered here,
    without a worker. Calls from several threads are taken one batch at a time; pass calls together
    to `call_many` to run them concurrently. Use it as a context manager, or call close().
    """

    def __init__(
        self,
        tools: Sequence[Tool],
        timeout_s: float = 10.0,
        max_output_chars: int = 4096,
        memory_mb: int = 1024,
        num_workers: int = 2,
    ):
        for field, value in (
            ("timeout_s", timeout_s),
            ("max_output_chars", max_output_chars),
            ("memory_mb", memory_mb),
            ("num_workers", num_workers),
        ):
            if value <= 0:
                raise ValueError(f"ToolRunner.{field} must be positive, got {value}")
        self.tools: dict[str, Tool] = {}
        functions: dict[str, bytes | str] = {}
        for tool in tools:
            if tool.name in self.tools:
                raise ValueError(f"two tools are named {tool.name!r}")
            self.tools[tool.name] = tool
            functions[tool.name] = tool.function if isinstance(tool.function, str) else _pickled(tool)
        self.timeout_s = timeout_s
        self.max_output_chars = max_output_chars
        self.memory_mb = memory_mb
        self._lock = threading.Lock()
        label = f"tools {', '.join(self.tools)}"
        payload = {
            "functions": functions,
            "memory_mb": memory_mb,
            "max_output_chars": max_output_chars,
            "timeout_s": timeout_s,
        }
        self.start_workers("archon.agents.tools", payload, label, num_workers)

    def call(self, call: ToolCall) -> ToolResult:
        return self.call_many([call])[0]

    def call_many(self, calls: Sequence[ToolCall]) -> list[ToolResult]:
        """The results of `calls`, in their order; the calls run concurrently over the workers."""
        results: list[ToolResult | None] = [None] * len(calls)
        sent, requests = [], []
        for index, call in enumerate(calls):
            tool = self.tools.get(call.name)
            if tool is None:
                known = ", ".join(self.tools)
                results[index] = ToolResult(f"unknown tool {call.name!r}; the tools are: {known}", "unknown_tool")
                continue
            arguments, problem = arguments_problem(tool, call.arguments)
            if problem is not None:
                results[index] = ToolResult(problem, "bad_arguments")
                continue
            sent.append(index)
            requests.append(("call", call.name, arguments))
        if requests:
            with self._lock:
                # a worker whose tool hit the memory limit is replaced: its peak memory stays at the
                # limit for the process's life and would make a later crash read as out-of-memory
                outcomes = run_on_workers(
                    self._workers, requests, self.timeout_s, replace_after=lambda reply: reply[1] == "memory"
                )
            for index, outcome in zip(sent, outcomes):
                results[index] = self._result(calls[index].name, outcome)
        return results

    def _result(self, name: str, outcome) -> ToolResult:
        if outcome.failure is None:
            _, status, content = outcome.reply
            return ToolResult(content, status, outcome.elapsed_s)
        if outcome.failure == "timeout":
            content = f"{name!r} did not finish within {self.timeout_s} s and was stopped"
            return ToolResult(content, "timeout", outcome.elapsed_s)
        if outcome.failure == "unavailable":
            return ToolResult(f"{name!r} could not run: {outcome.detail}", "error", outcome.elapsed_s)
        # The worker died. It died of its memory limit when its own peak reached the limit; a SIGKILL
        # alone says nothing about memory (a hard RLIMIT_CPU, or another process, sends one too).
        peak = outcome.peak_rss_mb
        if peak is not None and peak >= PEAK_MEMORY_FRACTION * self.memory_mb:
            peak_text = f"; its peak memory was {peak:.0f} MB" if peak is not None else ""
            content = f"{name!r} ran out of memory (limit {self.memory_mb} MB): {outcome.detail}{peak_text}"
            return ToolResult(content, "memory", outcome.elapsed_s)
        return ToolResult(f"{name!r} crashed: {outcome.detail}", "error", outcome.elapsed_s)


def _pickled(tool: Tool) -> bytes:
    try:
        return pickle.dumps(tool.function)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(
            f"tool {tool.name!r}: its function {_function_label(tool.function)} cannot be sent to a worker "
            f"process ({type(exc).__name__}: {exc}); define it at the top level of an importable module"
        ) from exc


# ---- the worker process -------------------------------------------------------------------------------

_call_deadline: float | None = None


def call_deadline() -> float | None:
    """In a ToolRunner's worker, during a call: the time.monotonic() at which the runner will stop the
    call (a tool that starts work of its own ends it before then, as the python sandbox does); None
    elsewhere."""
    return _call_deadline


class _CappedText(io.TextIOBase):
    """A text stream that keeps the first `max_chars` characters written to it and counts all of them."""

    def __init__(self, max_chars: int):
        self.max_chars = max_chars
        self.kept: list[str] = []
        self.kept_chars = 0
        self.total_chars = 0

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.total_chars += len(text)
        if self.kept_chars < self.max_chars:
            piece = text[: self.max_chars - self.kept_chars]
            self.kept.append(piece)
            self.kept_chars += len(piece)
        return len(text)


def _load_tools(payload: dict[str, Any]) -> dict[str, Any]:
    """Set the address-space limit, then load the tool functions (their imports count toward it)."""
    limit = payload["memory_mb"] * 2**20
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    functions = {}
    for name, function in payload["functions"].items():
        try:
            functions[name] = resolve_function(function) if isinstance(function, str) else pickle.loads(function)
        except Exception as exc:
            raise ValueError(f"tool {name!r}: {type(exc).__name__}: {exc}") from exc
    return {**payload, "functions": functions}


def _run_tool(state: dict[str, Any], message: tuple) -> tuple[str, ToolStatus, str]:
    """("call", name, arguments) -> ("reply", status, content)."""
    global _call_deadline
    _, name, arguments = message
    limit = state["max_output_chars"]
    printed = _CappedText(limit)
    _call_deadline = time.monotonic() + state.get("timeout_s", float("inf"))
    try:
        with contextlib.redirect_stdout(printed):
            value = state["functions"][name](**arguments)
    except MemoryError as exc:
        detail = f": {exc}" if str(exc) else ""
        memory_mb = state["memory_mb"]
        return ("reply", "memory", f"MemoryError{detail} ({name!r} went over its memory limit of {memory_mb} MB)")
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - a failing tool is shown to the model
        return ("reply", "error", f"{type(exc).__name__}: {exc}")
    finally:
        _call_deadline = None
    try:
        value_text = value if isinstance(value, str) else "" if value is None else json.dumps(value)
    except (TypeError, ValueError) as exc:
        return ("reply", "error", f"{name!r} returned a value that is not JSON-serializable: {exc}")
    total = printed.total_chars + len(value_text)
    content = truncated("".join(printed.kept) + value_text[:limit], limit, total)
    return ("reply", "output_truncated" if total > limit else "ok", content)


if __name__ == "__main__":
    # the functions of this module under its own name: a tool that imports it (the python sandbox
    # reads call_deadline) sees the globals they set, not those of a second copy named __main__
    from archon.agents import tools

    serve(tools._load_tools, tools._run_tool)
