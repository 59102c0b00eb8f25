"""Staging buffers of peer reads: a read from another host's slab lands in a buffer of this pool,
never straight in a slot, and its caller waits for it at most a bound of its own.

A holder that is stopped (SIGSTOP, a hung host) keeps its sockets open: the transfer engine's
``transfer_sync_read`` then waits until it resumes (measured: 61 s for 4 KiB whatever the
engine's limits say; a 32 MiB read that gave up on the engine's own timeout still landed in its
buffer once the holder resumed). So a bounded read needs a wait it can give up on itself and a
buffer it can abandon; this module owns both, and nothing of what is read (``dataplane.peerread``
checks it and copies it into the slot).

Layout: one anonymous mapping of ``count`` buffers of ``size`` bytes, registered once with the
engine; buffer ``i`` is bytes ``[i * size, (i + 1) * size)`` and has a worker thread of its own,
the only thread that ever asks the engine to write into it::

    +-----------+-----------+-----------+-----------+
    | buffer 0  | buffer 1  | buffer 2  | buffer 3  |   count x size bytes, registered
    +-----------+-----------+-----------+-----------+
       worker 0    worker 1    worker 2    worker 3     one daemon thread each

States of a buffer::

    free --read takes it--> reading --returned in time--> held by the caller --release--> free
                               |
                               +--not returned in time--> abandoned --the read returns--> free
                                  (the caller has left: a miss; ``late`` is called)

A read waits for a free buffer within its own bound, except that when every buffer is abandoned
(none will come back soon) it gives up at once.

NOTE: an abandoned buffer goes back to the pool only when its read returned, and late bytes land
in it, never in a slot. A read that returned failure may still see bytes land later (the
engine's timeout gives up on the wait, not on the transfer, measured): so the caller copies a
buffer into its slot first and checks the digest over the slot's copy, which no one but the
caller writes; bytes landing in the buffer mid-copy fail that check. The mapping is never
unmapped while a read is in flight: the workers keep the pool alive, and ``close`` leaves a
stuck worker to the interpreter's exit.
"""

from __future__ import annotations

import logging
import mmap
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import numpy as np

log = logging.getLogger("kvblend.dataplane")

class Reader(Protocol):
    """What the pool needs of the transfer engine (``dataplane.peerread.Engine``)."""

    def register(self, buf: np.ndarray) -> int: ...

    def read(self, session: str, local: int, remote: int, nbytes: int) -> bool: ...


class Outcome(Enum):
    """A staged read that gave no bytes."""

    NO_BUFFER = "no_buffer"  # none came free within the bound, or every one is abandoned
    TIMED_OUT = "timed_out"  # the read did not return within the bound: its buffer abandoned
    FAILED = "failed"        # the engine returned failure (the holder gone, its port closed)


@dataclass(eq=False)
class _Job:
    session: str
    remote: int
    nbytes: int
    late: Callable[[bool], None]
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    finished: bool = False   # under the pool's lock
    abandoned: bool = False  # under the pool's lock


class Staged:
    """The bytes of a read that returned in time: ``data``, valid until ``release`` (or the end
    of a ``with`` block), after which the buffer may take another read."""

    def __init__(self, pool: "StagingPool", index: int, data: np.ndarray) -> None:
        self._pool, self._index, self.data = pool, index, data

    def release(self) -> None:
        if self._index >= 0:
            self._pool._give_back(self._index)
            self._index = -1

    def __enter__(self) -> "Staged":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class StagingPool:
    """``count`` staging buffers of ``size`` bytes (module docstring).

    Args:
        engine: the transfer engine; the mapping is registered with it once.
        count: buffers, each with a worker thread.
        size: bytes of each buffer: the largest read it takes.
    """

    def __init__(self, engine: Reader, count: int, size: int) -> None:
        if count < 1 or size < 1:
            raise ValueError("need count >= 1 and size >= 1")
        self.count, self.size, self._engine = count, size, engine
        self._map = mmap.mmap(-1, count * size)  # anonymous: untouched pages cost nothing
        self._buffers = np.frombuffer(self._map, np.uint8).reshape(count, size)
        self._base = engine.register(self._buffers)
        self._cond = threading.Condition()
        self._free = list(range(count))
        self._held: dict[int, _Job] = {}
        self._jobs: list[queue.SimpleQueue[_Job | None]] = [queue.SimpleQueue()
                                                            for _ in range(count)]
        self._workers = [threading.Thread(target=self._work, args=(i,), daemon=True,
                                          name=f"kvblend-peer-stage-{i}") for i in range(count)]
        for w in self._workers:
            w.start()

    @property
    def free(self) -> int:
        """Buffers free now."""
        with self._cond:
            return len(self._free)

    @property
    def abandoned(self) -> int:
        """Buffers held by reads whose caller gave up on them."""
        with self._cond:
            return sum(job.abandoned for job in self._held.values())

    def read(self, session: str, remote: int, nbytes: int, timeout_s: float,
             late: Callable[[bool], None]) -> Staged | Outcome:
        """Read ``nbytes`` at ``remote`` of peer ``session`` into a free buffer, waiting at most
        ``timeout_s`` in all (for a buffer, then for the read).

        Args:
            late: called, on the buffer's worker thread, with the engine's answer when a read
                its caller abandoned (``Outcome.TIMED_OUT``) returns, after its buffer is free.

        Returns:
            The bytes (``Staged``: release it), or why there are none.
        """
        if not 0 < nbytes <= self.size:
            raise ValueError(f"a staged read takes 1 to {self.size} bytes, not {nbytes}")
        deadline = time.monotonic() + timeout_s
        job = _Job(session, remote, nbytes, late)
        index = self._take(job, deadline)
        if index is None:
            return Outcome.NO_BUFFER
        self._jobs[index].put(job)
        job.done.wait(max(0.0, deadline - time.monotonic()))
        with self._cond:
            if not job.finished:
                job.abandoned = True  # the worker frees the buffer when the read returns
                return Outcome.TIMED_OUT
        if not job.ok:
            self._give_back(index)
            return Outcome.FAILED
        return Staged(self, index, self._buffers[index, :nbytes])

    def _take(self, job: _Job, deadline: float) -> int | None:
        with self._cond:
            while not self._free:
                if all(j.abandoned for j in self._held.values()):
                    return None  # every buffer waits on a stuck read: none comes back soon
                if not self._cond.wait(deadline - time.monotonic()):
                    return None
            index = self._free.pop()
            self._held[index] = job
            return index

    def _give_back(self, index: int) -> None:
        with self._cond:
            del self._held[index]
            self._free.append(index)
            self._cond.notify()

    def _work(self, index: int) -> None:
        local = self._base + index * self.size
        while (job := self._jobs[index].get()) is not None:
            try:
                ok = self._engine.read(job.session, local, job.remote, job.nbytes)
            except Exception:  # noqa: BLE001 - the engine's binding: a failed read, not a crash
                ok = False
            with self._cond:
                job.ok, job.finished, abandoned = ok, True, job.abandoned
            job.done.set()
            if abandoned:
                self._give_back(index)
                try:
                    job.late(ok)
                except Exception:  # the worker must outlive its caller's callback
                    log.exception("peer reads: a late read's callback failed")

    def close(self) -> None:
        """Stop the workers; those stuck in a read are left to end with it (the mapping stays
        while they run)."""
        with self._cond:
            stuck = {i for i, job in self._held.items() if job.abandoned}
        for q in self._jobs:
            q.put(None)
        for i, w in enumerate(self._workers):
            if i not in stuck:
                w.join()


__all__ = ["StagingPool", "Staged", "Outcome", "Reader"]
