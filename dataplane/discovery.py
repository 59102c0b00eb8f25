"""Discovery: this host learns the chunks other hosts wrote to the remote tier, so that its lookups
find them.

This module owns the tail of the remote tier's record streams (``dataplane.remote``: one record
per chunk written, with its token ids) and what a record becomes here: an entry in the table of
remote-known chunks (``shm.remotes``: which shards exist remotely, until when, and where their KV
was computed) and a fingerprint entry, so that a lookup finds the chunk by its tokens. It does
not own fetching a chunk (``dataplane.promote``) nor deciding what counts as live (``shm.lookup``).

Life of a record::

    XREAD of one stream (blocks up to block_s) --remote down / breaker open--> wait, then read on
                                                     from the last id seen in that stream
    a record --does not parse, another chunk size, expired--> ignored (counted when malformed)
             --parsed--> remote-known entry (hash, rank) -> (expiry, pos0, origin)
                         --its content is findable here already--> no fingerprint entry
                         --not findable--> registered in the fingerprint index
                         --it names a place in its holder's slab--> kept for peer reads
                           (``dataplane.peerread``)

The records are in one stream on a server and in one stream per master of a cluster
(``dataplane.recordstreams``). One thread per stream tails it, from the oldest record it keeps,
with its own position: a dead master stops only its own stream's thread, which reads on from its
position when the master answers again, so the records of the live masters are found meanwhile.
A watcher thread asks the tier for the streams every ``refresh_s`` and starts a thread for each
new one (a new slot map); a stream once tailed is tailed until ``close``. Records are entered one
batch at a time (a lock), whichever thread read them.

NOTE: a restart reads every stream again (each is capped, and re-reading an entry changes
nothing). A store on host A becomes findable on host B after A's write-behind queue, one
pipelined SET and XADD, and B's blocked XREAD returning: docs/remote.md has the measured delay.
A fingerprint entry may outlive its chunk's value (expiry, server eviction, a flushed server):
the lookup then offers a remote match whose fetch misses, and the engine recomputes it.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from kvblend.dataplane.peerread import Peer
from kvblend.dataplane.remote import Record, RemoteTier
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Root
from kvblend.shm.header import ORIGIN_FINAL
from kvblend.shm.remotes import RemoteChunks, wall_ms
from kvblend.shm.store import Store
from kvblend.shm.telemetry import Counter

log = logging.getLogger("kvblend.dataplane")

BATCH = 512  # records per XREAD (of one stream)


class Discovery:
    """The threads that tail the record streams into ``remotes`` and ``fingerprints``.

    Args:
        tier: the remote tier (its ``block_s`` bounds each wait).
        store: this host's store.
        fingerprints: this host's fingerprint index.
        remotes: this host's table of remote-known chunks.
        events: where the counts go, or None.
        retry_s: the wait after a failed read (the breaker adds its own cooldown).
        refresh_s: how often the watcher asks the tier which streams there are.
        peer: peer reads (``dataplane.peerread.Peer``), told the place each record names, or
            None.
    """

    def __init__(self, tier: RemoteTier, store: Store, fingerprints: FingerprintIndex,
                 remotes: RemoteChunks, events: EventLog | None = None,
                 retry_s: float = 1.0, refresh_s: float = 10.0, peer: Peer | None = None
                 ) -> None:
        self._tier, self._store, self._fps, self._peer = tier, store, fingerprints, peer
        self._remotes, self._events = remotes, events
        self._retry_s, self._refresh_s = retry_s, refresh_s
        self._stop = threading.Event()
        self._applying = threading.Lock()
        #: stream -> the id of the last record entered from it (absent: none yet)
        self.positions: dict[str, str] = {}
        self._tails: dict[str, threading.Thread] = {}
        self._thread = threading.Thread(target=self._watch, name="kvblend-discovery",
                                        daemon=True)

    @property
    def streams(self) -> list[str]:
        """The streams tailed so far."""
        return sorted(self._tails)

    def start(self) -> "Discovery":
        self._thread.start()
        return self

    def close(self, timeout: float | None = None) -> None:
        """Stop after the reads in progress (``block_s`` at most); ``timeout`` bounds each
        thread's join."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        for tail in list(self._tails.values()):  # the watcher starts no more
            if tail.is_alive():
                tail.join(timeout)

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                streams = self._tier.record_streams()
            except Exception:  # never let the watcher die
                log.exception("discovery: listing the record streams failed")
                streams = None
            for stream in streams or []:
                if stream not in self._tails and not self._stop.is_set():
                    tail = threading.Thread(target=self._tail, args=(stream,), daemon=True,
                                            name=f"kvblend-discovery-{len(self._tails)}")
                    self._tails[stream] = tail
                    tail.start()
            self._stop.wait(self._retry_s if streams is None else self._refresh_s)

    def _tail(self, stream: str) -> None:
        while not self._stop.is_set():
            try:
                got = self._tier.records(self.positions.get(stream, "0"), BATCH, stream)
                if got is None:
                    self._stop.wait(self._retry_s)
                    continue
                if got:
                    self.apply([r for _, r in got])
                    self.positions[stream] = got[-1][0]
            except Exception:  # never let one bad batch stop discovery
                log.exception("discovery: a batch of records from %s failed", stream)
                self._stop.wait(self._retry_s)

    def apply(self, records: list[Record | None]) -> int:
        """Enter ``records`` (None: one that did not parse) here; returns the fingerprint
        entries added. One batch at a time, from any thread."""
        with self._applying:
            return self._apply(records)

    def _apply(self, records: list[Record | None]) -> int:
        now = wall_ms()  # records carry Unix-time expiries
        size = self._fps.chunk_size
        good = [r for r in records if r is not None and r.chunk.chunk_size == size
                and r.expires_ms > now]
        self._count("malformed", sum(r is None for r in records))
        self._count("records", len(records))
        if not good:
            return 0
        self._remotes.put([r.chunk.chunk_hash for r in good],
                          np.array([r.chunk.rank for r in good], np.int64),
                          np.array([r.expires_ms for r in good], np.int64),
                          np.array([r.pos0 for r in good], np.int64),
                          np.array([r.origin for r in good], np.int64))
        if self._peer is not None:
            self._peer.learn(good)
        added = 0
        for r in good:
            if r.chunk.rank == 0:
                added += self._register(r, now)
        self._count("registered", added)
        return added

    def _register(self, r: Record, now: int) -> int:
        """A fingerprint entry for ``r``'s chunk, unless its content is findable here already
        (a local copy, maybe under another chain of keys: re-pointing its entry would turn a
        local hit into a fetch)."""
        ns = Root(r.chunk.root)

        def is_live(hashes: list[bytes]) -> list[bool]:  # rank 0's shard, here or remote
            here = self._store.contains_shards(ns.id, hashes, 1)[:, 0]
            return (here | self._remotes.knows(hashes, now)).tolist()

        if self._fps.contains(r.chunk.chunk_hash) or self._fps.cover(ns, r.tokens, is_live)[0]:
            return 0
        return self._fps.register(ns, r.tokens, [r.chunk.chunk_hash],
                                  final=r.origin == ORIGIN_FINAL).new

    def _count(self, what: str, n: int) -> None:
        if n and self._events is not None:
            self._events.add(_COUNTERS[what], n)


_COUNTERS = {"records": Counter.REMOTE_RECORDS, "registered": Counter.REMOTE_DISCOVERED_CHUNKS,
             "malformed": Counter.REMOTE_MALFORMED_RECORDS}

__all__ = ["Discovery", "BATCH"]
