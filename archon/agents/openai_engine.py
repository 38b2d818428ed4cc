"""The chat-completions endpoint's engine side (archon.agents.openai_server): one thread calls the
rollout engine for every request, batching those that arrive together, and `engine_context` says
how long a sequence the engine serves."""

from __future__ import annotations

import concurrent.futures
import inspect
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from archon.agents.openai_protocol import OpenAIError
from archon.rollout.base import Sample, SamplingParams

logger = logging.getLogger("archon.agents.openai_server")  # the endpoint's one logger


def engine_context(engine) -> int | None:
    """The most tokens (prompt and sampled) one sequence may hold on `engine`: a vLLM server set's
    max_model_len, the built-in engine's model's max_position_embeddings; None when it does not say."""
    served = getattr(engine, "max_model_len", None)
    if isinstance(served, int):
        return served
    positions = getattr(getattr(getattr(engine, "model", None), "args", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) else None


@dataclass
class Pending:
    """One request's share of an engine call."""

    prompt_ids: list[int]
    sampling: SamplingParams
    engine_session: str | None
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    cancelled: threading.Event | None = None
    """Set when the request's session closed before its call: it is dropped."""


class EngineThread:
    """Calls the engine from one thread: requests that arrive within `window_s` of the first (at most
    `max_batch`), grouped by sampling parameters, one `generate` call per group; then the engine
    sessions that ended."""

    def __init__(self, engine, window_s: float, max_batch: int) -> None:
        self.engine, self.window_s, self.max_batch = engine, window_s, max_batch
        self.uses_sessions = "sessions" in inspect.signature(engine.generate).parameters
        self.generate_calls = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="chat-completions-engine", daemon=True)
        self._thread.start()

    def submit(self, pending: Pending) -> Sample:
        self._queue.put(pending)
        return pending.future.result()

    def end_session(self, key: str) -> None:
        if self.uses_sessions and hasattr(self.engine, "end_sessions"):
            self._queue.put(("end", key))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        while not self._queue.empty():  # requests that came after the close
            item = self._queue.get()
            if isinstance(item, Pending):
                item.future.set_exception(OpenAIError(503, "the server is closing", kind="server_error"))

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            items, deadline, closing = [first], time.monotonic() + self.window_s, False
            while sum(isinstance(item, Pending) for item in items) < self.max_batch:
                try:
                    item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                if item is None:
                    closing = True
                    break
                items.append(item)
            self._serve(items)
            if closing:
                return

    def _serve(self, items: list) -> None:
        groups: dict[tuple, list[Pending]] = {}
        for item in items:
            if isinstance(item, Pending):
                if item.cancelled is not None and item.cancelled.is_set():
                    item.future.set_exception(OpenAIError(400, "the session was closed", "session_id"))
                    continue
                groups.setdefault(tuple(vars(item.sampling).items()), []).append(item)
        for group in groups.values():
            sampling = group[0].sampling
            try:
                kwargs = {"sessions": [p.engine_session for p in group]} if self.uses_sessions else {}
                self.generate_calls += 1
                samples = self.engine.generate([p.prompt_ids for p in group], sampling, **kwargs)
            except Exception as e:  # handed to each request of the call
                for p in group:
                    p.future.set_exception(e)
                continue
            for p, sample in zip(group, samples, strict=True):
                p.future.set_result(sample)
        ended = [item[1] for item in items if isinstance(item, tuple)]
        if ended:
            try:
                self.engine.end_sessions(ended)
            except Exception:
                logger.exception("the engine failed to end sessions %s", ended)
