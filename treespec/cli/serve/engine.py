"""The engine loop: ONE ``SpeculativeServer`` stepped on its own thread for every HTTP request.

    HTTP handlers ──submit(job)──► inbox (bounded: QueueFull past ``max_queue``) ──► loop thread
    loop thread, between steps:  cancels  -> server.cancel (KV rows and drafter state freed)
                                 inbox    -> server.add_request, up to ``max_batch`` live
                                 step     -> each job's new tokens to job.deliver(...)
    job.deliver is called on the loop thread; the front door hands the events to its event loop.

Failures stay with their request where the server can tell whose they are: a request the
server refuses (``add_request``) or whose admission fails (its prefill or its drafter's
``begin``: the server rolls the admission back) ends alone with an ``Error``; when several
joined at once, they are retried one per step so the one that fails is found. A failure of the
shared decoding step (one batched forward for all: the server restores every request as it
was) is retried once; if it fails again, every request of that step ends with an ``Error`` and
the loop goes on with the queue. Nothing a request does stops the loop.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

from treespec.core.sampling import SamplingConfig
from treespec.runtime.server import SpeculativeServer


@dataclass(frozen=True)
class Tokens:
    """New token ids of a job (one step's accepted tokens, never past its limit)."""

    ids: tuple[int, ...]


@dataclass(frozen=True)
class Done:
    """The job ended: "eos", "length" or "cancelled"; ``tokens``: all its new ids."""

    reason: Literal["eos", "length", "cancelled"]
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Error:
    """The job failed; the message says why (the HTTP answer is a 500 with it)."""

    message: str


Event = Tokens | Done | Error


class QueueFull(Exception):
    """The inbox holds ``max_queue`` jobs; retry after ``retry_after`` seconds."""

    def __init__(self, depth: int, retry_after: int):
        super().__init__(f"the queue is full ({depth} requests waiting); retry in {retry_after} s")
        self.depth, self.retry_after = depth, retry_after


class Draining(Exception):
    """The engine is shutting down and takes no new requests."""


@dataclass(eq=False)
class Job:
    """One request inside the engine. ``deliver`` receives its events on the loop thread."""

    # LongTensor[P]
    ids: torch.Tensor
    sampling: SamplingConfig
    max_new_tokens: int
    seed: int | None
    deliver: Callable[[Event], None]
    submitted: float = field(default_factory=time.perf_counter)
    rid: int | None = None              # the server's id once added
    cancel_requested: bool = False
    finished: bool = False
    tokens_out: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None


class EngineObserver:
    """What the engine reports (metrics). The default records nothing."""

    def on_tokens(self, job: Job, count: int, now: float) -> None: ...

    def on_finish(self, job: Job, outcome: str) -> None: ...


class Engine:
    """See the module docstring. ``max_queue``: jobs waiting to join (not yet decoding);
    ``max_batch``: requests decoded together."""

    def __init__(self, server: SpeculativeServer, max_queue: int = 64, max_batch: int = 8,
                 observer: EngineObserver | None = None):
        for name, value in (("max_queue", max_queue), ("max_batch", max_batch)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.server, self.max_queue, self.max_batch = server, max_queue, max_batch
        self.observer = observer or EngineObserver()
        self._cond = threading.Condition()
        self._inbox: collections.deque[Job] = collections.deque()
        self._solo: collections.deque[Job] = collections.deque()   # failed group admissions, one per step
        self._cancels: list[Job] = []
        self._jobs: dict[int, Job] = {}                              # server id -> live or queued job
        self._stopping = False
        self.draining = False
        self.step_seconds = 0.0                                      # EWMA of a step's wall time
        self._thread = threading.Thread(target=self._run, name="treespec-engine", daemon=True)

    # ------------------------------------------------------------------ the HTTP side
    def start(self) -> None:
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._inbox) + len(self._solo)

    @property
    def live(self) -> int:
        return len(self._jobs)

    def submit(self, job: Job) -> None:
        """Queue ``job``; QueueFull past ``max_queue`` waiting, Draining when shutting down."""
        with self._cond:
            if self.draining or self._stopping:
                raise Draining("the server is shutting down")
            if self.queue_depth >= self.max_queue:
                wait = max(1, round(self.step_seconds * self.queue_depth))
                raise QueueFull(self.queue_depth, wait)
            self._inbox.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """End ``job`` at the next step boundary (a client that left, a stop string)."""
        with self._cond:
            if job.finished or job.cancel_requested:
                return
            job.cancel_requested = True
            self._cancels.append(job)
            self._cond.notify()

    def drain(self, timeout: float) -> bool:
        """Take no new requests; wait up to ``timeout`` s for the queued and live ones to finish,
        then cancel what is left and stop the loop. True when everything finished in time."""
        with self._cond:
            self.draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and (self.queue_depth or self._jobs):
            time.sleep(0.02)
        clean = not (self.queue_depth or self._jobs)
        self.stop()
        return clean

    def stop(self) -> None:
        """Cancel everything left and end the loop thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout=60)

    # ------------------------------------------------------------------ the loop thread
    def _run(self) -> None:
        server = self.server
        while True:
            with self._cond:
                while not (self._stopping or self._inbox or self._solo or self._cancels or server.live
                           or server.queued):
                    self._cond.wait()
                if self._stopping:
                    break
                cancels, self._cancels = self._cancels, []
                room = self.max_batch - len(server.live) - len(server.queued)
                joining: list[Job] = []
                if self._solo and room > 0:
                    joining.append(self._solo.popleft())
                while self._inbox and room - len(joining) > 0 and not self._solo:
                    joining.append(self._inbox.popleft())
            for job in cancels:
                self._cancel_now(job)
            for job in joining:
                self._add(job)
            if server.live or server.queued:
                self._step()
        self._shutdown()

    def _add(self, job: Job) -> None:
        if job.cancel_requested:
            self._finish(job, Done("cancelled", ()), "cancelled")
            return
        try:
            job.rid = self.server.add_request(job.ids, job.sampling, job.max_new_tokens, job.seed)
        except Exception as e:                  # noqa: BLE001 - the request's own error, answered as such
            self._finish(job, Error(f"the request was refused: {e}"), "error")
            return
        self._jobs[job.rid] = job

    def _cancel_now(self, job: Job) -> None:
        if job.finished:
            return
        if job.rid is None:                     # still in the inbox (or solo): it never joins
            with self._cond:
                for pool in (self._inbox, self._solo):
                    if job in pool:
                        pool.remove(job)
            self._finish(job, Done("cancelled", ()), "cancelled")
            return
        if job.rid not in self.server.finished:     # it may have finished in this very step
            self.server.cancel(job.rid)         # frees its KV rows and drafter state now
        result = self.server.finished.pop(job.rid)
        del self._jobs[job.rid]
        self._finish(job, Done("cancelled", result.tokens), "cancelled")

    def _step(self) -> None:
        server = self.server
        joining = [self._jobs[r] for r in server.queued]
        t0 = time.perf_counter()
        try:
            out = server.step()
        except Exception as first:              # noqa: BLE001 - see the module docstring
            if server.queued:                   # the admission failed: the joiners never joined
                self._admission_failed(joining, first)
                return
            try:
                out = server.step()
            except Exception as again:          # noqa: BLE001
                for rid in list(server.live):
                    job = self._jobs.pop(rid)
                    server.cancel(rid)
                    server.finished.pop(rid)
                    self._finish(job, Error(f"the decoding step failed: {type(again).__name__}: {again}"), "error")
                return
        now = time.perf_counter()
        dt = now - t0
        self.step_seconds = dt if self.step_seconds == 0 else 0.9 * self.step_seconds + 0.1 * dt
        for rid, tokens in out.items():
            job = self._jobs[rid]
            if tokens:
                job.tokens_out += len(tokens)
                self.observer.on_tokens(job, len(tokens), now)
                job.first_token_at = job.first_token_at or now
                job.last_token_at = now
                self._deliver(job, Tokens(tuple(tokens)))
        for rid in [r for r in out if r in server.finished]:
            job = self._jobs.pop(rid)
            result = server.finished.pop(rid)
            self._finish(job, Done(result.reason, result.tokens), "stop" if result.reason == "eos" else result.reason)

    def _admission_failed(self, joining: list[Job], error: Exception) -> None:
        """The queued requests' admission failed and was rolled back: alone, the one request
        ends with an Error; several are taken out and retried one per step."""
        for job in joining:
            self.server.cancel(job.rid)         # queued: it just leaves the queue
            self.server.finished.pop(job.rid)
            del self._jobs[job.rid]
            job.rid = None
        if len(joining) == 1:
            self._finish(joining[0], Error(f"the request failed to start: {type(error).__name__}: {error}"), "error")
            return
        with self._cond:
            self._solo.extend(joining)

    def _deliver(self, job: Job, event: Event) -> None:
        try:
            job.deliver(event)
        except Exception:                       # noqa: BLE001 - the client is gone: cancel it
            if not isinstance(event, (Done, Error)) and not job.cancel_requested:
                job.cancel_requested = True
                self._cancel_now(job)

    def _finish(self, job: Job, event: Event, outcome: str) -> None:
        if job.finished:
            return
        job.finished = True
        self.observer.on_finish(job, outcome)
        self._deliver(job, event)

    def _shutdown(self) -> None:
        with self._cond:
            waiting = list(self._inbox) + list(self._solo)
            self._inbox.clear()
            self._solo.clear()
        for job in waiting:
            self._finish(job, Error("the server shut down before the request started"), "error")
        for rid in list(self.server.live) + list(self.server.queued):
            job = self._jobs.pop(rid)
            self.server.cancel(rid)
            result = self.server.finished.pop(rid)
            self._finish(job, Done("cancelled", result.tokens), "cancelled")
