"""Worker processes for user code: `python -m MODULE PARENT_PID`, driven by the parent's `WorkerProcess`.

What every such worker shares (reward workers, `archon.rl.reward_worker`; tool workers,
`archon.agents.tools`): the framing, the worker's loop (`serve`), the parent's side
(`WorkerProcess`, `WorkerPool`, `run_on_workers`), and resolving a "module:attribute" spec to the
callable it names (`import_function`). It does not import torch.

Messages are length-prefixed (8-byte big-endian length, then the payload), requests on stdin and
replies on the process's original stdout. Requests are pickles: they carry the parent's own objects
to a process that trusts it. Replies are JSON, never pickles, since user code in the worker can write
to its own reply channel: the parent never runs anything a worker sends (tuples arrive as lists,
NaN and inf as floats). Anything the user code prints to the process's stdout goes to stderr, and
its stdin is /dev/null, so it can neither corrupt nor consume the messages.

The worker inherits no descriptor but its stdin, stdout and stderr, and an environment of the
allow-listed variables (WORKER_ENVIRONMENT) and those its parent passes on purpose: no secret the
trainer holds in its own environment reaches user code unless asked for.

    ("init", payload, sys_path) -> ("ready", None) | ("init_error", message)
    then the worker's own requests and replies; a failed one -> ("error", message, traceback text)

The worker exits when stdin closes, and on Linux is killed when its parent dies. The parent
enforces the time limit by killing the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import pickle
import resource
import select
import signal
import struct
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, Self, Sequence

_HEADER = struct.Struct(">Q")
MAX_REPLY_BYTES = 1 << 30
"""A reply frame announcing more than this is malformed."""
WORKER_STARTUP_TIMEOUT_S = 120.0
CPU_TICK_S = 0.25
"""A process killed at its hard RLIMIT_CPU has used that much CPU time, give or take a few clock ticks."""
EXIT_WAIT_S = 5.0
"""How long a worker whose output closed gets to finish exiting before it counts as hung."""


WORKER_ENVIRONMENT = (
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "PYTHONPATH",
    "PYTHONHASHSEED",
    "PYTHONUTF8",
    "PYTHONIOENCODING",
    "VIRTUAL_ENV",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "XDG_CACHE_HOME",
)
"""The variables of the parent's environment that a worker gets; no other one reaches it."""


class MalformedReply(ValueError):
    """A worker sent a reply frame that is not JSON, or too large."""


def worker_environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The allow-listed part of this process's environment, with `extra` on top."""
    env = {name: os.environ[name] for name in WORKER_ENVIRONMENT if name in os.environ}
    return {**env, **(extra or {})}


def write_message(stream: BinaryIO, message: Any) -> None:
    """A request (parent -> worker): a pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def _plain_json(value: Any) -> Any:
    """json.dumps's fallback for numbers that are not Python's own (numpy scalars)."""
    if hasattr(value, "item") and callable(value.item):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON-serializable")


def write_reply(stream: BinaryIO, reply: Any) -> None:
    """A reply (worker -> parent): JSON; one that cannot be written as JSON becomes an ("error", why) reply."""
    try:
        payload = json.dumps(reply, default=_plain_json).encode()
    except (TypeError, ValueError) as exc:
        payload = json.dumps(["error", f"the worker's reply is not JSON-serializable: {exc}"]).encode()
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def parse_reply(payload: bytes) -> Any:
    """A reply frame's payload -> the reply; MalformedReply when it is not JSON."""
    try:
        return json.loads(payload)
    except (UnicodeDecodeError, ValueError) as exc:
        raise MalformedReply(f"it sent a reply that is not JSON ({exc})") from None


