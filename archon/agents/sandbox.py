"""The built-in tools: `python`, a code sandbox, and the lookup of tools by name or "module:function".

`python(code)` runs the code in a fresh interpreter that the operating system isolates (isolation
"namespaces", the default; see archon.agents.sandbox_init for how): its own user, mount, PID,
network, IPC and UTS namespaces (unshare(2)), where root is an unprivileged user outside (nobody when
the trainer is root). The program sees a read-only file
system holding the system's libraries and the interpreter, a private tmpfs scratch of `scratch_mb`
(its working directory, $HOME and $TMPDIR; gone when the call ends), no network but a loopback
that is down, and no other process; it has no capabilities and inherits no descriptor but its
stdio. Its environment is a fixed allow-list (PATH, HOME, TMPDIR, LANG). Its own process is under
`SandboxLimits`: CPU time (RLIMIT_CPU), address space (RLIMIT_AS), the size of any file it writes
(RLIMIT_FSIZE), the number of processes (RLIMIT_NPROC) and a wall-clock limit, after which every
process it started is killed with it. An audit hook also answers network access and starting
programs with a clear PermissionError, before the kernel would refuse them.

The sandbox talks to the process that starts it in JSON only (one request line, one reply line).
Where the namespaces cannot be made (user namespaces disabled or refused), the tool refuses
to start, unless its limits say isolation="process": the program then runs as a plain child
process in a scratch directory on disk, under the RLIMITs and the audit hook only, which code that
makes raw system calls gets around.

These limits are the sandbox's own; inside a ToolRunner's worker the wall-clock limit is cut to end
SANDBOX_EXIT_S before the runner's own, so that the sandbox is always the one to stop a call.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

from archon.agents.sandbox_init import BOOTSTRAP as PROGRAM_BOOTSTRAP
from archon.agents.tools import Tool, call_deadline, truncated

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

SANDBOX_EXIT_S = 1.0
"""Inside a ToolRunner's worker, the sandbox's wall-clock limit ends this long before the runner's."""

STARTUP_GRACE_S = 5.0
"""How long past its wall-clock limit the sandbox may take to answer before it is killed from outside."""

SANDBOX_UID = 65534
"""The user (and group) outside that is root inside the sandbox, when the trainer runs as root: nobody."""

_INIT_SOURCE = (Path(__file__).parent / "sandbox_init.py").read_text(encoding="utf-8")

# The isolation="process" sandbox (no namespaces): runs first in the sandboxed interpreter, dies with
# the process that started it and sets the limits, then runs the namespaced program's own bootstrap
# (the audit hook, main.py, a traceback without its own frame) with the blocked events as argv[1].
_PROCESS_BOOTSTRAP = (
    r"""
import ctypes, os, resource, signal, sys
parent, cpu_s, memory, file_size, processes = (int(arg) for arg in sys.argv[1:6])
del sys.argv[1:6]
ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != parent:
    os._exit(1)
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
"""
    + PROGRAM_BOOTSTRAP
)


class SandboxUnavailable(RuntimeError):
    """The OS-isolated sandbox cannot be made on this machine."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandboxed program may use."""

    timeout_s: float = 10.0
    """Wall-clock time; the program, and every process it started, is killed after it."""
    cpu_s: int = 10
    """CPU time in seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS)."""
    max_file_mb: int = 16
    """Size of any file it writes, its captured stdout and stderr included (RLIMIT_FSIZE)."""
    max_processes: int = 64
    """RLIMIT_NPROC. In the namespaces it counts the sandbox's own processes; with isolation="process"
    it counts all of the user's processes, and root is exempt."""
    max_output_chars: int = 4096
    """What is returned: stdout, then stderr, cut to this many characters."""
    scratch_mb: int = 64
    """Size of the scratch tmpfs: all the program writes, its captured output included, fits in it
    (isolation "namespaces" only; it is memory, charged to the trainer's memory cgroup)."""
    isolation: Literal["namespaces", "process"] = "namespaces"
    """namespaces: the OS-isolated sandbox, refused where it cannot be made; process: a plain child
    process under the RLIMITs and the audit hook only (a weaker sandbox; code that makes raw system
    calls escapes it). Choose "process" only for code you trust."""

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name != "isolation" and value <= 0:
                raise ValueError(f"SandboxLimits.{field.name} must be positive, got {value}")
        if self.isolation not in ("namespaces", "process"):
            raise ValueError(f"SandboxLimits.isolation must be 'namespaces' or 'process', got {self.isolation!r}")


