"""Where an episode's environment runs: its `reset` and `step` are calls that the episode loop can
abandon, and the process they run in is killed when the episode is over.

- An environment named "module:Class" (user code) runs in a worker process of its own
  (archon/workers.py), one per episode: a call that runs past its deadline is abandoned and the
  process killed, so that nothing of it outlives the episode.
- An Environment object built in this process (the built-in tool_use environment, tests) runs its
  calls on daemon threads: a call past its deadline is abandoned, and a run that ends does not wait
  for it.

Both answer `submit(method, *args)` with a `Pending` call, whose `result(deadline)` is
(value, None) or (None, (StopReason, error)). The messages to the worker are plain data (dicts,
lists, strings and numbers): a turn and its tool results go as dicts, an EnvStep comes back as one.

    ("reset", row)                  -> ("ok", messages) | ("error", description)
    ("step", turn, tool_results)    -> ("ok", {"messages", "reward", "done", "answer"}) | ("error", description)
    ("close",)                      -> ("ok", None)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import threading
import time
from typing import Any

from archon.agents.environment import Environment, EnvStep
from archon.agents.renderer import AssistantTurn, ToolCall
from archon.agents.tools import ToolResult
from archon.agents.trajectory import StopReason
from archon.workers import WorkerProcess, describe_exception, import_function, serve

CLOSE_WAIT_S = 1.0
"""How long an environment's `close` is waited for (a worker's process is killed after it)."""


def checked_reward(reward: Any, where: str) -> tuple[float | None, str | None]:
    """A reward an environment gave: (the float, None), or (None, what is wrong: not a real number,
    or not finite), naming `where` it came from."""
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real):  # numpy's floats are Real
        return None, f"{where} gave the reward {reward!r} ({type(reward).__name__}), not a number"
    value = float(reward)
    if not math.isfinite(value):
        return None, f"{where} gave the reward {value!r}, not a finite number"
    return value, None


def step_failure(step: Any, label: str) -> str | None:
    """What is wrong with what an environment's `step` returned, or None when it is a valid EnvStep."""
    if not isinstance(step, EnvStep):
        return f"{label}.step returned {type(step).__name__}, expected an EnvStep"
    _, error = checked_reward(step.reward, f"{label}.step")
    return error


class Pending:
    """One call under way; `result(deadline)` waits for it until `deadline` (time.monotonic())."""

    def result(self, deadline: float) -> tuple[Any, tuple[StopReason, str] | None]:
        raise NotImplementedError