def read_message(stream: BinaryIO) -> Any | None:
    """The next request (a pickle), or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return pickle.loads(payload)


def _hard_cpu_limit(pid: int) -> float | None:
    """The hard RLIMIT_CPU of a child that has exited but is not reaped yet; None when unlimited or unknown."""
    try:
        with open(f"/proc/{pid}/limits", encoding="ascii") as file:
            for line in file:
                if line.startswith("Max cpu time"):
                    hard = line.split()[4]
                    return None if hard == "unlimited" else float(hard)
    except OSError:
        pass
    return None


def describe_exception(exc: BaseException) -> str:
    """`Type: message (at file:line)` of the innermost frame, for a user function's error shown in one line."""
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _exit_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent dies, so a worker stuck in user code is not orphaned."""
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent is already gone
        os._exit(1)


CAP_SYS_PTRACE = 19
PR_SET_DUMPABLE, PR_CAPBSET_DROP = 4, 24


def _close_the_parents_proc_entries() -> None:
    """Linux, in the parent: make this process non-dumpable, so that a process of the same user
    without CAP_SYS_PTRACE (a worker) cannot open its /proc entries: descriptors, environment,
    memory. It also means this process leaves no core dump."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)


def _give_up_ptrace() -> None:
    """Linux, in the worker: drop CAP_SYS_PTRACE (which root has) for good, so that the parent's
    /proc entries stay closed to the user code (see _close_the_parents_proc_entries)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_CAPBSET_DROP, CAP_SYS_PTRACE, 0, 0, 0)  # fails without CAP_SETPCAP: then it is not held
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable of capabilities 0-31, then of 32-63
    if libc.capget(header, data) == 0:
        for index in (0, 1, 2):
            data[index] &= ~(1 << CAP_SYS_PTRACE)
        libc.capset(header, data)


def serve(load: Callable[[Any], Any], handle: Callable[[Any, tuple], Any]) -> None:
    """A worker's main loop. ("init", payload, sys_path) puts sys_path, in its order, first on sys.path and keeps
    `state = load(payload)`, answering ("ready", None), or ("init_error", message) when load raises;
    every other request is answered with `handle(state, request)`."""
    if len(sys.argv) > 1:
        _exit_with_parent(int(sys.argv[1]))
    _give_up_ptrace()
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = os.fdopen(os.dup(sys.stdin.fileno()), "rb")
    with open(os.devnull, "rb") as devnull:  # user code that reads stdin must not read the requests
        os.dup2(devnull.fileno(), sys.stdin.fileno())

    state = None
    while (message := read_message(requests)) is not None:
        if message[0] == "init":
            _, payload, sys_path = message
            # the parent's order, which keeps late additions last (setuptools appends its vendored
            # packages, an old typing_extensions among them, once imported), then the worker's own
            sys.path[:] = list(sys_path) + [entry for entry in sys.path if entry not in sys_path]
            try:
                state = load(payload)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                write_reply(replies, ("init_error", describe_exception(exc)))
                continue
            write_reply(replies, ("ready", None))
        else:
            write_reply(replies, handle(state, message))


class WorkerProcess:
    """One worker process (`python -m MODULE PARENT_PID`, serving with `serve`), seen from the parent.

    `label` names what it runs in errors ("reward function 'm:f'"); `env` holds variables it gets on
    top of the allow-listed ones (see worker_environment). After a death seen by `exit_reason`,
    `peak_rss_mb` is the process's peak resident memory (None when unknown: when it did not exceed
    the peak of the process that started it, which the kernel reports in its place).
    """

    def __init__(self, module: str, payload: Any, label: str, env: dict[str, str] | None = None):
        self.module = module
        self.payload = payload
        self.label = label
        self.env = dict(env or {})
        self.cpu_s: float = 0.0
        """After a death seen by `exit_reason`: the CPU seconds it used."""
        self.cpu_limit_s: float | None = None
        """After a death seen by `exit_reason`: its hard RLIMIT_CPU, when it had one."""
        self.proc: subprocess.Popen | None = None
        self.peak_rss_mb: float | None = None
        self._buffer = b""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the process and send it the payload; raises RuntimeError on failure."""
        self.stop()
        _close_the_parents_proc_entries()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, str(os.getpid())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=worker_environment(self.env),
            close_fds=True,
        )
        self._buffer = b""
        self.peak_rss_mb = None
        # Linux carries the spawning process's peak memory into the child's (fork and exec keep the
        # larger of the two), so only a peak above this one is the worker's own
        self._inherited_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        self.send(("init", self.payload, list(sys.path)))
        reply = self.receive(time.monotonic() + WORKER_STARTUP_TIMEOUT_S)
        if reply is None or reply == "eof":
            reason = self.exit_reason() if reply == "eof" else f"no reply in {WORKER_STARTUP_TIMEOUT_S:.0f} s"
            self.stop()
            raise RuntimeError(f"the worker for {self.label} did not start: {reason}")
        if reply[0] != "ready":
            self.stop()
            raise RuntimeError(f"{self.label} could not be loaded: {reply[1]}")

    def send(self, message: Any) -> None:
        write_message(self.proc.stdin, message)

    def fileno(self) -> int:
        return self.proc.stdout.fileno()

    def read_available(self) -> bool:
        """Read what the pipe holds now; False at end of stream."""
        chunk = os.read(self.fileno(), 1 << 16)
        self._buffer += chunk
        return bool(chunk)

    def take_message(self) -> Any | None:
        """The next whole reply in what was read, or None; MalformedReply for a frame that is not one."""
        if len(self._buffer) < _HEADER.size:
            return None
        (size,) = _HEADER.unpack_from(self._buffer)
        if size > MAX_REPLY_BYTES:
            raise MalformedReply(f"it announced a reply of {size} bytes (the limit is {MAX_REPLY_BYTES})")
        if len(self._buffer) < _HEADER.size + size:
            return None
        payload, self._buffer = self._buffer[_HEADER.size : _HEADER.size + size], self._buffer[_HEADER.size + size :]
        return parse_reply(payload)

    def receive(self, deadline: float) -> Any | None:
        """Wait for one reply until `deadline`: the message, "eof", or None on timeout. A malformed
        reply stops the worker and reads as ("error", why)."""
        try:
            while (message := self.take_message()) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                readable, _, _ = select.select([self.fileno()], [], [], remaining)
                if readable and not self.read_available():
                    return "eof"
        except MalformedReply as exc:
            self.stop()
            return ["error", f"the worker for {self.label} was stopped: {exc}"]
        return message

    def _reap(self) -> int | None:
        """Wait up to EXIT_WAIT_S for the process to end; its exit code (None if still running).
        Reaped with wait4 so that its peak resident memory is known."""
        deadline = time.monotonic() + EXIT_WAIT_S
        while self.proc.returncode is None:
            try:
                exited = os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
                if exited is not None:  # not reaped yet: its limits can still be read
                    self.cpu_limit_s = _hard_cpu_limit(self.proc.pid)
                pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            except ChildProcessError:  # already reaped
                return self.proc.poll()
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                peak = usage.ru_maxrss / 1024  # kilobytes on Linux
                self.peak_rss_mb = peak if peak > self._inherited_rss_mb else None
                self.cpu_s = usage.ru_utime + usage.ru_stime
            elif time.monotonic() >= deadline:
                return None
            else:
                time.sleep(0.01)
        return self.proc.returncode

    def exit_reason(self) -> str:
        """Why the process ended, once its output has closed: its exit code or the signal that killed it."""
        code = self._reap()
        if code is None:
            return f"it closed its output but was still running {EXIT_WAIT_S:.0f} s later"
        if code >= 0:
            return f"it exited with code {code}"
        try:
            name = signal.Signals(-code).name
        except ValueError:  # a signal without a name (real-time signals)
            name = f"signal {-code}"
        if -code == signal.SIGXCPU:
            return f"it was killed by {name}: over its CPU-time limit (RLIMIT_CPU)"
        if -code == signal.SIGXFSZ:
            return f"it was killed by {name}: it wrote a file over its size limit (RLIMIT_FSIZE)"
        if -code == signal.SIGKILL and self.cpu_limit_s is not None and self.cpu_s >= self.cpu_limit_s - CPU_TICK_S:
            return f"it was killed by {name} at its CPU-time limit (RLIMIT_CPU, {self.cpu_limit_s:g} s)"
        if -code == signal.SIGKILL:
            # not this side's timeout (that is a "timeout" outcome); the kernel's OOM killer, a hard
            # RLIMIT_CPU, or another process may have sent it, and only the kernel log tells which
            return f"it was killed by {name}, which its parent did not send (see dmesg for the out-of-memory killer)"
        return f"it was killed by {name}"

    def stop(self) -> None:
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


