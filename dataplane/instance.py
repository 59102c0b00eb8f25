"""One registered engine buffer: its worker, its calls in flight, and what it reports.

This module owns an instance's own life once registered; the table of instances, registration's
checks, capabilities and leases are ``dataplane.instances``'s, the saved table
``dataplane.statefile``'s. Each instance has its own FIFO queue and worker thread: calls for one
instance start in the order they arrived (and queue their GPU work on the instance's own stream,
so their copies run in that order too); calls for different instances run concurrently.

A call runs in two parts (``dataplane.transfer.Call``): its start (checks, reservations or pins,
every copy queued) on the worker, its end (wait for the copies, commit or unpin, reply) on the
instance's completion thread, so the worker prepares the next call while the GPU still copies
the previous ones. When no call waits behind it, the worker ends the call itself (one thread
hand-off fewer). Calls of one instance in flight (started, not ended)::

    worker starts a call      when fewer than MAX_IN_FLIGHT are in flight; a retrieve also
                              waits until no store is in flight (it sees their commits)
    completion thread ends    in the order the calls started
    unregister / drop / stop  wait until none is in flight, then close the buffer
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from kvblend.dataplane.backend import InstanceBuffer
from kvblend.dataplane.errors import TooMany
from kvblend.dataplane.messages import InstanceInfo
from kvblend.dataplane.registration import BufferKind, Registration
from kvblend.shm.layout import KVLayout

log = logging.getLogger("kvblend.dataplane")

Job = Callable[["Instance"], bool]  # returns False to stop the worker
MAX_QUEUED = 64  # calls waiting on one instance; more are refused with TooMany
MAX_IN_FLIGHT = 4  # calls of one instance started and not yet ended (reservations or pins held)
Done = Callable[[Any, "BaseException | None"], None]  # a call's result or its error


@dataclass(eq=False)
class Instance:
    """One registered engine buffer: its registration, capability, lease, worker and calls in
    flight (the tables above). The ``Registry`` creates, finds and drops it."""

    id: int
    token: str
    request: Registration
    layout: KVLayout
    class_id: int
    buffer: InstanceBuffer
    owner_uid: int
    client: int | None          # the connection that registered it; None once restored
    expires: float              # time.monotonic() deadline of the lease
    caller: str | None = None   # the HTTP caller the API registered it for; None: the socket
    jobs: "queue.SimpleQueue[Job]" = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    dropping: bool = False
    _queued: int = 0
    _qlock: threading.Lock = field(default_factory=threading.Lock)
    _ends: "queue.SimpleQueue[tuple[Generator[None, None, Any], Done, bool] | None]" = field(
        default_factory=queue.SimpleQueue)
    _ender: threading.Thread | None = None
    _flight: threading.Condition = field(default_factory=threading.Condition)
    _in_flight: int = 0
    _stores: int = 0

    @property
    def rank(self) -> int:
        return self.request.worker_id or 0

    @functools.cached_property
    def rotary_freqs(self) -> Any:
        """The float32 frequencies of its rotary config (``dataplane.rotary``; torch, computed
        on its worker when a retrieve first turns K)."""
        from kvblend.dataplane import rotary
        assert self.request.rotary is not None, "only instances with a rotary config turn K"
        return rotary.frequencies(self.request.rotary)

    def info(self) -> InstanceInfo:
        r = self.request
        return InstanceInfo(instance_id=self.id, model_name=r.model_name, world_size=r.world_size,
                            worker_id=r.worker_id, num_layers=r.num_layers,
                            num_tokens=r.num_tokens, hidden_dim=r.hidden_dim,
                            dtype=r.dtype,
                            buffer_kind=BufferKind(r.buffer.__struct_config__.tag))

    def submit(self, job: Job, *, bounded: bool = True) -> None:
        """Queue ``job`` on the worker.

        Raises:
            TooMany: ``MAX_QUEUED`` calls already wait (only when ``bounded``).
        """
        with self._qlock:
            if bounded and self._queued >= MAX_QUEUED:
                raise TooMany(f"instance {self.id} has {MAX_QUEUED} calls queued: wait for some")
            self._queued += 1
        self.jobs.put(job)

    def start(self) -> None:
        """Start the worker and the completion thread."""
        self.thread = threading.Thread(target=self._work, name=f"instance-{self.id}", daemon=True)
        self._ender = threading.Thread(target=self._end_calls, name=f"instance-{self.id}-end",
                                       daemon=True)
        self._ender.start()
        self.thread.start()

    def run_call(self, call: Generator[None, None, Any], done: Done, *, store: bool) -> None:
        """On the worker: start ``call`` (up to its ``yield``), then end it here when no call
        waits behind it, else on the completion thread; ``done`` gets its result or error."""
        with self._flight:
            self._flight.wait_for(lambda: self._in_flight < MAX_IN_FLIGHT and
                                  (store or not self._stores))
            self._in_flight += 1
            self._stores += store
        try:
            next(call)
        except StopIteration as stop:  # ended without waiting for anything
            self._ended(done, stop.value, None, store)
        except BaseException as exc:
            self._ended(done, None, exc, store)
        else:
            if self.jobs.empty():
                self._end(call, done, store)
            else:
                self._ends.put((call, done, store))

    def settle(self) -> None:
        """Block until every call in flight ended (not on the completion thread)."""
        with self._flight:
            self._flight.wait_for(lambda: self._in_flight == 0)

    def _end(self, call: Generator[None, None, Any], done: Done, store: bool) -> None:
        try:
            next(call)
        except StopIteration as stop:
            self._ended(done, stop.value, None, store)
        except BaseException as exc:
            self._ended(done, None, exc, store)
        else:
            self._ended(done, None, RuntimeError("a call yielded twice"), store)

    def _ended(self, done: Done, result: Any, error: BaseException | None, store: bool) -> None:
        try:
            done(result, error)
        except BaseException:  # done reports its own errors; never lose the thread
            log.exception("instance %d: ending a call failed", self.id)
        finally:
            with self._flight:
                self._in_flight -= 1
                self._stores -= store
                self._flight.notify_all()

    def _end_calls(self) -> None:
        while (item := self._ends.get()) is not None:
            self._end(*item)

    def _work(self) -> None:
        try:
            while True:
                job = self.jobs.get()
                try:
                    if not job(self):
                        return
                except BaseException:  # a job reports its own errors; never lose the worker
                    log.exception("instance %d: job failed", self.id)
                finally:
                    with self._qlock:
                        self._queued -= 1
        finally:
            self.settle()
            self._ends.put(None)


__all__ = ["Instance", "Job", "Done", "MAX_QUEUED", "MAX_IN_FLIGHT"]
