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

Replay. A failed write is held for its node (``RemoteTier.node_of``) and offered again once that
node's breaker lets calls through (``dataplane.remote``)::

    failed --hold--> held (one entry per chunk: a newer failure replaces it; past replay_chunks
                     entries or replay_bytes of values the oldest is dropped, and counted)
    held --node's breaker closed--> queued again, every entry of that node
         --node's breaker half-open--> queued again, its oldest entry (the probe)
    written --its node has held entries--> the replay thread wakes at once

A held entry is the chunk's key and tokens, never its bytes: a replay is a write like any other,
pinned, checked and copied from the slab at its turn, so a chunk evicted or replaced meanwhile is
skipped (or written as the slab holds it now), never from a stale copy. The replay thread looks
every ``retry_s``, and at once after a write to a node with held entries.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvblend.dataplane.remote import BreakerState, ChunkId, RemoteTier, encode
from kvblend.dataplane.remoteformat import record_head
from kvblend.shm.events import EventLog
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.slots import VERIFIED
from kvblend.shm.store import ChunkKey, Store
from kvblend.shm.telemetry import Counter

if TYPE_CHECKING:
    from kvblend.dataplane.peerread import Peer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Item:
    class_id: int
    key: ChunkKey
    chunk: ChunkId
    tokens: np.ndarray


class _Held:
    """Failed writes waiting for their node (module docstring: replay), oldest first; the caller
    holds the lock."""

    def __init__(self, chunks: int, nbytes: int) -> None:
        self._chunks, self._nbytes = chunks, nbytes
        self._items: OrderedDict[ChunkKey, tuple[_Item, str]] = OrderedDict()
        self._per_node: dict[str, int] = {}
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def holds(self, node: str) -> bool:
        return self._per_node.get(node, 0) > 0

    def add(self, item: _Item, node: str) -> int:
        """Hold ``item`` as the newest entry (replacing its chunk's older one); returns how many
        entries were dropped to stay in bounds."""
        self.discard(item.key)
        self._items[item.key] = (item, node)
        self._per_node[node] = self._per_node.get(node, 0) + 1
        self.nbytes += item.chunk.value_bytes
        dropped = 0
        while len(self._items) > self._chunks or self.nbytes > self._nbytes:
            self.discard(next(iter(self._items)))
            dropped += 1
        return dropped

    def discard(self, key: ChunkKey) -> None:
        held = self._items.pop(key, None)
        if held is not None:
            item, node = held
            self._per_node[node] -= 1
            self.nbytes -= item.chunk.value_bytes

    def due(self, state: Callable[[str], BreakerState]) -> list[_Item]:
        """Take out every entry of a node whose breaker is closed, and the oldest entry of each
        node whose breaker is half-open."""
        states = {node: state(node) for node, n in self._per_node.items() if n}
        out = []
        for item, node in list(self._items.values()):
            if states.get(node) is BreakerState.CLOSED:
                out.append(item)
            elif states.get(node) is BreakerState.HALF_OPEN:
                out.append(item)
                states[node] = BreakerState.OPEN  # one probe per node
        for item in out:
            self.discard(item.key)
        return out


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
        replay_chunks, replay_bytes: the bounds of the failed writes held for replay, in
            entries and in bytes of the values they would write.
        retry_s: how often the replay thread looks at the held writes' breakers.
        peer: this host's peer reads (``dataplane.peerread.Peer``), or None: each record then
            also says where its chunk's KV sits in this host's slab, and with ``peer.values``
            off only the record is written, no value.
    """

    def __init__(self, store: Store, tier: RemoteTier, capacity: int = 4096,
                 events: EventLog | None = None, writers: int = 4, replay_chunks: int = 4096,
                 replay_bytes: int = 1 << 30, retry_s: float = 1.0,
                 peer: "Peer | None" = None) -> None:
        if capacity < 1 or writers < 1 or replay_chunks < 1 or replay_bytes < 1:
            raise ValueError("capacity, writers and the replay bounds must be >= 1")
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        self._store, self._tier, self._events, self._peer = store, tier, events, peer
        self._queue: queue.Queue[_Item | None] = queue.Queue(capacity)
        self._lock = threading.Lock()
        self.counts = {"written": 0, "dropped": 0, "skipped": 0, "failed": 0, "replayed": 0,
                       "replay_dropped": 0}
        self._held = _Held(replay_chunks, replay_bytes)
        self._retry_s = retry_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self._run, name=f"kvblend-writebehind-{i}",
                                          daemon=True) for i in range(writers)]
        self._replayer = threading.Thread(target=self._replay, name="kvblend-writebehind-replay",
                                          daemon=True)
        for t in [*self._threads, self._replayer]:
            t.start()

    @property
    def held(self) -> int:
        """Failed writes held for replay now."""
        with self._lock:
            return len(self._held)

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

        self._stop.set()
        self._wake.set()
        self._replayer.join(left())
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
                self._settle(item, self._write(item))
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
            slot = int(slots[0])
            at = self._peer.at(slot) if self._peer is not None else None
            # records only (peer reads, no values): the digest is taken over the slot in place
            shape = encode if at is None or at.valued else record_head
            value = shape(item.chunk, item.tokens, self._store.slot_kv(slot), pos0, origin,
                          key=self._tier.key)
        finally:
            self._store.unpin_slots(slots)
        return "written" if self._tier.put(item.chunk, value, peer=at) else "failed"

    def _settle(self, item: _Item, outcome: str) -> None:
        """Count ``outcome``; hold a failed write for replay, and forget a held one that was
        written or skipped."""
        node = self._tier.node_of(item.chunk.key) if outcome == "failed" or self.held else None
        dropped = 0
        with self._lock:
            if outcome == "failed":
                assert node is not None
                dropped = self._held.add(item, node)
            else:
                self._held.discard(item.key)
                if outcome == "written" and node is not None and self._held.holds(node):
                    self._wake.set()  # the node is back: replay the rest without waiting
        self._count(outcome)
        self._count("replay_dropped", dropped)

    def _replay(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._retry_s)
            self._wake.clear()
            if self._stop.is_set():
                return
            with self._lock:
                due = self._held.due(lambda node: self._tier.breaker_of(node).state)
            for i, item in enumerate(due):
                try:
                    self._queue.put_nowait(item)
                except queue.Full:  # the rest wait for the next look
                    with self._lock:
                        for rest in due[i:]:
                            self._held.add(rest, self._tier.node_of(rest.chunk.key))
                    break
                self._count("replayed")

    def _count(self, what: str, n: int = 1) -> None:
        if n == 0:
            return
        with self._lock:
            self.counts[what] += n
        if self._events is not None and what in _COUNTERS:
            self._events.add(_COUNTERS[what], n)


_COUNTERS = {"written": Counter.REMOTE_WRITTEN_CHUNKS, "dropped": Counter.REMOTE_DROPPED_CHUNKS,
             "skipped": Counter.REMOTE_SKIPPED_CHUNKS, "failed": Counter.REMOTE_FAILED_WRITES,
             "replayed": Counter.REMOTE_REPLAYED_WRITES,
             "replay_dropped": Counter.REMOTE_REPLAY_DROPPED_WRITES}


__all__ = ["WriteBehind"]
