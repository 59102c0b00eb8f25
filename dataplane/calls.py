"""What a store and a retrieve share: the state they work on (``Shared``, ``Tuning``), the
two-part call (``Call``), the layer gate of a layer-wise store, and the steps both take (token
ids, namespace, keys, batches, draining the copies in flight, forgetting evicted chunks).
``dataplane.transfer`` says in which order a call does what."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import TransferDone
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace
from kvblend.shm.keys import batch_words
from kvblend.shm.remotes import wall_ms
from kvblend.shm.store import Store
from kvblend.shm.telemetry import Counter

if TYPE_CHECKING:
    from kvblend.dataplane.backend import InstanceBuffer
    from kvblend.dataplane.instance import Instance
    from kvblend.dataplane.promote import Promoter
    from kvblend.dataplane.writebehind import WriteBehind
    from kvblend.shm.remotes import RemoteChunks


log = logging.getLogger("kvblend.dataplane")


@dataclass(frozen=True)
class Tuning:
    """Batch sizes of a transfer (``dataplane.settings`` builds it).

    Attributes:
        first_bytes: a call's first batch, whose copies start while the rest is reserved or
            pinned.
        group_bytes: chunks per completion marker of a store; a group's commits overlap the
            copies of later groups.
        staging_bytes: GPU staging of a paged CUDA instance (``dataplane.cuda_paged``).
    """

    first_bytes: int = 16 << 20
    group_bytes: int = 32 << 20
    staging_bytes: int = 128 << 20


@dataclass(frozen=True)
class Shared:
    """The shared-memory state a transfer works on, and how it batches."""

    store: Store
    fingerprints: FingerprintIndex
    events: EventLog
    chunk_size: int
    tuning: Tuning = Tuning()
    writebehind: "WriteBehind | None" = None  # the remote tier's, when there is one
    promoter: "Promoter | None" = None        # fetches remote chunks into the store
    remotes: "RemoteChunks | None" = None     # chunks other hosts wrote to the remote tier


def tokens_of(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise BadRequest(f"token_ids must be little-endian uint32 bytes, got {len(raw)} bytes")
    return np.frombuffer(raw, "<u4")


def namespace_of(inst: "Instance", cache_salt: str) -> Namespace:
    return Namespace(inst.request.model_name, inst.request.world_size, cache_salt)


def batches(n: int, chunk_bytes: int, first_bytes: int, most: int | None = None
             ) -> list[tuple[int, int]]:
    """Chunk index ranges of the call's reserve/pin batches: a small first one (its copies start
    at once), then each twice the one before, so a batch is reserved or pinned while the copies
    queued before it (half its size or more) still run; at most ``most`` chunks each."""
    size = min(n, max(1, first_bytes // max(1, chunk_bytes)), most or n)
    out, lo = [], 0
    while lo < n:
        out.append((lo, min(n, lo + size)))
        lo += size
        size = min(2 * size, most or 2 * size)
    return out


def chunk_keys(ns_id: int, hashes: list[bytes], rank: int) -> np.ndarray:
    """The chunks' keys as the store's int64 ``[n, 4]`` words: no object per chunk."""
    return batch_words(ns_id, hashes, rank)


def drain(buf: "InstanceBuffer") -> None:
    """Wait for every copy in flight before giving its slots back (best effort: on a broken
    device the slots are given back anyway)."""
    try:
        buf.wait(buf.mark())
    except BaseException:
        pass


Call = Generator[None, None, TransferDone]
"""A store or retrieve in two parts: up to its one ``yield`` it checks, reserves or pins and
queues every copy (the instance's worker); the rest waits for the copies and commits or unpins
(the instance's completion thread, ``dataplane.instance``)."""


def run_to_end(call: Call) -> TransferDone:
    """Run both parts of ``call`` on this thread."""
    try:
        while True:
            next(call)
    except StopIteration as stop:
        return stop.value


class Gate:
    """The layers an engine announced written for one layer-wise store (``LayersWritten``): set
    on the connection's thread, awaited on the instance's worker.

    Attributes:
        instance_id: the store's instance (an announcement must name it).
    """

    def __init__(self, instance_id: int) -> None:
        self.instance_id = instance_id
        self._cv = threading.Condition()
        self._layers = 0

    def announce(self, layers: int) -> None:
        with self._cv:
            if layers > self._layers:
                self._layers = layers
                self._cv.notify_all()

    def wait(self, layers: int, timeout: float) -> bool:
        """True once ``layers`` layers are announced; False when ``timeout`` ran out first."""
        with self._cv:
            return self._cv.wait_for(lambda: self._layers >= layers, timeout)


def forget_evicted(sh: Shared) -> int:
    """Drop the fingerprint entries of the chunks this process's store evicted since the last
    call. An entry goes when any rank's shard of its chunk goes: a lookup must not offer a chunk
    some rank cannot retrieve. Returns the entries removed."""
    evicted = sh.store.take_evicted()
    if not len(evicted):
        return 0
    words = np.ascontiguousarray(evicted[:, :2])
    if sh.remotes is not None:  # a chunk the remote tier still holds stays findable
        words = words[~sh.remotes.knows(words, wall_ms())]
    removed = sh.fingerprints.remove(words)
    if removed:
        sh.events.add(Counter.FINGERPRINT_EVICTED_ENTRIES, removed)
    return removed


__all__ = ["Tuning", "Shared", "Call", "Gate", "tokens_of", "namespace_of", "batches",
           "chunk_keys", "drain", "run_to_end", "forget_evicted", "log"]
