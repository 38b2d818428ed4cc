"""The built-in tools: `python`, a code sandbox, and the lookup of tools by name or "module:function".

`python(code)` runs the code in a fresh `python -I` interpreter, in a temporary scratch directory
that is deleted afterwards, under `SandboxLimits`: CPU time (RLIMIT_CPU), address space
(RLIMIT_AS), the size of any file it writes (RLIMIT_FSIZE), the number of processes (RLIMIT_NPROC,
which counts all of the user's processes and does not bind root) and a wall-clock timeout. Before
the code runs, the interpreter installs an audit hook (sys.addaudithook) that refuses network
access (`socket.connect`, `socket.bind`, `socket.getaddrinfo`, `socket.sendto`, ... events) and
starting programs (which would not carry the hook). This blocks Python-level network access only:
a C extension, or ctypes, making raw system calls is not stopped by it; run the trainer in a
network namespace or container for a hard guarantee.

These limits are the sandbox's own, separate from the ToolRunner's that runs the tool.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable

from archon.agents.tools import Tool, truncated

BLOCKED_EVENTS = (
    "socket.bind",
    "socket.connect",
    "socket.getaddrinfo",
    "socket.gethostbyaddr",
    "socket.gethostbyname",
    "socket.getnameinfo",
    "socket.sendmsg",
    "socket.sendto",
    "os.exec",
    "os.fork",
    "os.forkpty",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "subprocess.Popen",
)
"""Audit events the sandboxed interpreter refuses with PermissionError."""

TRACEBACK_LINES = 20
"""When the program fails, only this many last lines of its stderr are shown, as a REPL shows the end."""

# Runs first in the sandboxed interpreter (which cannot import archon: `-I` keeps the working tree off
# sys.path): it dies with the process that started it, sets the limits, installs the audit hook and
# runs main.py, showing a traceback without its own frame.
_BOOTSTRAP = r"""
import ctypes, os, resource, signal, sys, traceback
parent, cpu_s, memory, file_size, processes = (int(arg) for arg in sys.argv[1:6])
blocked = frozenset(sys.argv[6].split(","))
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os._exit(1)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))

def refuse(event, args):
    if event in blocked:
        raise PermissionError(f"{event} is refused: the sandbox allows no network access and starts no programs")

sys.addaudithook(refuse)
try:
    with open("main.py", encoding="utf-8") as file:
        code = compile(file.read(), "main.py", "exec")
    exec(code, {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException as exc:
    traceback.print_exception(type(exc), exc, exc.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use."""

    timeout_s: float = 10.0
    """Wall-clock time; the program is killed after it."""
    cpu_s: int = 10
    """CPU time in seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS)."""
    max_file_mb: int = 16
    """Size of any file it writes, its captured stdout and stderr included (RLIMIT_FSIZE)."""
    max_processes: int = 64
    """RLIMIT_NPROC: counts all of the user's processes, and root is exempt."""
    max_output_chars: int = 4096
    """What is returned: stdout, then stderr, cut to this many characters."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be positive, got {getattr(self, field.name)}")


def _read_output(file, max_chars: int) -> tuple[str, int]:
    """(up to about max_chars characters of a captured stream, its length in characters, estimated
    from its size when it was not read whole)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    data = file.read(4 * max_chars + 4)
    text = data.decode("utf-8", errors="replace")
    return text, len(text) + size - len(data)


def _stop_reason(returncode: int | None, limits: SandboxLimits) -> str | None:
    if returncode is None:
        return f"[stopped: over the wall-clock limit of {limits.timeout_s} s]"
    if returncode == -signal.SIGXCPU:
        return f"[stopped: over the CPU-time limit of {limits.cpu_s} s]"
    if returncode == -signal.SIGXFSZ:
        return f"[stopped: wrote a file (or output) over the limit of {limits.max_file_mb} MB]"
    if returncode < 0:
        return f"[killed by {signal.Signals(-returncode).name}]"
    if returncode > 1:  # 1 is an uncaught exception, whose traceback says enough
        return f"[exit code {returncode}]"
    return None


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run `code` in a fresh sandboxed interpreter under `limits`; its stdout, then its stderr (when
    it failed: the last TRACEBACK_LINES lines, kept in view by cutting stdout first), capped at
    `limits.max_output_chars`, then why it was stopped, if it was."""
    with (
        tempfile.TemporaryDirectory(prefix="archon-sandbox-") as scratch,
        tempfile.TemporaryFile() as stdout,
        tempfile.TemporaryFile() as stderr,
    ):
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as main:
            main.write(code)
        limit_args = [limits.cpu_s, limits.memory_mb * 2**20, limits.max_file_mb * 2**20, limits.max_processes]
        env = {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8", "OPENBLAS_NUM_THREADS": "1"}
        proc = subprocess.Popen(
            [
                sys.executable,
                "-I",
                "-X",
                "utf8",
                "-c",
                _BOOTSTRAP,
                str(os.getpid()),
                *map(str, limit_args),
                ",".join(BLOCKED_EVENTS),
            ],
            cwd=scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            returncode = proc.wait(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            returncode = None
        out_text, out_chars = _read_output(stdout, limits.max_output_chars)
        err_text, err_chars = _read_output(stderr, limits.max_output_chars)
    if returncode:  # the traceback's end stays in view, stdout gives way
        err_tail = "".join(err_text.splitlines(keepends=True)[-TRACEBACK_LINES:])
        err_text = truncated(err_tail, limits.max_output_chars // 2)
        output = truncated(out_text, limits.max_output_chars - len(err_text), out_chars)
        output = f"{output}\n{err_text}" if output and not output.endswith("\n") else output + err_text
    else:
        output = truncated(out_text + err_text, limits.max_output_chars, out_chars + err_chars)
    reason = _stop_reason(returncode, limits)
    if reason is not None:
        output = f"{output}{'' if not output or output.endswith(chr(10)) else chr(10)}{reason}"
    return output


def python(code: str) -> str:
    """Run a Python program in a fresh sandboxed interpreter and return what it printed (stdout, then stderr).

    The program starts in an empty scratch directory that is deleted afterwards, has no network
    access and cannot start other programs, and is stopped when it runs over its time or memory
    limits. Print the values you want to see.

    Args:
        code: The complete Python program to run.
    """
    return run_python(code)


def python_tool(**limits) -> Tool:
    """The `python` tool with its own `SandboxLimits` (timeout_s=..., memory_mb=..., ...)."""
    tool = Tool.from_function(python)
    return dataclasses.replace(tool, function=functools.partial(run_python, limits=SandboxLimits(**limits)))


PYTHON_TOOL = python_tool()

BUILTIN_TOOLS: dict[str, Callable[[], Tool]] = {"python": python_tool}


def builtin_tool(name: str) -> Tool:
    """The built-in tool `name`, with its default limits."""
    if name not in BUILTIN_TOOLS:
        raise ValueError(f"no built-in tool {name!r}; the built-in tools are: {', '.join(BUILTIN_TOOLS)}")
    return BUILTIN_TOOLS[name]()


def resolve_tool(spec: str) -> Tool:
    """A built-in tool's name ("python") or "package.module:function" -> the Tool."""
    if spec in BUILTIN_TOOLS:
        return builtin_tool(spec)
    if ":" not in spec:
        raise ValueError(f"tool {spec!r} must be a built-in tool ({', '.join(BUILTIN_TOOLS)}) or 'module:function'")
    return Tool.from_function(spec)