@dataclass
class _Run:
    """What became of one sandboxed program."""

    returncode: int | None
    """None: stopped at the wall-clock limit."""
    cpu_s: float
    stdout: str
    stdout_chars: int
    stderr: str
    stderr_chars: int


def _read_output(file, max_chars: int) -> tuple[str, int]:
    """(up to about max_chars characters of a captured stream, its length in characters, estimated
    from its size when it was not read whole)."""
    size = os.fstat(file.fileno()).st_size
    file.seek(0)
    data = file.read(4 * max_chars + 4)
    text = data.decode("utf-8", errors="replace")
    return text, len(text) + size - len(data)


def _stop_reason(run: _Run, limits: SandboxLimits, wall_s: float) -> str | None:
    returncode = run.returncode
    if returncode is None:
        return f"[stopped: over the wall-clock limit of {wall_s} s]"
    if returncode == -signal.SIGXCPU or (returncode == -signal.SIGKILL and run.cpu_s >= limits.cpu_s):
        return f"[stopped: over the CPU-time limit of {limits.cpu_s} s]"
    if returncode == -signal.SIGXFSZ:
        return f"[stopped: wrote a file (or output) over the limit of {limits.max_file_mb} MB]"
    if returncode < 0:
        return f"[killed by {signal.Signals(-returncode).name}]"
    if returncode > 1:  # 1 is an uncaught exception, whose traceback says enough
        return f"[exit code {returncode}]"
    return None


def _visible_paths() -> list[str]:
    """The interpreter's installation, bound read-only into the sandbox at its own path."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    return sorted(os.path.realpath(path) for path in paths) + sorted(paths)


def _map_user(pid: int) -> None:
    """Map root of the user namespace that process `pid` made to SANDBOX_UID (when this process is
    root) or to this process's own user and group."""
    uid = SANDBOX_UID if os.geteuid() == 0 else os.geteuid()
    gid = SANDBOX_UID if os.geteuid() == 0 else os.getegid()
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1\n"), ("gid_map", f"0 {gid} 1\n")):
        with open(f"/proc/{pid}/{name}", "w", encoding="ascii") as file:
            file.write(text)


def _run_in_namespaces(code: str, limits: SandboxLimits, deadline: float) -> _Run:
    request = {
        "code": code,
        "deadline": deadline,
        "cpu_s": limits.cpu_s,
        "memory": limits.memory_mb * 2**20,
        "file_size": limits.max_file_mb * 2**20,
        "processes": limits.max_processes,
        "scratch_mb": limits.scratch_mb,
        "max_bytes": 4 * limits.max_output_chars + 4,
        "paths": _visible_paths(),
        "blocked": ",".join(BLOCKED_EVENTS),
    }
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _INIT_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            env={"PATH": os.defpath, "LANG": "C.UTF-8"},
            start_new_session=True,
        )
        line = None
        try:
            # stdin stays open until the reply: the sandbox ends its program when it closes
            proc.stdin.write((json.dumps(request) + "\n").encode())
            proc.stdin.flush()
            if _read_line(proc.stdout.fileno(), deadline + STARTUP_GRACE_S) is not None:  # it has unshared
                _map_user(proc.pid)
                proc.stdin.write(b"mapped\n")
                proc.stdin.flush()
                line = _read_line(proc.stdout.fileno(), deadline + STARTUP_GRACE_S)
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            _end(proc, wait_s=STARTUP_GRACE_S if line is not None else 0.0)
        if line is None:
            errors.seek(0)
            detail = errors.read(4000).decode("utf-8", errors="replace").strip()
            raise SandboxUnavailable(f"the sandbox gave no reply (exit code {proc.returncode}): {detail}")
    reply = json.loads(line)
    returncode = None if reply["stopped"] == "timeout" else reply["returncode"]
    return _Run(
        returncode, reply["cpu_s"], reply["stdout"], reply["stdout_chars"], reply["stderr"], reply["stderr_chars"]
    )


