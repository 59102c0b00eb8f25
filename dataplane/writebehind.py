"""Write-behind to the remote tier: the data plane offers the chunks each store committed, and a few
threads copy each out of the slab and write it to the remote tier (``dataplane.remote``).

This module owns the queue between a store and the remote tier, and nothing of the format or of
the remote's faults (``RemoteTier`` turns those into a False ``put``). A store never waits for it.

Life of an offered chunk::

    offered --queue full--> dropped (counted; the store goes on)
    queued --thread: pin it--> not stored any more, other tokens, or no provenance: skipped
           --pinned and checked: encode (a copy of its KV), unpin, put--> written | failed

NOTE: a writer holds a chunk pinned only while it encodes it, so a remote that hangs for its
whole timeout never holds slab memory; what it writes is exactly the committed bytes of the slot
that holds the key and the expected tokens (``Store.check_pinned``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvblend.dataplane.remote import ChunkId, RemoteTier, encode
from kvblend.shm.events import EventLog
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.slots import VERIFIED
from kvblend.shm.store import ChunkKey, Store
from kvblend.shm.telemetry import Counter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    class_id: int
    key: ChunkKey
    chunk: ChunkId
    tokens: np.ndarray


class WriteBehind:
    """A bounded queue of committed chunks and the threads that write them to ``tier``.

    Args:
        store: the local store the chunks were committed to (this process's attachment).
        tier: where they go.
        capacity: chunks the queue holds; more are dropped.
        events: where the counts also go (``shm.telemetry``'s ``REMOTE_*`` counters), or None.
        writers: threads writing at once, each on a connection of its own: one chunk's write is
            a copy, a SHA-256 and a round trip, and hashing and the socket release the GIL, so
            a few writers overlap them (the order of writes does not matter).
    """

    def __init__(self, store: Store, tier: RemoteTier, capacity: int = 4096,
                 events: EventLog | None = None, writers: int = 4) -> None:
        if capacity < 1 or writers < 1:
            raise ValueError("capacity and writers must be >= 1")
        self._store, self._tier, self._events = store, tier, events
        self._queue: queue.Queue[_Item | None] = queue.Queue(capacity)
        self._lock = threading.Lock()
        self.counts = {"written": 0, "dropped": 0, "skipped": 0, "failed": 0}
        self._threads = [threading.Thread(target=self._run, name=f"kvblend-writebehind-{i}",
                                          daemon=True) for i in range(writers)]
        for t in self._threads:
            t.start()

    def offer(self, class_id: int, root: bytes, keys: Sequence[ChunkKey],
              token_rows: np.ndarray) -> int:
        """Queue committed chunks (``token_rows``: uint32 ``[len(keys), C]``) without waiting;
        returns how many were queued (the rest are dropped, and counted)."""
        cc = self._store.chunk_class(class_id)
        queued = 0
        for key, tokens in zip(keys, token_rows):
            chunk = ChunkId(root, key.chunk_hash, key.rank, cc.dtype, cc.num_layers,
                            cc.chunk_size, cc.hidden_dim)
            try:
                self._queue.put_nowait(_Item(class_id, key, chunk, np.array(tokens, np.uint32)))
                queued += 1
            except queue.Full:
                self._count("dropped")
        return queued

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued chunk was handled; False when ``timeout`` ran out first."""
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (self._queue.join(), done.set()), daemon=True)
        waiter.start()
        return done.wait(timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the chunks already queued, waiting ``timeout`` at most (what is still
        queued then is lost with the process: the remote tier only adds hits)."""
        deadline = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - time.monotonic())

        try:
            for _ in self._threads:  # one stop mark per writer
                self._queue.put(None, timeout=left())
        except queue.Full:
            return
        for t in self._threads:
            t.join(left())

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._count(self._write(item))
            except Exception:  # never let one chunk stop the writer
                log.exception("write-behind of one chunk failed")
                self._count("failed")
            finally:
                self._queue.task_done()

    def _write(self, item: _Item) -> str:
        slots = self._store.pin_slots([item.key])
        if slots[0] < 0:
            return "skipped"  # evicted or cleared before its turn
        try:
            checked = self._store.check_pinned(item.class_id, slots, [item.key],
                                               item.tokens[None])
            pos0, origin = (int(a[0]) for a in self._store.slot_provenance(slots))
            if checked[0] != VERIFIED or origin not in (ORIGIN_STANDALONE, ORIGIN_FINAL):
                return "skipped"
            value = encode(item.chunk, item.tokens, self._store.slot_kv(int(slots[0])), pos0,
                           origin, key=self._tier.key)
        finally:
            self._store.unpin_slots(slots)
        return "written" if self._tier.put(item.chunk, value) else "failed"

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1
        if self._events is not None:
            self._events.add(_COUNTERS[what])


_COUNTERS = {"written": Counter.REMOTE_WRITTEN_CHUNKS, "dropped": Counter.REMOTE_DROPPED_CHUNKS,
             "skipped": Counter.REMOTE_SKIPPED_CHUNKS, "failed": Counter.REMOTE_FAILED_WRITES}


__all__ = ["WriteBehind"]
