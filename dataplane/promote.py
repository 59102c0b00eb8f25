"""Promotion: a chunk read from the remote tier becomes a local chunk, committed in the slab like
any store's, so that the copy to the engine finds it local.

This module owns that one step, fetch then commit, and nothing of when it is asked for. The
value is checked (key, root, rank, layout, tokens, digest) before the slot is committed; a
reserved slot is seen by no reader, so a miss leaves the store as it was.

Life of one promotion::

    already committed here --> EXISTS
    reserve --already committed or being written by someone else--> EXISTS
            --no room--> the store's StoreFull
            --reserved: read the KV into the slot: from its holder's slab where a record
                        named its place (``Peer.fetch``: through a staging buffer, waited for
                        at most its bound; a miss there falls back to the value if one was
                        written), else straight from the value (``RemoteTier.get_into``)
                --a Miss--> the slot is aborted, the Miss is the answer
                --checked--> set its provenance, commit --> PROMOTED
    an error between reserve and commit --> the slot is aborted (nothing half-written is seen)
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from enum import Enum

import numpy as np

from kvblend.dataplane.peerread import Peer
from kvblend.dataplane.remote import ChunkId, Fetched, Miss, RemoteTier
from kvblend.shm.errors import ShmError
from kvblend.shm.events import EventLog
from kvblend.shm.remotes import RemoteChunks, wall_ms
from kvblend.shm.store import ChunkKey, Store
from kvblend.shm.telemetry import Counter

log = logging.getLogger("kvblend.dataplane")


class Promoted(Enum):
    """A promotion that found a chunk."""

    PROMOTED = "promoted"  # fetched and committed here
    EXISTS = "exists"      # the store holds it already (or another writer is storing it)


def promote(store: Store, tier: RemoteTier, class_id: int, namespace_id: int, chunk: ChunkId,
            tokens: np.ndarray, streams: int = 1, peer: Peer | None = None) -> Promoted | Miss:
    """Fetch ``chunk`` (whose token ids are ``tokens``) straight into a slot reserved for it in
    ``store`` under layout class ``class_id``, and commit it once every check passed.

    Args:
        streams: connections the chunk's KV is read on at once (``RemoteTier.get_into``).
        peer: peer reads (``dataplane.peerread``): the KV is read from its holder's slab first
            where a record named its place, and from the value after a miss there.

    Raises:
        ValueError: the class's layout is not the chunk's.
        shm.errors.StoreFull: nothing free and nothing evictable.
    """
    cc = store.chunk_class(class_id)
    if (cc.dtype, cc.num_layers, cc.chunk_size, cc.hidden_dim) != (
            chunk.dtype, chunk.num_layers, chunk.chunk_size, chunk.hidden_dim):
        raise ValueError(f"layout class {class_id} is not the layout of the chunk")
    key = ChunkKey(namespace_id, chunk.chunk_hash, chunk.rank)
    if store.contains_key(key):
        return Promoted.EXISTS
    res = store.reserve(class_id, key, tokens)
    if res is None:
        return Promoted.EXISTS
    try:
        dest = res.kv.reshape(-1).view(np.uint8)

        def value() -> Fetched | Miss:
            return tier.get_into(chunk, tokens, dest, streams)

        got = value() if peer is None else peer.fetch(chunk, tokens, dest, value)
        if isinstance(got, Fetched):
            store.set_positions(np.array([res.slot]), np.array([got.pos0]), got.origin,
                                chunk.root)
    except BaseException:
        res.abort()
        raise
    if not isinstance(got, Fetched):
        res.abort()  # a reserved slot is never seen: the bytes read into it go with it
        return got
    res.commit()
    return Promoted.PROMOTED


class Promoter:
    """Promotions of a retrieve's or a prefetch's remote chunks, ``streams`` at a time.

    A chunk is fetched only when it is not local and the table of remote-known chunks holds its
    shard (a chunk nobody published costs no round trip); a chunk being promoted already is not
    fetched twice: the second asker waits for the first promotion.

    Args:
        store: the local store.
        tier: the remote tier.
        remotes: the table of remote-known chunks.
        events: where the counts go, or None.
        streams: promotions at once, each on a connection of its own.
        peer: peer reads, or None (``promote``).
    """

    def __init__(self, store: Store, tier: RemoteTier, remotes: RemoteChunks,
                 events: EventLog | None = None, streams: int = 8, peer: Peer | None = None
                 ) -> None:
        if streams < 1:
            raise ValueError("streams must be >= 1")
        self._store, self._tier, self._remotes, self._events = store, tier, remotes, events
        self._peer = peer
        self._pool = ThreadPoolExecutor(streams, thread_name_prefix="kvblend-promote")
        self._streams = streams
        self._lock = threading.Lock()
        self._flight: dict[ChunkKey, Future] = {}

    def start(self, class_id: int, root: bytes, keys: Sequence[ChunkKey],
              token_rows: np.ndarray) -> list[Future]:
        """Start promoting the chunks of ``keys`` (``token_rows``: uint32 ``[len(keys), C]``,
        their expected tokens) that are remote only; returns the futures to wait for (including
        promotions of these keys already running)."""
        if not len(keys):
            return []
        local = self._store.contains(keys)
        cc = self._store.chunk_class(class_id)
        futures = []
        away = [i for i in range(len(keys)) if not local[i]]
        if not away:
            return []
        known = self._remotes.knows([keys[i].chunk_hash for i in away], wall_ms(),
                                    np.array([keys[i].rank for i in away])).tolist()
        # several chunks take a connection each; fewer split their KV over the rest
        per_chunk = max(1, self._streams // max(1, sum(known)))
        for i, ok in zip(away, known):
            if not ok:
                continue
            key = keys[i]
            chunk = ChunkId(root, key.chunk_hash, key.rank, cc.dtype, cc.num_layers,
                            cc.chunk_size, cc.hidden_dim)
            with self._lock:
                fut = self._flight.get(key)
                if fut is None:
                    fut = self._pool.submit(self._one, class_id, key, chunk,
                                            np.array(token_rows[i], np.uint32), per_chunk)
                    self._flight[key] = fut
            futures.append(fut)
        return futures

    def ensure(self, class_id: int, root: bytes, keys: Sequence[ChunkKey],
               token_rows: np.ndarray) -> None:
        """``start``, then wait until those promotions ended (each is bounded by the tier's
        timeout; a miss is the retrieve's failed chunk)."""
        wait(self.start(class_id, root, keys, token_rows))

    def _one(self, class_id: int, key: ChunkKey, chunk: ChunkId, tokens: np.ndarray,
             streams: int) -> Promoted | Miss:
        try:
            got = promote(self._store, self._tier, class_id, key.namespace_id, chunk, tokens,
                          streams, self._peer)
            if isinstance(got, Miss) and got is not Miss.UNAVAILABLE:
                # gone, or not what its record said: forget it, so lookups stop offering it
                self._remotes.put([key.chunk_hash], key.rank, 1, 0, 0)  # expired since 1970
        except ShmError as exc:  # no room: the retrieve reports the chunk missing
            log.warning("promotion of a remote chunk failed: %s", exc)
            got = Miss.UNAVAILABLE
        except Exception:  # a promotion's failure is a miss, never the retrieve's
            log.exception("promotion of a remote chunk failed")
            got = Miss.UNAVAILABLE
        finally:
            with self._lock:
                self._flight.pop(key, None)
        self._count("promoted" if got is Promoted.PROMOTED else
                    "misses" if isinstance(got, Miss) else None)
        return got

    def _count(self, what: str | None) -> None:
        if what is not None and self._events is not None:
            self._events.add(Counter.REMOTE_PROMOTED_CHUNKS if what == "promoted"
                             else Counter.REMOTE_FETCH_MISSES)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


__all__ = ["promote", "Promoted", "Promoter"]