def _read_line(fd: int, deadline: float) -> bytes | None:
    """One line from `fd` by `deadline`; None when it closed or the time ran out first."""
    data = b""
    while not data.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return None
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return None
        data += chunk
    return data


def _end(proc: subprocess.Popen, wait_s: float) -> None:
    """Close the sandbox's stdin (which ends it), give it `wait_s` to exit, then kill its process group."""
    try:
        proc.stdin.close()
    except OSError:
        pass
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    proc.stdout.close()


def _run_as_process(code: str, limits: SandboxLimits, deadline: float) -> _Run:
    """isolation="process": a plain child process in a scratch directory on disk."""
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
            [sys.executable, "-I", "-X", "utf8", "-c", _PROCESS_BOOTSTRAP, str(os.getpid()), *map(str, limit_args)]
            + [",".join(BLOCKED_EVENTS)],
            cwd=scratch,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
            start_new_session=True,
        )
        try:
            _, status, usage = _wait4(proc, deadline)
            returncode = os.waitstatus_to_exitcode(status)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, _, usage = os.wait4(proc.pid, 0)
            returncode = None
        proc.returncode = -signal.SIGKILL if returncode is None else returncode
        out_text, out_chars = _read_output(stdout, limits.max_output_chars)
        err_text, err_chars = _read_output(stderr, limits.max_output_chars)
    return _Run(returncode, usage.ru_utime + usage.ru_stime, out_text, out_chars, err_text, err_chars)


