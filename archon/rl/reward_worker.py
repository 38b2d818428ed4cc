"""Worker processes for user code: `python -m MODULE PARENT_PID`, driven by the parent's `WorkerProcess`.

This module is the reward worker (`python -m archon.rl.reward_worker`, driven by `archon.rl.rewards.scorer`);
what every such worker shares is in `archon.workers`. It does not import torch.

Messages are length-prefixed pickles (8-byte big-endian length, then the payload), requests on
stdin and replies on the process's original stdout. Anything the user code prints to the process's
stdout goes to stderr, and its stdin is /dev/null, so it can neither corrupt nor consume the messages.

    ("init", payload, sys_path)              -> ("ready", None) | ("init_error", message)
    the reward worker's payload is the list of its reward function specs, and its requests name one by index:
    ("score", index, prompt, completion, reference, data_source, extra_info) -> ("ok", float)
    ("score_group", index, prompt, completions, reference, data_source, extra_info) -> ("ok", [float, ...])
    either of them                                          -> ("error", message, traceback text)

The worker exits when stdin closes, and on Linux is killed when its parent dies. The parent
enforces the time limit by killing the process.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

from archon.rl.reward_fns import call_group_reward, call_reward, call_style, resolve_reward_function
from archon.workers import (  # noqa: F401 - the shared worker machinery, at its old path for one release
    EXIT_WAIT_S,
    WORKER_STARTUP_TIMEOUT_S,
    WorkerOutcome,
    WorkerPool,
    WorkerProcess,
    describe_exception,
    read_message,
    run_on_workers,
    serve,
    write_message,
)


def load_reward_functions(specs: Sequence[str]) -> list[tuple[Callable, Any]]:
    """Each spec's function and its CallStyle."""
    functions = [resolve_reward_function(spec) for spec in specs]
    return [(fn, call_style(fn)) for fn in functions]


def score_request(functions: Sequence[tuple[Callable, Any]], message: tuple) -> tuple:
    """The reply to one "score" or "score_group" request (see the module doc)."""
    kind = message[0]
    if kind not in ("score", "score_group"):
        return ("error", f"unknown request {kind!r}")
    _, index, prompt, completion, reference, data_source, extra_info = message
    fn, style = functions[index]
    call = call_reward if kind == "score" else call_group_reward
    try:
        return ("ok", call(fn, prompt, completion, reference, data_source, extra_info, style))
    except Exception as exc:  # noqa: BLE001 - a failing reward is a counted error, not a crash
        return ("error", describe_exception(exc), traceback.format_exc())


def main() -> None:
    serve(load_reward_functions, score_request)


if __name__ == "__main__":
    main()
