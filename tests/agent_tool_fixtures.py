"""Tool functions for tests/test_agent_tools.py: a documented one, and one for each way a tool can fail."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from typing import Literal, Optional


def lookup(
    word: str,
    limit: int = 3,
    tags: list[str] | None = None,
    mode: Literal["exact", "prefix"] = "exact",
    weights: dict[str, float] | None = None,
    scale: Optional[float] = None,
    verbose: bool = False,
) -> dict:
    """Look a word up in a dictionary.

    Only the first paragraph is the tool's description.

    Args:
        word: The word to look up.
        limit (int): The most senses to return;
            a longer description goes on here.
        tags: Only senses with these tags.
        mode: How the word is matched.
        weights: A weight per tag.
        verbose: Whether to print what it does.

    Returns:
        The query as it was understood.
    """
    if verbose:
        print(f"looking up {word}")
    return {"word": word, "limit": limit, "tags": tags, "mode": mode, "weights": weights, "scale": scale}


def fail(message: str) -> str:
    """Raises ValueError(message)."""
    raise ValueError(message)


def sleep(seconds: float) -> str:
    """Sleeps, then says for how long."""
    time.sleep(seconds)
    return f"slept {seconds} s"


def rendezvous(directory: str, parties: int) -> str:
    """Arrives in `directory` and waits (up to 3 s) for `parties` arrivals in all: "met" if they all
    came, so calls that run one after another can never meet."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, str(os.getpid())), "w"):
        pass
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        if len(os.listdir(directory)) >= parties:
            return "met"
        time.sleep(0.01)
    return "alone"


def print_megabytes(megabytes: int) -> None:
    """Prints this many megabytes."""
    chunk = "x" * 2**20
    for _ in range(megabytes):
        print(chunk, end="")


def write_to_stdout_descriptor(text: str) -> str:
    """Writes to file descriptor 1 directly, below sys.stdout."""
    os.write(1, text.encode())
    sys.stdout.flush()
    return "written"


def allocate_gigabytes(gigabytes: int) -> int:
    """Allocates one buffer of this many GiB."""
    return len(bytearray(gigabytes * 2**30))


def grow_list() -> int:
    """Appends 1 MiB strings to a list until memory runs out."""
    items = []
    while True:
        items.append(b"x" * 2**20 + bytes([len(items) % 256]))


def exhaust_memory_in_c() -> str:
    """C code that fills malloc'd blocks without checking for NULL: it crashes at the memory limit."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    while True:
        block = libc.malloc(16 * 2**20)
        ctypes.memset(block or 0, 1, 16 * 2**20)


def segfault() -> str:
    """Dies of SIGSEGV, as a crashing C extension does."""
    os.kill(os.getpid(), signal.SIGSEGV)
    return "still alive"


def exit_worker(code: int) -> str:
    """Calls sys.exit."""
    sys.exit(code)


def untyped(word, limit: int = 3) -> str:
    return word


def star_args(*words: str) -> str:
    return " ".join(words)


def star_kwargs(word: str, **options: str) -> str:
    return word


def unsupported(words: set[str]) -> str:
    return " ".join(words)


def return_a_set() -> str:
    """Returns a value that JSON cannot hold."""
    return {1, 2}
