"""A rank whose launcher is gone stops.

torchrun starts the ranks as its children; when it is killed outright (SIGKILL, an OOM kill) it
cannot stop them, and they would train on as orphans, holding their devices. Under torchrun each
rank watches its launcher: once the launcher's process is gone, the rank sends itself SIGTERM (which
stops a run as Ctrl-C does, closing the vLLM servers it launched; see .interrupt), and SIGKILL if it
is still alive `grace_s` later (say, blocked in a collective with a rank that is gone).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

POLL_S = 0.5
GRACE_S = 30.0

_watching = False


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def watch_launcher(grace_s: float = GRACE_S) -> bool:
    """Under torchrun, start watching the launcher (once per process); whether a watch runs."""
    global _watching
    if _watching or not under_torchrun():
        return _watching
    launcher = os.getppid()
    threading.Thread(target=_watch, args=(launcher, grace_s), name="archon-launcher-watch", daemon=True).start()
    _watching = True
    return True


def _watch(launcher: int, grace_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(POLL_S)
    _stop(launcher, grace_s)


def _stop(launcher: int, grace_s: float) -> None:
    print(
        f"archon: rank {os.environ.get('RANK', '?')}: the torchrun launcher (pid {launcher}) is gone; stopping",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGKILL)
