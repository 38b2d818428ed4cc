"""A reward worker process: `python -m archon.rl.reward_worker PARENT_PID`, driven by `archon.rl.rewards`.

Messages are length-prefixed pickles (8-byte big-endian length, then the payload), requests on
stdin and replies on the process's original stdout. Anything the reward function prints goes to
stderr, so it cannot corrupt the replies.

    ("init", spec, sys_path)                 -> ("ready", None) | ("init_error", message)
    ("score", prompt, completion, reference) -> ("ok", float) | ("error", message, traceback text)

The worker exits when stdin closes, and on Linux is killed when its parent dies. The parent
enforces the time limit by killing the process.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import struct
import sys
import traceback
from typing import Any, BinaryIO

from archon.rl.reward_fns import call_reward, resolve_reward_function

_HEADER = struct.Struct(">Q")


def write_message(stream: BinaryIO, message: Any) -> None:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(payload)) + payload)
    stream.flush()


def read_message(stream: BinaryIO) -> Any | None:
    """The next message, or None at end of stream."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return pickle.loads(payload)


def _describe(exc: BaseException) -> str:
    last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
    where = f" (at {last[0].filename}:{last[0].lineno})" if last else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _exit_with_parent(parent_pid: int) -> None:
    """Linux: get SIGKILL when the parent dies, so a worker stuck in a reward function is not orphaned."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent is already gone
        os._exit(1)


def main() -> None:
    if len(sys.argv) > 1:
        _exit_with_parent(int(sys.argv[1]))
    replies = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer

    fn = None
    while (message := read_message(requests)) is not None:
        kind = message[0]
        if kind == "init":
            _, spec, sys_path = message
            for entry in reversed(sys_path):
                if entry not in sys.path:
                    sys.path.insert(0, entry)
            try:
                fn = resolve_reward_function(spec)
            except Exception as exc:  # noqa: BLE001 - reported to the parent
                write_message(replies, ("init_error", _describe(exc)))
                continue
            write_message(replies, ("ready", None))
        elif kind == "score":
            _, prompt, completion, reference = message
            try:
                write_message(replies, ("ok", call_reward(fn, prompt, completion, reference)))
            except Exception as exc:  # noqa: BLE001 - a failing reward is a counted error, not a crash
                write_message(replies, ("error", _describe(exc), traceback.format_exc()))
        else:
            write_message(replies, ("error", f"unknown request {kind!r}"))


if __name__ == "__main__":
    main()
