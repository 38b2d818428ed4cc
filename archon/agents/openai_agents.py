"""Agent code written against an OpenAI client, as RL episodes.

An agent is a function `agent_fn(base_url, row) -> reward`: it talks to the model through
`openai.OpenAI(base_url=base_url, ...)` however it likes (tools, several turns, its own loop) and
returns its reward. A group is G such agents on the same row, each on its own session of a
ChatCompletionsServer (archon/agents/openai_server.py); each session's trajectory is what trains.
While a group runs, OPENAI_API_KEY holds the endpoint's token, which the openai client reads.
"""

from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from collections.abc import Callable

from archon.agents.environment import StopReason
from archon.agents.openai_server import ChatCompletionsServer
from archon.agents.trajectory import Trajectory

AgentFn = Callable[[str, dict], float]
API_KEY_ENV = "OPENAI_API_KEY"
"""Where agent code finds the endpoint's token: the variable the openai client reads."""


class _TokenInEnvironment:
    """API_KEY_ENV holds the endpoint's token while any agent group runs, and what it held before
    once none does (a group's agents run in this process's threads: the environment is shared)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._groups, self._token, self._before = 0, None, None

    @contextlib.contextmanager
    def holding(self, token: str):
        with self._lock:
            if self._groups and token != self._token:
                raise ValueError(
                    f"agent groups of servers with different api_keys cannot run at once: {API_KEY_ENV} holds "
                    "one token for the whole process"
                )
            if not self._groups:
                self._token, self._before = token, os.environ.get(API_KEY_ENV)
                os.environ[API_KEY_ENV] = token
            self._groups += 1
        try:
            yield
        finally:
            with self._lock:
                self._groups -= 1
                if not self._groups:
                    if self._before is None:
                        os.environ.pop(API_KEY_ENV, None)
                    else:
                        os.environ[API_KEY_ENV] = self._before
                    self._token = self._before = None


_token_in_environment = _TokenInEnvironment()


def run_agent_group(
    server: ChatCompletionsServer,
    agent_fn: AgentFn,
    row: dict,
    group_size: int,
    timeout_s: float | None = None,
) -> list[Trajectory]:
    """Run `agent_fn` G times at once on `row`, each in a thread of its own with a session of its
    own; the sessions' trajectories, with the agents' rewards and stop reasons:
    done (the agent returned its reward), env_error (it raised, returned something that is not a
    finite number, or made no request; `error` says which), timeout (it ran past `timeout_s`: its
    session is closed, so its later requests get an error, and its thread is left to end).
    The agents find the server's token in OPENAI_API_KEY (put back as it was when the group ends)."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    with _token_in_environment.holding(server.api_key):
        return _run_group(server, agent_fn, row, group_size, timeout_s)


def _run_group(server, agent_fn, row, group_size, timeout_s) -> list[Trajectory]:
    sessions = [server.open_session() for _ in range(group_size)]
    outcomes: list[tuple[str, object]] = [("running", None)] * group_size

    def run(i: int) -> None:
        try:
            outcomes[i] = ("returned", agent_fn(sessions[i].base_url, dict(row)))
        except BaseException as e:  # recorded as the episode's stop reason
            outcomes[i] = ("raised", e)

    threads = [threading.Thread(target=run, args=(i,), name=f"agent-{i}", daemon=True) for i in range(group_size)]
    for thread in threads:
        thread.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    trajectories = []
    for i, (thread, session) in enumerate(zip(threads, sessions)):
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            why = f"the agent ran past timeout_s={timeout_s}"
            trajectory = server.close_session(session.id, reason=why)
            trajectory.stop_reason, trajectory.error = StopReason.TIMEOUT, why
            trajectories.append(trajectory)
            continue
        trajectory = server.close_session(session.id, reason="the agent's episode is over")
        kind, value = outcomes[i]
        if kind == "raised":
            trajectory.stop_reason, trajectory.error = StopReason.ENV_ERROR, f"{type(value).__name__}: {value}"
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            trajectory.stop_reason = StopReason.ENV_ERROR
            trajectory.error = f"the agent returned {value!r}, not a finite number as its reward"
        elif not trajectory.prompt_ids:
            trajectory.stop_reason, trajectory.error = (
                StopReason.ENV_ERROR,
                "the agent made no chat request on its session",
            )
        else:
            trajectory.stop_reason, trajectory.reward = StopReason.DONE, float(value)
        trajectories.append(trajectory)
    return trajectories