def _wait4(proc: subprocess.Popen, deadline: float):
    """os.wait4 of `proc` by `deadline` (raises subprocess.TimeoutExpired after it)."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return pid, status, usage
        if time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, 0)
        time.sleep(0.01)


def _deadline(limits: SandboxLimits) -> tuple[float, float]:
    """(the program's time.monotonic() deadline, its wall-clock limit in seconds): `limits.timeout_s`,
    cut to end SANDBOX_EXIT_S before the deadline of the ToolRunner call this runs in, if any."""
    now = time.monotonic()
    deadline = now + limits.timeout_s
    runner_deadline = call_deadline()
    if runner_deadline is not None:
        deadline = min(deadline, max(now + 0.1, runner_deadline - SANDBOX_EXIT_S))
    return deadline, round(deadline - now, 1)


@functools.cache
def _namespaces_problem() -> str | None:
    """Why the OS-isolated sandbox cannot run here (None when it can), tried once per process."""
    try:
        run = _run_in_namespaces("print('ok')", SandboxLimits(), time.monotonic() + 30.0)
    except (SandboxUnavailable, OSError) as exc:
        return str(exc)
    if run.returncode != 0 or run.stdout != "ok\n":
        return f"a test program gave exit code {run.returncode}: {run.stderr.strip()[-2000:]}"
    return None


def check_sandbox(limits: SandboxLimits = SandboxLimits()) -> None:
    """Raise SandboxUnavailable, saying why and what to do, when `limits` ask for the OS-isolated
    sandbox and this machine cannot make it."""
    if limits.isolation != "namespaces":
        return
    problem = _namespaces_problem()
    if problem is not None:
        raise SandboxUnavailable(
            f"the python tool's sandbox needs user, mount, PID and network namespaces, and they cannot be "
            f"made here: {problem}. Allow user namespaces "
            "(sysctl user.max_user_namespaces > 0, kernel.unprivileged_userns_clone=1, or the container's "
            "seccomp profile), or opt into the weaker sandbox with SandboxLimits(isolation='process') "
            "(see docs/agents.md)"
        )


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> str:
    """Run `code` in a fresh sandboxed interpreter under `limits`; its stdout, then its stderr (when
    it failed: the last TRACEBACK_LINES lines, kept in view by cutting stdout first), capped at
    `limits.max_output_chars`, then why it was stopped, if it was."""
    deadline, wall_s = _deadline(limits)
    if limits.isolation == "namespaces":
        check_sandbox(limits)
        run = _run_in_namespaces(code, limits, deadline)
    else:
        run = _run_as_process(code, limits, deadline)
    max_chars = limits.max_output_chars
    if run.returncode:  # the traceback's end stays in view, stdout gives way
        err_tail = "".join(run.stderr.splitlines(keepends=True)[-TRACEBACK_LINES:])
        err_text = truncated(err_tail, max_chars // 2)
        output = truncated(run.stdout, max_chars - len(err_text), run.stdout_chars)
        output = f"{output}\n{err_text}" if output and not output.endswith("\n") else output + err_text
    else:
        output = truncated(run.stdout + run.stderr, max_chars, run.stdout_chars + run.stderr_chars)
    reason = _stop_reason(run, limits, wall_s)
    if reason is not None:
        output = f"{output}{'' if not output or output.endswith(chr(10)) else chr(10)}{reason}"
    return output


def python(code: str) -> str:
    """Run a Python program in a fresh sandboxed interpreter and return what it printed (stdout, then stderr).

    The program starts in an empty scratch directory that is deleted afterwards, has no network
    access and cannot start other programs, and is stopped when it runs over its time, memory or
    disk limits. Print the values you want to see.

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
    """The built-in tool `name`, with its default limits; raises SandboxUnavailable when its sandbox
    cannot be made here, so that a run refuses to start rather than fail at its first call."""
    if name not in BUILTIN_TOOLS:
        raise ValueError(f"no built-in tool {name!r}; the built-in tools are: {', '.join(BUILTIN_TOOLS)}")
    tool = BUILTIN_TOOLS[name]()
    limits = getattr(tool.function, "keywords", {}).get("limits")
    if isinstance(limits, SandboxLimits):
        check_sandbox(limits)
    return tool


def _limits_from_query(spec: str, query: str) -> dict:
    """ "timeout_s=5&isolation=process" -> SandboxLimits keyword arguments; errors name the key and `spec`."""
    fields = {field.name: field for field in dataclasses.fields(SandboxLimits)}
    limits: dict = {}
    for item in query.split("&"):
        key, sep, text = item.partition("=")
        if key not in fields or not sep:
            raise ValueError(f"tool {spec!r}: {item!r} is not key=value of a sandbox limit ({', '.join(fields)})")
        kind = {"timeout_s": float, "isolation": str}.get(key, int)
        try:
            limits[key] = kind(text)
        except ValueError:
            raise ValueError(f"tool {spec!r}: {key} must be {kind.__name__}, got {text!r}") from None
    return limits


def resolve_tool(spec: str) -> Tool:
    """A built-in tool's name ("python"), with sandbox limits if any ("python?timeout_s=5&scratch_mb=128",
    "python?isolation=process"), or "package.module:function" -> the Tool."""
    name, sep, query = spec.partition("?")
    if sep and name in BUILTIN_TOOLS:
        try:
            tool = python_tool(**_limits_from_query(spec, query))
        except ValueError as exc:
            raise ValueError(f"tool {spec!r}: {exc}") if not str(exc).startswith("tool ") else exc from None
        check_sandbox(tool.function.keywords["limits"])
        return tool
    if spec in BUILTIN_TOOLS:
        return builtin_tool(spec)
    if ":" not in spec:
        raise ValueError(f"tool {spec!r} must be a built-in tool ({', '.join(BUILTIN_TOOLS)}) or 'module:function'")
    return Tool.from_function(spec)
