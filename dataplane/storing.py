"""A store call: its checks, reservations, copies, commits and report (``dataplane.transfer``
says the order and why)."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvblend.dataplane.backend import Direction
from kvblend.dataplane.calls import (Call, Gate, Shared, StartOnce, batches, check_layer_groups,
                                     chunk_keys, drain, forget_evicted, log, namespace_of,
                                     tokens_of)
from kvblend.dataplane.errors import BackendError, BadRequest, LayersNotWritten, OutOfRange
from kvblend.dataplane.messages import (MAX_POSITION, ChunkFailure, LayersReady, StoreChunks,
                                        StoreKind, TransferDone)
from kvblend.shm.errors import ShmError
from kvblend.shm.fingerprint import RegisterResult, Registration
from kvblend.shm.hashing import chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.keys import keys_of
from kvblend.shm.slab import EXISTS, FULL
from kvblend.shm.telemetry import STORE_SECONDS, Counter, StoreEnd, StoreStart

if TYPE_CHECKING:
    from kvblend.dataplane.backend import InstanceBuffer
    from kvblend.dataplane.instance import Instance


def store_call(sh: Shared, inst: "Instance", msg: StoreChunks,
               progress: Callable[[LayersReady], None] | None = None,
               gate: Gate | None = None) -> Call:
    """Copy the call's chunks to the slab; once every copy is queued (and the done event
    recorded) ``progress`` hears ``LayersReady`` of every layer: the engine may reuse its buffer
    after that event (CPU: at once). A layer-wise store (``layer_groups``) reserves every chunk,
    then copies each group of layers once ``gate`` has it announced. Its phases are
    ``_StoreCall``'s, in order."""
    call = _StoreCall(sh, inst, msg, gate)  # every check, before any side effect
    try:
        call.copy()  # logs the call's start once its first copies are queued
        call.started()
        if progress is not None:
            progress(LayersReady(instance_id=inst.id, layers=inst.layout.num_layers,
                                 failed=np.flatnonzero(call.slots == FULL).tolist()))
        # digests and fingerprints while the copies run; inserted once the chunks are committed
        call.prepared = sh.fingerprints.prepare(call.ns, call.rows.ravel(), call.hashes)
        yield
        call.commit()
    except BaseException:
        call.abort()  # first: nothing may keep the reservations from being given back
        call.started()  # ahead of the error that the caller logs
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
        self.ns = namespace_of(inst, msg.cache_salt)
        self.C, self.n = C, len(tokens) // C
        self.starts = msg.offset + C * np.arange(self.n, dtype=np.int64)
        buf.check(self.starts, C)
        buf.check_order(msg.order)
        if check_layer_groups("store", msg, self.n, buf) and gate is None:
            raise BadRequest("a layer-wise store needs the channel (its layers are announced "
                             "there)")
        self.chunk_bytes = inst.layout.chunk_bytes(C)
        self.base = dict(request_id=msg.request_id, instance_id=inst.id,
                         store_kind=msg.kind.value, tokens=len(tokens), chunks=self.n)
        self.started = StartOnce(sh.events, StoreStart(**self.base))
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
        buf.begin(msg.event, msg.order)
        todo = [(0, n)] if msg.layer_groups else batches(n, self.chunk_bytes,
                                                         self.sh.tuning.first_bytes)
        for lo, hi in todo:
            ours = self._reserve(lo, hi)
            if msg.layer_groups:
                assert self.gate is not None, "checked in __init__"
                self.started()  # before waiting for the engine's first layers
                _store_layer_groups(buf, msg, self.gate, self.starts[ours].tolist(),
                                    self.sh.store.kv_offsets(self.slots[ours]).tolist(), self.C,
                                    self.inst.layout.num_layers)
                self.groups.append((0, n, buf.end(msg.done_event)))
            else:
                self._queue(lo, hi)
                self.started()
        if not self.groups:
            self.groups.append((0, 0, buf.end(msg.done_event)))

    def _reserve(self, lo: int, hi: int) -> np.ndarray:
        """Keys and reservations of chunks ``[lo, hi)``; the indexes this call reserved."""
        C, store = self.C, self.sh.store
        parent = self.hashes[-1] if lo else None
        self.hashes += chunk_hashes(self.ns, self.rows[lo:hi].ravel(), C, parent=parent)
        self.keys[lo:hi] = chunk_keys(self.ns.id, self.hashes[lo:hi], self.inst.rank)
        self.slots[lo:hi] = store.reserve_slots(self.inst.class_id, self.keys[lo:hi],
                                                self.rows[lo:hi])
        self.reserved = hi
        ours = lo + np.flatnonzero(self.slots[lo:hi] >= 0)  # others exist or found no room
        store.set_positions(self.slots[ours], self.msg.first_position + C * ours, self.origin,
                            self.ns.root)
        return ours

    def _queue(self, lo: int, hi: int) -> None:
        """Queue the copies of the reserved chunks of ``[lo, hi)``, group by group."""
        buf, per = self.inst.buffer, max(1, self.sh.tuning.group_bytes // max(1, self.chunk_bytes))
        for a in range(lo, hi, per):
            b = min(a + per, hi)
            idx = a + np.flatnonzero(self.slots[a:b] >= 0)
            if len(idx):
                buf.copy(Direction.TO_SLAB, self.starts[idx].tolist(), self.C,
                         self.sh.store.kv_offsets(self.slots[idx]).tolist())
            self.groups.append((a, b, buf.end(self.msg.done_event) if b == self.n
                                else buf.mark()))

    def commit(self) -> None:
        """Make each group visible once its copies completed, never before."""
        for a, b, marker in self.groups:
            self.inst.buffer.wait(marker)
            if self.inst.buffer.released:
                raise BackendError("the instance's lease ran out before its engine ordered the "
                                   "copies: nothing stored")
            try:
                if (self.slots[a:b] >= 0).any():
                    self.sh.store.commit_slots(self.slots[a:b], self.keys[a:b])
            finally:
                self.done = b

    def abort(self) -> None:
        """After a failure: wait for the copies in flight, then give back every reservation not
        committed (one reclaimed meanwhile is nothing of ours)."""
        drain(self.inst.buffer)
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


def _store_layer_groups(buf: "InstanceBuffer", msg: StoreChunks, gate: Gate, at: list[int],
                        offs: list[int], C: int, L: int) -> None:
    """Copy each group of layers of the reserved chunks (token starts ``at``, slab offsets
    ``offs``) once the engine announced it."""
    bounds = [L * g // msg.layer_groups for g in range(msg.layer_groups + 1)]
    copies = buf.layer_copies(Direction.TO_SLAB, at, C, offs)
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


__all__ = ["store_call"]
