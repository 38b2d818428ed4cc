"""Stopping a run on SIGTERM as on Ctrl-C."""

from __future__ import annotations

import contextlib
import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C raises KeyboardInterrupt (see terminate_as_interrupt)."""


@contextlib.contextmanager
def terminate_as_interrupt():
    """Within the block, SIGTERM (what Slurm and Kubernetes send to stop a job) raises Terminated,
    a KeyboardInterrupt, on the main thread, so that a run stops as on Ctrl-C: it closes the vLLM
    servers it launched (in their own process groups, which the signal does not reach) and its
    reward workers. The previous handler is restored after the block. Off the main thread, where
    Python runs no signal handlers, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame) -> None:
        raise Terminated(f"received {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
