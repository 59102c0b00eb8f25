"""Store and retrieve: keys, reservations, pins, copies and commits for one call of one instance.

This module owns the order of operations that keeps the store consistent whatever the backend:

- store: compute the chunk keys, reserve the call's slots in batches (``Store.reserve_slots``:
  EXISTS = already stored or being stored elsewhere, not copied again; FULL = failed), enqueue
  the copies in groups of about ``Tuning.group_bytes`` with a completion marker after each group, and
  commit each group once its marker completed, while later groups are still copying; on any
  failure wait for the copies in flight, then abort every reservation not yet committed. Rank 0
  (``worker_id`` 0 or None) then registers the chunks' fingerprints (after the last commit: the
  index only keeps entries of committed chunks).
- retrieve: pin the matched chunks in batches of at most ``PIN_BATCH`` (``Store.pin_slots``),
  check them against the prompt, copy each into ``offset + cur_st`` of the buffer, and unpin a
  batch once its copies completed; at most two batches are pinned at a time, so a retrieve of any
  length fits the pin table. A chunk evicted meanwhile, of another layout, whose tokens differ
  from the prompt's at ``cur_st``, or that found the pin table full (other retrieves hold it) is
  reported failed by match index with its reason (``ChunkFailure``); nothing is written for it.
  A store's chunk that found no room (every slot it fits pinned or being written) is reported
  failed with ``no_room``.
- layer-wise retrieve (``layer_groups``): pin every match at once (at most
  ``MAX_LAYER_GROUP_MATCHES``), then copy the layers group by group, announcing each group
  through ``progress`` once its copies completed (CPU) or its event was recorded (CUDA).
- a paged buffer maps a call's logical token positions to slots through its block table
  (``InstanceBuffer.bind``); every chunk is checked to have slots before any side effect.

Each call is a generator (``Call``) with one ``yield``, once every copy is queued: the instance's
worker runs it that far, its completion thread (``dataplane.instances``) the rest, so the next call
is prepared while these copies run. Before the ``yield`` a store or plain retrieve sends one
``LayersReady`` of every layer: the engine may reuse (store) or read (retrieve) its buffer after
the done event from then on, without waiting for the commits and the reply.

The first batch of a call is small (about ``Tuning.first_bytes``): its copies start while the next
one is reserved or pinned; each batch is twice the one before, so the copies already queued keep
the GPU busy while the next batch is reserved or pinned (measured on a 2-core VM: hashing and
reserving the other 504 chunks of a 512-chunk call at once took 5 ms or more, while the first
batch's 16 MiB take 0.3 ms to cross PCIe). No per-chunk Python object is built: a call's keys are
the store's int64 words (``shm.keys.batch_words``), made into objects only for the remote tier.

It does not own threads or sockets (``dataplane.server``) or how bytes move (``dataplane.backend``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvblend.dataplane.errors import BadRequest, LayersNotWritten, OutOfRange
from kvblend.dataplane.messages import (MAX_LAYER_GROUP_MATCHES, MAX_POSITION, LayersReady,
                                        ChunkFailure, PrefetchChunks, RetrieveChunks, StoreChunks,
                                        StoreKind, TransferDone)
from kvblend.shm.errors import CapacityError, ShmError
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex, RegisterResult, Registration
from kvblend.shm.hashing import DIGEST_BYTES, Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.keys import batch_words, keys_of
from kvblend.shm.remotes import wall_ms
from kvblend.shm.slab import EXISTS, FULL
from kvblend.shm.slots import NOT_PINNED, OTHER_LAYOUT, OTHER_TOKENS, VERIFIED
from kvblend.shm.store import Store
from kvblend.shm.telemetry import (RETRIEVE_SECONDS, STORE_SECONDS, Counter, RetrieveEnd,
                                   RetrieveStart, StoreEnd, StoreStart)

if TYPE_CHECKING:
    from kvblend.dataplane.backend import InstanceBuffer
    from kvblend.dataplane.instances import Instance
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


def _namespace(inst: "Instance", cache_salt: str) -> Namespace:
    return Namespace(inst.request.model_name, inst.request.world_size, cache_salt)





PIN_BATCH = 512  # matches pinned at once by one retrieve; it holds at most two batches


def _batches(n: int, chunk_bytes: int, first_bytes: int, most: int | None = None
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


def _keys(ns_id: int, hashes: list[bytes], rank: int) -> np.ndarray:
    """The chunks' keys as the store's int64 ``[n, 4]`` words: no object per chunk."""
    return batch_words(ns_id, hashes, rank)


def _drain(buf: "InstanceBuffer") -> None:
    """Wait for every copy in flight before giving its slots back (best effort: on a broken
    device the slots are given back anyway)."""
    try:
        buf.wait(buf.mark())
    except BaseException:
        pass


Call = Generator[None, None, TransferDone]
"""A store or retrieve in two parts: up to its one ``yield`` it checks, reserves or pins and
queues every copy (the instance's worker); the rest waits for the copies and commits or unpins
(the instance's completion thread, ``dataplane.instances``)."""


def run_to_end(call: Call) -> TransferDone:
    """Run both parts of ``call`` on this thread."""
    try:
        while True:
            next(call)
    except StopIteration as stop:
        return stop.value


def run_store(sh: Shared, inst: "Instance", msg: StoreChunks) -> TransferDone:
    return run_to_end(store_call(sh, inst, msg))


def run_retrieve(sh: Shared, inst: "Instance", msg: RetrieveChunks) -> TransferDone:
    return run_to_end(retrieve_call(sh, inst, msg))


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


def store_call(sh: Shared, inst: "Instance", msg: StoreChunks,
               progress: Callable[[LayersReady], None] | None = None,
               gate: Gate | None = None) -> Call:
    """Copy the call's chunks to the slab; once every copy is queued (and the done event
    recorded) ``progress`` hears ``LayersReady`` of every layer: the engine may reuse its buffer
    after that event (CPU: at once). A layer-wise store (``layer_groups``) reserves every chunk,
    then copies each group of layers once ``gate`` has it announced. Its phases are
    ``_StoreCall``'s, in order."""
    call = _StoreCall(sh, inst, msg, gate)  # every check, before any side effect
    sh.events.record(StoreStart(**call.base))
    try:
        call.copy()
        if progress is not None:
            progress(LayersReady(instance_id=inst.id, layers=inst.layout.num_layers,
                                 failed=np.flatnonzero(call.slots == FULL).tolist()))
        # digests and fingerprints while the copies run; inserted once the chunks are committed
        call.prepared = sh.fingerprints.prepare(call.ns, call.rows.ravel(), call.hashes)
        yield
        call.commit()
    except BaseException:
        call.abort()
        raise
    return call.report()


class _StoreCall:
    """One store, phase by phase: checked (``__init__``, no side effect), ``copy`` (reserve and
    queue the copies, batch by batch), ``commit`` (each group once its copies completed),
    ``report`` (write-behind, fingerprints, events, the reply); ``abort`` after a failure in
    ``copy`` or ``commit`` gives back every reservation not committed.

    Attributes:
        slots: per chunk, its reserved slot, ``EXISTS`` (stored already or being stored
            elsewhere: not copied again) or ``FULL`` (no room).
        groups: ``(first, end, marker)`` per group of queued copies, in order.
        done, reserved: chunks ``[0, done)`` are committed (or were lost to reclaim), chunks
            ``[0, reserved)`` went through ``reserve_slots``.
    """

    def __init__(self, sh: Shared, inst: "Instance", msg: StoreChunks, gate: Gate | None
                 ) -> None:
        self.t0 = time.monotonic()
        self.sh, self.inst, self.msg, self.gate = sh, inst, msg, gate
        tokens = tokens_of(msg.token_ids)
        buf = inst.buffer
        C, T = sh.chunk_size, buf.bind(msg.block_table)
        if msg.offset < 0 or msg.offset + len(tokens) > T:
            raise OutOfRange(f"offset {msg.offset} + {len(tokens)} tokens exceeds the buffer's "
                             f"{T}")
        if msg.first_position + len(tokens) > MAX_POSITION:
            raise BadRequest(f"first_position {msg.first_position} + {len(tokens)} tokens passes "
                             f"the largest position, {MAX_POSITION}")
        self.ns = _namespace(inst, msg.cache_salt)
        self.C, self.n = C, len(tokens) // C
        self.starts = msg.offset + C * np.arange(self.n, dtype=np.int64)
        buf.check(self.starts, C)
        _check_layerwise_store(msg, buf, self.n, gate)
        self.chunk_bytes = inst.layout.chunk_bytes(C)
        self.base = dict(request_id=msg.request_id, instance_id=inst.id,
                         store_kind=msg.kind.value, tokens=len(tokens), chunks=self.n)
        self.origin = ORIGIN_STANDALONE if msg.kind is StoreKind.PRE_COMPUTED else ORIGIN_FINAL
        self.rows = tokens[:self.n * C].reshape(self.n, C)
        self.slots = np.full(self.n, EXISTS, np.int64)
        self.keys = np.zeros((self.n, 4), np.int64)
        self.hashes: list[bytes] = []
        self.groups: list[tuple[int, int, Any]] = []
        self.done = self.reserved = 0
        self.prepared: Any = None

    def copy(self) -> None:
        """Reserve the chunks batch by batch and queue the copies of the ones reserved, a
        completion marker after each group (a layer-wise store: every chunk at once, then its
        groups of layers as the gate announces them)."""
        msg, buf, n = self.msg, self.inst.buffer, self.n
        buf.begin(msg.event)
        batches = [(0, n)] if msg.layer_groups else _batches(n, self.chunk_bytes,
                                                             self.sh.tuning.first_bytes)
        for lo, hi in batches:
            ours = self._reserve(lo, hi)
            if msg.layer_groups:
                assert self.gate is not None, "checked by _check_layerwise_store"
                _store_layer_groups(buf, msg, self.gate, self.starts[ours].tolist(),
                                    self.sh.store.kv_offsets(self.slots[ours]).tolist(), self.C,
                                    self.inst.layout.num_layers)
                self.groups.append((0, n, buf.end(msg.done_event)))
            else:
                self._queue(lo, hi)
        if not self.groups:
            self.groups.append((0, 0, buf.end(msg.done_event)))

    def _reserve(self, lo: int, hi: int) -> np.ndarray:
        """Keys and reservations of chunks ``[lo, hi)``; the indexes this call reserved."""
        C, store = self.C, self.sh.store
        parent = self.hashes[-1] if lo else None
        self.hashes += chunk_hashes(self.ns, self.rows[lo:hi].ravel(), C, parent=parent)
        self.keys[lo:hi] = _keys(self.ns.id, self.hashes[lo:hi], self.inst.rank)
        self.slots[lo:hi] = store.reserve_slots(self.inst.class_id, self.keys[lo:hi],
                                                self.rows[lo:hi])
        self.reserved = hi
        ours = lo + np.flatnonzero(self.slots[lo:hi] >= 0)  # others exist or found no room
        store.set_positions(self.slots[ours], self.msg.first_position + C * ours, self.origin)
        return ours

    def _queue(self, lo: int, hi: int) -> None:
        """Queue the copies of the reserved chunks of ``[lo, hi)``, group by group."""
        buf, per = self.inst.buffer, max(1, self.sh.tuning.group_bytes // max(1, self.chunk_bytes))
        for a in range(lo, hi, per):
            b = min(a + per, hi)
            idx = a + np.flatnonzero(self.slots[a:b] >= 0)
            if len(idx):
                buf.to_slab_many(self.starts[idx].tolist(), self.C,
                                 self.sh.store.kv_offsets(self.slots[idx]).tolist())
            self.groups.append((a, b, buf.end(self.msg.done_event) if b == self.n
                                else buf.mark()))

    def commit(self) -> None:
        """Make each group visible once its copies completed, never before."""
        for a, b, marker in self.groups:
            self.inst.buffer.wait(marker)
            try:
                if (self.slots[a:b] >= 0).any():
                    self.sh.store.commit_slots(self.slots[a:b], self.keys[a:b])
            finally:
                self.done = b

    def abort(self) -> None:
        """After a failure: wait for the copies in flight, then give back every reservation not
        committed (one reclaimed meanwhile is nothing of ours)."""
        _drain(self.inst.buffer)
        lost = slice(self.done, self.reserved)
        if (self.slots[lost] >= 0).any():
            try:
                self.sh.store.abort_slots(self.slots[lost], self.keys[lost])
            except ShmError:
                pass

    def report(self) -> TransferDone:
        """Offer the new chunks to the write-behind, register their fingerprints (rank 0),
        record the events and counters; the reply."""
        sh, inst, slots, n = self.sh, self.inst, self.slots, self.n
        copied = int(np.count_nonzero(slots >= 0))
        failed = np.flatnonzero(slots == FULL).tolist()
        if sh.writebehind is not None and copied:
            ours = np.flatnonzero(slots >= 0)
            sh.writebehind.offer(inst.class_id, self.ns.root, keys_of(self.keys[ours]),
                                 self.rows[ours])
        skipped = n - copied - len(failed)
        forget_evicted(sh)
        reg = _register_fingerprints(sh, inst, self.hashes, self.prepared,
                                     self.origin == ORIGIN_FINAL)
        if reg.not_indexed:
            _warn_not_indexed()
        nbytes = copied * self.chunk_bytes
        reply = TransferDone(instance_id=inst.id, num_chunks=n, copied=copied, failed=failed,
                             nbytes=nbytes, duration_s=time.monotonic() - self.t0,
                             not_indexed=reg.not_indexed,
                             reasons=[ChunkFailure.NO_ROOM] * len(failed))
        sh.events.record(StoreEnd(**self.base, copied=copied, storage_hits=skipped,
                                  failed=failed, fingerprint_new=reg.new,
                                  not_indexed=len(reg.not_indexed), bytes=nbytes,
                                  duration_s=reply.duration_s, ok=not failed))
        sh.events.add_many({Counter.STORES: 1, Counter.STORE_CHUNKS: copied,
                            Counter.STORE_SKIPPED_CHUNKS: skipped, Counter.STORE_BYTES: nbytes,
                            Counter.STORE_FAILED_CHUNKS: len(failed),
                            Counter.FINGERPRINT_NEW_ENTRIES: reg.new,
                            Counter.FINGERPRINT_NOT_INDEXED_CHUNKS: len(reg.not_indexed),
                            **STORE_SECONDS.observe(reply.duration_s)})
        sh.events.add_model(inst.request.model_name, {Counter.STORE_CHUNKS: copied,
                                                      Counter.STORE_BYTES: nbytes}, claim=True)
        return reply


def _check_layerwise_store(msg: StoreChunks, buf: "InstanceBuffer", n: int,
                           gate: Gate | None) -> None:
    if not msg.layer_groups:
        if msg.layer_events:
            raise BadRequest("layer_events were given for a store that is not layer-wise")
        return
    if gate is None:
        raise BadRequest("a layer-wise store needs the channel (its layers are announced there)")
    if msg.layer_groups > buf.layout.num_layers:
        raise BadRequest(f"{msg.layer_groups} layer groups for {buf.layout.num_layers} layers")
    if n > MAX_LAYER_GROUP_MATCHES:
        raise BadRequest(f"a layer-wise store takes at most {MAX_LAYER_GROUP_MATCHES} chunks, "
                         f"got {n}: split it")
    if msg.layer_events and (len(msg.layer_events) != msg.layer_groups or
                             not buf.records_events):
        raise BadRequest("layer_events: one per layer group, and only for a CUDA buffer")


def _store_layer_groups(buf: "InstanceBuffer", msg: StoreChunks, gate: Gate, at: list[int],
                        offs: list[int], C: int, L: int) -> None:
    """Copy each group of layers of the reserved chunks (token starts ``at``, slab offsets
    ``offs``) once the engine announced it."""
    bounds = [L * g // msg.layer_groups for g in range(msg.layer_groups + 1)]
    copies = buf.layer_copies(at, C, offs, to_slab=True)
    try:
        for g in range(msg.layer_groups):
            if not gate.wait(bounds[g + 1], msg.layer_wait_s):
                raise LayersNotWritten(f"layers [{bounds[g]}, {bounds[g + 1]}) were not "
                                       f"announced written within {msg.layer_wait_s} s")
            if msg.layer_events:
                buf.begin(msg.layer_events[g])  # the engine recorded it after writing the group
            if at:
                copies.copy(bounds[g], bounds[g + 1])
    finally:
        copies.close()


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


@functools.cache  # once per process; the count is in the metrics
def _warn_not_indexed() -> None:
    log.warning("the fingerprint index is full of live chunks: new chunks are stored but not "
                "found by lookups (counted in kvblend_fingerprint_not_indexed_chunks_total); "
                "raise --fingerprint-capacity")


def _register_fingerprints(sh: Shared, inst: "Instance", hashes: list[bytes],
                           prepared: Registration, final: bool) -> RegisterResult:
    """Rank 0 registers the chunks' fingerprints. Another rank registers only those the index
    lacks: a lookup that ran while rank 0's shard was stored but this rank's was not found the
    chunks not live and dropped their entries."""
    if not hashes:
        return RegisterResult(0, [])
    if inst.rank != 0 and all(sh.fingerprints.contains(h) for h in hashes):
        return RegisterResult(0, [])
    return sh.fingerprints.register_prepared(prepared, final)


def _check_matches(msg: RetrieveChunks, n_tokens: int, C: int, T: int) -> None:
    for j, m in enumerate(msg.matches):
        if m.cur_ed - m.cur_st != C or m.old_ed - m.old_st != C or m.cur_st < 0 or m.old_st < 0:
            raise BadRequest(f"match {j} does not span one chunk of {C} tokens: {m}")
        if m.cur_ed > n_tokens:
            raise OutOfRange(f"match {j} ends at {m.cur_ed}, past the {n_tokens} prompt tokens")
        if msg.offset < 0 or msg.offset + m.cur_ed > T:
            raise OutOfRange(f"match {j} at offset {msg.offset} + {m.cur_ed} exceeds the "
                             f"buffer's {T} tokens")
        if len(m.chunk_hash) != DIGEST_BYTES:
            raise BadRequest(f"match {j} has a chunk_hash of {len(m.chunk_hash)} bytes")


def prefetch(sh: Shared, inst: "Instance", msg: PrefetchChunks) -> int:
    """Start promoting the remote chunks among ``msg``'s matches (``dataplane.promote``) and
    return at once; a retrieve of them later waits for those promotions. Returns how many
    chunks are being promoted (0 without a remote tier)."""
    tokens = tokens_of(msg.token_ids)
    C = sh.chunk_size
    for j, m in enumerate(msg.matches):
        if m.cur_ed - m.cur_st != C or m.cur_ed > len(tokens) or len(m.chunk_hash) != DIGEST_BYTES:
            raise BadRequest(f"match {j} is not one chunk of {C} tokens inside the prompt: {m}")
    if sh.promoter is None or not msg.matches:
        return 0
    ns = _namespace(inst, msg.cache_salt)
    keys = _keys(ns.id, [m.chunk_hash for m in msg.matches], inst.rank)
    cur = np.fromiter((m.cur_st for m in msg.matches), np.int64, len(msg.matches))
    return len(sh.promoter.start(inst.class_id, ns.root, keys_of(keys),
                                 tokens[cur[:, None] + np.arange(C)]))


def _check_layerwise(msg: RetrieveChunks, buf: "InstanceBuffer") -> None:
    if not msg.layer_groups:
        if msg.layer_events:
            raise BadRequest("layer_events were given for a retrieve that is not layer-wise")
        return
    if msg.layer_groups > buf.layout.num_layers:
        raise BadRequest(f"{msg.layer_groups} layer groups for {buf.layout.num_layers} layers")
    if len(msg.matches) > MAX_LAYER_GROUP_MATCHES:
        raise BadRequest(f"a layer-wise retrieve takes at most {MAX_LAYER_GROUP_MATCHES} matches, "
                         f"got {len(msg.matches)}: split it")
    if msg.layer_events and (len(msg.layer_events) != msg.layer_groups or
                             not buf.records_events):
        raise BadRequest("layer_events: one per layer group, and only for a CUDA buffer")


def retrieve_call(sh: Shared, inst: "Instance", msg: RetrieveChunks,
                  progress: Callable[[LayersReady], None] | None = None) -> Call:
    """Copy the matches into the instance's buffer; a layer-wise retrieve announces each group
    of layers through ``progress`` (``dataplane.messages.RetrieveChunks``), any other once every
    copy is queued and the done event recorded. Its phases are ``_RetrieveCall``'s, in order."""
    call = _RetrieveCall(sh, inst, msg)  # every check, before any side effect
    sh.events.record(RetrieveStart(**call.base))
    call.promote()
    buf = inst.buffer
    try:
        buf.begin(msg.event)
        call.copy(progress)
        marker = buf.end(msg.done_event)
        if progress is not None and not msg.layer_groups:
            progress(LayersReady(instance_id=inst.id, layers=inst.layout.num_layers,
                                 failed=np.flatnonzero(call.why != VERIFIED).tolist()))
        yield
        buf.wait(marker)
    except BaseException:
        _drain(buf)
        raise
    finally:
        call.unpin()
    return call.report()


class _RetrieveCall:
    """One retrieve, phase by phase: checked (``__init__``, no side effect), ``promote`` (remote
    matches into the local store), ``copy`` (pin, check and queue, batch by batch or layer-wise),
    ``unpin`` (every batch still held, once its copies completed or failed), ``report``.

    Attributes:
        slots: per match, its pinned slot (-1: none).
        why: per match, ``VERIFIED`` (copied) or why not (``_FAILURES``).
        held: pinned batches ``(first, end, marker)`` not yet unpinned.
    """

    def __init__(self, sh: Shared, inst: "Instance", msg: RetrieveChunks) -> None:
        self.t0 = time.monotonic()
        self.sh, self.inst, self.msg = sh, inst, msg
        self.tokens = tokens_of(msg.token_ids)
        buf, C = inst.buffer, sh.chunk_size
        _check_matches(msg, len(self.tokens), C, buf.bind(msg.block_table))
        _check_layerwise(msg, buf)
        n = len(msg.matches)
        self.C, self.n = C, n
        self.cur = np.fromiter((m.cur_st for m in msg.matches), np.int64, n)
        self.turn = _Turn.of(inst, msg, self.cur, C)
        buf.check(msg.offset + self.cur, C)
        self.ns = _namespace(inst, msg.cache_salt)
        self.base = dict(request_id=msg.request_id, instance_id=inst.id,
                         tokens=len(self.tokens), chunks=n)
        self.keys = _keys(self.ns.id, [m.chunk_hash for m in msg.matches], inst.rank)
        self.slots = np.full(n, -1, np.int64)
        self.why = np.full(n, NOT_PINNED, np.int8)
        self.held: list[tuple[int, int, Any]] = []

    def promote(self) -> None:
        """Remote matches first become local (a miss fails at the pin)."""
        if self.sh.promoter is not None and self.n:
            self.sh.promoter.ensure(self.inst.class_id, self.ns.root, keys_of(self.keys),
                                    self.tokens[self.cur[:, None] + np.arange(self.C)])

    def copy(self, progress: Callable[[LayersReady], None] | None) -> None:
        if self.msg.layer_groups:
            self._copy_layerwise(progress or (lambda _: None))
        else:
            self._copy_batches()

    def _pin_and_check(self, lo: int, hi: int) -> np.ndarray:
        """Pin matches ``[lo, hi)`` as a batch held by this call and check them against the
        prompt; the indexes of the verified ones."""
        store, C, cur = self.sh.store, self.C, self.cur
        self.slots[lo:hi], full = _pin(store, self.inst.buffer, self.keys[lo:hi], self.slots,
                                       self.held)
        self.held.append((lo, hi, None))
        self.why[lo:hi] = PINS_FULL if full else store.check_pinned(
            self.inst.class_id, self.slots[lo:hi], self.keys[lo:hi],
            self.tokens[cur[lo:hi, None] + np.arange(C)])
        return lo + np.flatnonzero(self.why[lo:hi] == VERIFIED)

    def _copy_batches(self) -> None:
        """Pin, check and copy batch by batch; a batch is unpinned once the next one is
        copying."""
        sh, store, buf, C, turn = self.sh, self.sh.store, self.inst.buffer, self.C, self.turn
        for lo, hi in _batches(self.n, self.inst.layout.chunk_bytes(C), sh.tuning.first_bytes,
                               PIN_BATCH):
            idx = self._pin_and_check(lo, hi)
            if len(idx):
                at = (self.msg.offset + self.cur[idx]).tolist()
                buf.from_slab_many(store.kv_offsets(self.slots[idx]).tolist(), C, at)
                if turn is not None:
                    buf.turn_k(at, C, turn.of_batch(idx, store.positions(self.slots[idx])),
                               turn.cfg, 0, self.inst.layout.num_layers)
            self.held[-1] = (lo, hi, buf.mark())
            if len(self.held) > 1:  # the batch before this one: unpin once its copies completed
                _release(store, buf, self.slots, self.held.pop(0))

    def _copy_layerwise(self, progress: Callable[[LayersReady], None]) -> None:
        """Pin every match (one batch), then copy group by group of layers, announcing each."""
        msg, store, buf, C, turn = self.msg, self.sh.store, self.inst.buffer, self.C, self.turn
        L = self.inst.layout.num_layers
        idx = self._pin_and_check(0, self.n)
        offsets = store.kv_offsets(self.slots[idx]).tolist()
        starts = (msg.offset + self.cur[idx]).tolist()
        batch = turn.of_batch(idx, store.positions(self.slots[idx])) if turn is not None else None
        failed = np.flatnonzero(self.why != VERIFIED).tolist()
        bounds = [L * g // msg.layer_groups for g in range(msg.layer_groups + 1)]
        copies = buf.layer_copies(starts, C, offsets, to_slab=False)
        try:
            for g in range(msg.layer_groups):
                if len(idx):
                    copies.copy(bounds[g], bounds[g + 1])
                    if turn is not None:
                        buf.turn_k(starts, C, batch, turn.cfg, bounds[g], bounds[g + 1])
                if msg.layer_events:
                    buf.record(msg.layer_events[g])  # the engine's stream waits on it
                else:
                    buf.wait(buf.mark())  # the group's copies completed (CPU: at once)
                progress(LayersReady(instance_id=self.inst.id, layers=bounds[g + 1],
                                     failed=failed))
        finally:
            copies.close()

    def unpin(self) -> None:
        for lo, hi, _ in self.held:
            self.sh.store.unpin_slots(self.slots[lo:hi])

    def report(self) -> TransferDone:
        """Record the events and counters; the reply."""
        sh, inst, n = self.sh, self.inst, self.n
        failed = np.flatnonzero(self.why != VERIFIED).tolist()
        copied = n - len(failed)
        nbytes = copied * inst.layout.chunk_bytes(self.C)
        done = TransferDone(instance_id=inst.id, num_chunks=n, copied=copied,
                            failed=failed, nbytes=nbytes, duration_s=time.monotonic() - self.t0,
                            reasons=[_FAILURES[c] for c in self.why[failed].tolist()])
        sh.events.record(RetrieveEnd(**self.base, copied=copied, failed=failed, bytes=nbytes,
                                     duration_s=done.duration_s, ok=not failed))
        sh.events.add_many({Counter.RETRIEVES: 1, Counter.RETRIEVE_CHUNKS: copied,
                            Counter.RETRIEVE_BYTES: nbytes,
                            Counter.RETRIEVE_FAILED_CHUNKS: len(failed),
                            **RETRIEVE_SECONDS.observe(done.duration_s)})
        sh.events.add_model(inst.request.model_name, {Counter.RETRIEVE_CHUNKS: copied,
                                                      Counter.RETRIEVE_BYTES: nbytes}, claim=True)
        return done


class _Turn:
    """The re-rotation of a retrieve's chunks: each chunk's K turns from the positions it was
    computed at (its slot's ``POS0``, the store's ``first_position`` plus the chunk's place) to the
    prompt's (``first_position + cur_st``)."""

    def __init__(self, inst: "Instance", msg: RetrieveChunks, cur: np.ndarray, C: int) -> None:
        from kvblend.dataplane import rotary
        self._rotary, self._freqs, self._C = rotary, inst.rotary_freqs, C
        self.cfg = inst.request.rotary
        self._new = msg.first_position + cur
        if len(cur) and self._new.max() + C > MAX_POSITION:
            raise BadRequest(f"positions past {MAX_POSITION} cannot be turned")

    @classmethod
    def of(cls, inst: "Instance", msg: RetrieveChunks, cur: np.ndarray, C: int
           ) -> "_Turn | None":
        """None when the instance has no rotary config or the call opted out."""
        if inst.request.rotary is None or not msg.rotate:
            return None
        return cls(inst, msg, cur, C)

    def of_batch(self, idx: np.ndarray, stored: np.ndarray) -> Any:
        """The ``dataplane.rotary.Turn`` of matches ``idx``, stored from positions ``stored``."""
        step = np.arange(self._C)
        return self._rotary.Turn(self._freqs, stored[:, None] + step, self._new[idx, None] + step)


def _pin(store: Store, buf: "InstanceBuffer", keys: np.ndarray, slots: np.ndarray,
         held: list[tuple[int, int, Any]]) -> tuple[np.ndarray, bool]:
    """Pin ``keys`` (slot per key, -1 where not stored); when the pin table is full, give back
    the batches this call still holds and try once more; still full: nothing of this batch is
    pinned (its matches fail) and the flag says so."""
    try:
        return store.pin_slots(keys), False
    except CapacityError:
        pass
    while held:
        _release(store, buf, slots, held.pop(0))
    try:
        return store.pin_slots(keys), False
    except CapacityError:
        return np.full(len(keys), -1, np.int64), True


PINS_FULL = 4  # beside shm.slots.check's answers: the pin table was full
_FAILURES = {NOT_PINNED: ChunkFailure.MISSING, OTHER_LAYOUT: ChunkFailure.LAYOUT_MISMATCH,
             OTHER_TOKENS: ChunkFailure.TOKENS_MISMATCH, PINS_FULL: ChunkFailure.PINS_FULL}


def _release(store: Store, buf: "InstanceBuffer", slots: np.ndarray,
             batch: tuple[int, int, Any]) -> None:
    """Unpin a batch once the copies before its marker completed."""
    lo, hi, marker = batch
    buf.wait(buf.mark() if marker is None else marker)
    store.unpin_slots(slots[lo:hi])


__all__ = ["Shared", "Call", "Gate", "store_call", "retrieve_call", "run_to_end",
           "run_store", "run_retrieve", "tokens_of", "prefetch"]
