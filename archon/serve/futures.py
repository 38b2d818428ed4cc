"""The futures protocol of the Tinker API: requests that compute are queued to one worker thread and
answered at once with a request id; `retrieve_future` then waits a few seconds for the result and
otherwise answers `try_again`. Sample requests of one sampler and settings queued together run as
one generation (Batch)."""

from __future__ import annotations

import queue
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import pydantic

from archon.serve.adapters import UserError
from archon.serve.wire import WireError


class HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


FUTURE_WAIT_SECONDS = 5.0
"""How long retrieve_future waits for a result before answering try_again."""
KEEP_RETRIEVED_SECONDS = 300.0
"""How long a retrieved result is kept for a client that retries its retrieve."""


@dataclass
class _Future:
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    """A dict (JSON) or bytes (protobuf) once done."""
    error: tuple[str, str] | None = None
    """(message, category "user" or "server") of a failed request."""
    retrieved_at: float | None = None


@dataclass
class Batch:
    """A request that may run together with others of the same `key`: `run_many(items)` gives each
    item's result, in order. Requests of one key must not depend on the order they run in (sample
    requests of one sampler do not: a sampler's adapter is a snapshot).

    A batch with an `owner` (a training client's model id) is taken only ahead of requests of other
    owners: scanning the queue in order, it stops at a request without owner, and passes over a
    request whose owner has a request before it (each client's requests keep their order)."""

    key: Hashable
    item: Any
    run_many: Callable[[list[Any]], list[Any]]
    owner: str | None = None


class Futures:
    """The requests queued to the worker thread, and their results by request id."""

    def __init__(self) -> None:
        self._items: dict[str, _Future] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self.batch_sizes: list[tuple[Hashable, int]] = []
        """(batch key, how many requests ran together) of each batch run (the last 1000)."""
        self._worker = threading.Thread(target=self._work, name="archon-serve-worker", daemon=True)
        self._worker.start()

    def submit(self, work: Callable[[], Any], batch: Batch | None = None, owner: str | None = None) -> str:
        """Queue `work`; with `batch`, the worker runs it together with the other queued requests of
        the same batch key (see Batch). `owner`: the model id the request acts on, if any."""
        request_id = f"req-{uuid.uuid4().hex}"
        with self._lock:
            now = time.monotonic()
            stale = [
                k for k, f in self._items.items() if f.retrieved_at and now - f.retrieved_at > KEEP_RETRIEVED_SECONDS
            ]
            for key in stale:
                del self._items[key]
            self._items[request_id] = _Future()
        self._queue.put((request_id, work, batch, batch.owner if batch is not None else owner))
        return request_id

    def queued(self) -> int:
        """How many requests wait for the worker (not counting the one it runs)."""
        return self._queue.qsize()

    def run_now(self, work: Callable[[], Any]) -> Any:
        """Run `work` on the worker thread and wait for it; a refusal raises HTTPError(400)."""
        request_id = self.submit(work)
        future = self._items[request_id]
        future.done.wait()
        with self._lock:
            del self._items[request_id]
        if future.error is not None:
            raise HTTPError(400 if future.error[1] == "user" else 500, future.error[0])
        return future.result

    def _work(self) -> None:
        while True:
            request_id, work, batch, owner = self._queue.get()
            if batch is None:
                self._run(request_id, work)
                continue
            taken = self._take_queued(batch.key) if owner is None else self._take_owned(batch.key, owner)
            jobs = [(request_id, work, batch, owner), *taken]
            try:
                results = batch.run_many([job[2].item for job in jobs])
            except Exception:  # noqa: BLE001 - one bad request: each runs alone and gets its own answer
                for job_id, job_work, _, _ in jobs:
                    self._run(job_id, job_work)
                continue
            self.batch_sizes = [*self.batch_sizes[-999:], (batch.key, len(jobs))]
            for (job_id, _, _, _), result in zip(jobs, results):
                self._items[job_id].result = result
                self._items[job_id].done.set()

    def _take_queued(self, key) -> list[tuple]:
        """Remove the queued requests of batch `key` from the queue, in their order."""
        with self._queue.mutex:
            taken = [job for job in self._queue.queue if job[2] is not None and job[2].key == key]
            kept = [job for job in self._queue.queue if job[2] is None or job[2].key != key]
            self._queue.queue.clear()
            self._queue.queue.extend(kept)
        return taken

    def _take_owned(self, key, first_owner: str) -> list[tuple]:
        """Remove from the queue the requests of batch `key` that each owner's earlier requests do not
        precede, one per owner, scanning up to the first request without owner (see Batch)."""
        seen = {first_owner}
        taken_ids = set()
        with self._queue.mutex:
            for job in self._queue.queue:
                owner = job[3]
                if owner is None:
                    break
                if job[2] is not None and job[2].key == key and owner not in seen:
                    taken_ids.add(job[0])
                seen.add(owner)
            taken = [job for job in self._queue.queue if job[0] in taken_ids]
            kept = [job for job in self._queue.queue if job[0] not in taken_ids]
            self._queue.queue.clear()
            self._queue.queue.extend(kept)
        return taken

    def _run(self, request_id: str, work: Callable[[], Any]) -> None:
        future = self._items[request_id]
        try:
            future.result = work()
        except (UserError, WireError, pydantic.ValidationError) as e:
            future.error = (str(e), "user")
        except Exception as e:  # noqa: BLE001 - a failed request must not stop the worker
            traceback.print_exc()
            future.error = (f"{type(e).__name__}: {e}", "server")
        future.done.set()

    def retrieve(self, request_id: str) -> Any:
        with self._lock:
            future = self._items.get(request_id)
        if future is None:
            raise HTTPError(404, f"unknown request id {request_id!r}")
        if not future.done.wait(FUTURE_WAIT_SECONDS):
            return {"type": "try_again", "request_id": request_id, "queue_state": "active"}
        future.retrieved_at = future.retrieved_at or time.monotonic()
        if future.error is not None:
            return {"error": future.error[0], "category": future.error[1]}
        return future.result
