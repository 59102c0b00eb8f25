"""What a store and a retrieve share: the state they work on (``Shared``, ``Tuning``), the
two-part call (``Call``), the layer gate of a layer-wise store, and the steps both take (token
ids, namespace, keys, batches, draining the copies in flight, forgetting evicted chunks).
``dataplane.transfer`` says in which order a call does what."""

from __future__ import annotations

import logging
import threading
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)
import numba
import numpy as np

from kvblend.dataplane.errors import BadRequest, OutOfRange
from kvblend.dataplane.messages import (MATCH_BYTES, MATCH_WORDS, MAX_LAYER_GROUP_MATCHES,
                                        TransferDone)
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
        layer_dma_bytes: the smallest window of layers of one chunk's K that a layer-wise
            paged retrieve moves by batched DMA (``dataplane.cuda_paged``).
    """

    first_bytes: int = 16 << 20
    group_bytes: int = 32 << 20
    staging_bytes: int = 128 << 20
    layer_dma_bytes: int = 1 << 20


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


MATCH_FIELDS = 1 << 62  # a match's positions are below it: their differences cannot overflow


def match_rows(raw: bytes, n_tokens: int, C: int, offset: int = 0,
               T: int | None = None) -> np.ndarray:
    """A call's packed matches (``dataplane.messages.MatchBytes``) as int64 ``[n, MATCH_WORDS]``
    rows (old_st, old_ed, cur_st, cur_ed, two hash words), each checked, in order, to span one
    chunk of ``C`` tokens, to end inside the call's ``n_tokens`` and, with a buffer of ``T``
    tokens, inside it from ``offset``.

    Raises:
        BadRequest: not whole rows, or a match that does not span one chunk.
        OutOfRange: a match past the call's tokens or past the buffer.
    """
    if len(raw) % MATCH_BYTES:
        raise BadRequest(f"matches must be rows of {MATCH_BYTES} bytes, got {len(raw)} bytes")
    m = np.frombuffer(raw, "<i8").reshape(-1, MATCH_WORDS)
    # the buffer's room past the offset, within int64 (not offset + cur_ed: that could overflow)
    room = MATCH_FIELDS if T is None else min(max(T - offset, -MATCH_FIELDS), MATCH_FIELDS)
    j, why = _first_bad_match(m, C, n_tokens, room)
    if why == _NOT_ONE_CHUNK:
        raise BadRequest(f"match {j} does not span one chunk of {C} tokens: {m[j, :4].tolist()}")
    if why == _PAST_PROMPT:
        raise OutOfRange(f"match {j} ends at {m[j, 3]}, past the {n_tokens} prompt tokens")
    if why == _PAST_BUFFER:
        raise OutOfRange(f"match {j} at offset {offset} + {m[j, 3]} exceeds the buffer's {T} "
                         "tokens")
    return m


_NOT_ONE_CHUNK, _PAST_PROMPT, _PAST_BUFFER = 1, 2, 3


@numba.njit(cache=True)
def _first_bad_match(m: np.ndarray, C: int, n_tokens: int, room: int) -> tuple[int, int]:
    """The first row that ``match_rows`` refuses and why; ``(-1, 0)`` when none (one compiled
    pass: a few µs for any number of rows, where array expressions cost a dozen calls)."""
    for j in range(m.shape[0]):
        for k in range(4):
            if m[j, k] < 0 or m[j, k] >= MATCH_FIELDS:
                return j, _NOT_ONE_CHUNK
        if m[j, 1] - m[j, 0] != C or m[j, 3] - m[j, 2] != C:
            return j, _NOT_ONE_CHUNK
        if m[j, 3] > n_tokens:
            return j, _PAST_PROMPT
        if m[j, 3] > room:
            return j, _PAST_BUFFER
    return -1, 0


def check_layer_groups(call: str, msg: Any, n: int, buf: "InstanceBuffer") -> bool:
    """Whether ``msg`` (a store or retrieve of ``n`` chunks, ``call`` naming which) is
    layer-wise; its groups and layer events checked, before any side effect.

    Raises:
        BadRequest: layer events without groups, more groups than layers, more chunks than
            ``MAX_LAYER_GROUP_MATCHES``, or layer events not one per group of a CUDA buffer.
    """
    if not msg.layer_groups:
        if msg.layer_events:
            raise BadRequest(f"layer_events were given for a {call} that is not layer-wise")
        return False
    if msg.layer_groups > buf.layout.num_layers:
        raise BadRequest(f"{msg.layer_groups} layer groups for {buf.layout.num_layers} layers")
    if n > MAX_LAYER_GROUP_MATCHES:
        raise BadRequest(f"a layer-wise {call} takes at most {MAX_LAYER_GROUP_MATCHES} chunks, "
                         f"got {n}: split it")
    if msg.layer_events and (len(msg.layer_events) != msg.layer_groups or
                             not buf.records_events):
        raise BadRequest("layer_events: one per layer group, and only for a CUDA buffer")
    return True


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


class StartOnce:
    """A call's start event, logged once: right after its first copies are queued (so the log
    write is off the path to them), or, for a call that fails before that, ahead of its error.
    A call refused by its checks logs no start."""

    def __init__(self, events: EventLog, event: Any) -> None:
        self._events, self._event = events, event

    def __call__(self) -> None:
        if self._event is not None:
            event, self._event = self._event, None
            self._events.record(event)


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


__all__ = ["Tuning", "Shared", "Call", "Gate", "StartOnce", "match_rows", "tokens_of",
           "namespace_of", "batches", "chunk_keys", "drain", "run_to_end", "forget_evicted",
           "log"]