class WorkerPool:
    """Base of what owns worker processes (`_workers`): close() stops them, as do leaving a `with`
    block and garbage collection."""

    _workers: Sequence[WorkerProcess] = ()

    def start_workers(self, module: str, payload: Any, label: str, count: int) -> None:
        """Start `count` workers (see WorkerProcess); when one fails to start, stop all and raise."""
        self._workers = [WorkerProcess(module, payload, label) for _ in range(count)]
        try:
            for worker in self._workers:
                worker.start()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()


@dataclass
class WorkerOutcome:
    """What became of one request sent by `run_on_workers`."""

    reply: Any = None
    """The worker's reply; None when it gave none."""
    failure: str | None = None
    """None (a reply came), "timeout" (the worker was killed), "died" or "unavailable" (it could not be started)."""
    detail: str = ""
    """Why it died or was unavailable."""
    signal: int | None = None
    """The signal that killed a worker that died (None if it exited)."""
    peak_rss_mb: float | None = None
    """Peak resident memory of a worker that died, when known."""
    elapsed_s: float = 0.0


def run_on_workers(
    workers: Sequence[WorkerProcess],
    requests: Sequence[Any],
    timeout_s: float,
    replace_after: Callable[[Any], bool] | None = None,
) -> list[WorkerOutcome]:
    """Send each request to the next idle worker (starting dead ones) and wait for the replies, in
    the requests' order. A worker that runs past `timeout_s` on a request, or dies, is stopped; it
    is started again for the next request, as is one whose reply satisfies `replace_after`."""
    outcomes = [WorkerOutcome() for _ in requests]
    pending = deque(range(len(requests)))
    busy: dict[WorkerProcess, tuple[int, float]] = {}
    while pending or busy:
        for worker in workers:
            if worker in busy or not pending:
                continue
            index = pending.popleft()
            try:
                if not worker.alive:
                    worker.start()
                worker.send(requests[index])
            except (RuntimeError, OSError) as exc:
                worker.stop()
                outcomes[index] = WorkerOutcome(failure="unavailable", detail=str(exc))
                continue
            busy[worker] = (index, time.monotonic())
        if not busy:
            continue
        wait = max(0.0, min(start for _, start in busy.values()) + timeout_s - time.monotonic())
        readable, _, _ = select.select(list(busy), [], [], wait)
        for worker in readable:
            index, start = busy[worker]
            open_ = worker.read_available()
            try:
                message = worker.take_message()
            except MalformedReply as exc:
                del busy[worker]
                worker.stop()
                outcomes[index] = WorkerOutcome(failure="died", detail=str(exc), elapsed_s=time.monotonic() - start)
                continue
            if message is not None:
                del busy[worker]
                outcomes[index] = WorkerOutcome(reply=message, elapsed_s=time.monotonic() - start)
                if replace_after is not None and replace_after(message):
                    worker.stop()
            elif not open_:
                del busy[worker]
                reason = worker.exit_reason()
                code = worker.proc.returncode
                outcomes[index] = WorkerOutcome(
                    failure="died",
                    detail=reason,
                    signal=-code if code is not None and code < 0 else None,
                    peak_rss_mb=worker.peak_rss_mb,
                    elapsed_s=time.monotonic() - start,
                )
                worker.stop()
        now = time.monotonic()
        for worker, (index, start) in list(busy.items()):
            if start + timeout_s <= now:
                del busy[worker]
                worker.stop()
                outcomes[index] = WorkerOutcome(failure="timeout", elapsed_s=now - start)
    return outcomes


def import_function(module_name: str, attr: str, label: str) -> Callable:
    """The callable at `attr` (a dotted attribute path) of module `module_name`; errors begin with `label`."""
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"{label}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"{label} is not callable")
    return fn