class _ThreadCall(Pending):
    def __init__(self, fn, args, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.done = threading.Event()
        self.value: Any = None
        self.error: str | None = None
        # a daemon thread: a call that never returns keeps neither the episode nor the process waiting
        threading.Thread(target=self._run, args=(fn, args), name="archon-env-call", daemon=True).start()

    def _run(self, fn, args) -> None:
        try:
            self.value = fn(*args)
        except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, not the run
            self.error = describe_exception(exc)
        self.done.set()

    def result(self, deadline: float):
        if not self.done.wait(max(0.0, deadline - time.monotonic())):
            return None, (StopReason.TIMEOUT, f"the environment took more than {self.timeout_s} s")
        if self.error is not None:
            return None, (StopReason.ENV_ERROR, self.error)
        return self.value, None


class InProcessEnvironment:
    """An Environment object's calls, each on a daemon thread."""

    def __init__(self, env: Environment, timeout_s: float) -> None:
        self.env, self.timeout_s = env, timeout_s
        self.environment_class = type(env)

    def submit(self, method: str, *args) -> Pending:
        return _ThreadCall(getattr(self.env, method), args, self.timeout_s)

    def close(self) -> None:
        """The environment's `close`, waited for CLOSE_WAIT_S at most (best effort: its failure is ignored)."""
        _ThreadCall(self.env.close, (), CLOSE_WAIT_S).result(time.monotonic() + CLOSE_WAIT_S)


class _WorkerCall(Pending):
    def __init__(self, owner: EnvironmentProcess, failure: tuple[StopReason, str] | None) -> None:
        self.owner, self.failure = owner, failure

    def result(self, deadline: float):
        if self.failure is not None:
            return None, self.failure
        return self.owner.receive(deadline)


class EnvironmentProcess:
    """The environment class `spec` ("module:Class") in a worker process of its own, started at the
    first call; every call gets `timeout_s`, after which the process is killed."""

    def __init__(self, spec: str, environment_class: type[Environment], timeout_s: float) -> None:
        self.spec, self.environment_class, self.timeout_s = spec, environment_class, timeout_s
        self.label = f"environment {spec!r}"
        self.worker = WorkerProcess("archon.agents.environment_worker", spec, self.label)
        self.broken: tuple[StopReason, str] | None = None

    def submit(self, method: str, *args) -> Pending:
        if self.broken is not None:
            return _WorkerCall(self, self.broken)
        try:
            if not self.worker.alive:
                self.worker.start()
            self.worker.send((method, *[_plain(arg) for arg in args]))
        except (RuntimeError, OSError) as exc:
            self.kill()
            self.broken = (StopReason.ENV_ERROR, f"{self.label}: {exc}")
            return _WorkerCall(self, self.broken)
        return _WorkerCall(self, None)

    def receive(self, deadline: float):
        reply = self.worker.receive(deadline)
        if reply is None:
            self.kill()
            self.broken = (
                StopReason.TIMEOUT,
                f"{self.label} took more than {self.timeout_s} s (its process was killed)",
            )
            return None, self.broken
        if reply == "eof":
            self.broken = (StopReason.ENV_ERROR, f"{self.label}'s process ended: {self.worker.exit_reason()}")
            self.kill()
            return None, self.broken
        if reply[0] == "error":
            return None, (StopReason.ENV_ERROR, reply[1])
        return reply[1], None

    def kill(self) -> None:
        self.worker.stop()

    def close(self) -> None:
        """Run the environment's `close` (briefly), then end the process."""
        if self.worker.alive and self.broken is None:
            try:
                self.worker.send(("close",))
                self.worker.receive(time.monotonic() + CLOSE_WAIT_S)
            except OSError:
                pass
        self.kill()


def _plain(value: Any) -> Any:
    """A turn or tool results as plain data for the worker."""
    if isinstance(value, AssistantTurn):
        return dataclasses.asdict(value)
    if isinstance(value, list) and value and isinstance(value[0], ToolResult):
        return [{"content": r.content, "status": r.status} for r in value]
    return value


# ---- the worker's side ----------------------------------------------------------------------------
def _load(spec: str) -> dict:
    module_name, _, attr = spec.partition(":")
    return {"class": import_function(module_name, attr, f"environment.name {spec!r}"), "env": None, "label": spec}


def _turn(data: dict) -> AssistantTurn:
    calls = [ToolCall(**call) for call in data.get("tool_calls", [])]
    return AssistantTurn(**{**data, "tool_calls": calls})


def _results(data: list[dict]) -> list[ToolResult]:
    return [ToolResult(content=r["content"], status=r["status"]) for r in data]


def _handle(state: dict, request: tuple) -> tuple:
    label = state["label"].rpartition(":")[2] or state["label"]
    try:
        if request[0] == "reset":
            state["env"] = state["class"]()
            return ("ok", list(state["env"].reset(request[1])))
        if request[0] == "step":
            step = state["env"].step(_turn(request[1]), _results(request[2]))
            error = step_failure(step, label)
            if error is not None:
                return ("error", error)
            reward, _ = checked_reward(step.reward, label)
            return (
                "ok",
                {"messages": list(step.messages), "reward": reward, "done": bool(step.done), "answer": step.answer},
            )
        if request[0] == "close":
            if state["env"] is not None:
                state["env"].close()
            return ("ok", None)
        return ("error", f"unknown request {request[0]!r}")
    except Exception as exc:  # noqa: BLE001 - an environment's failure ends its episode, not the run
        return ("error", describe_exception(exc))


if __name__ == "__main__":
    serve(_load, _handle)
