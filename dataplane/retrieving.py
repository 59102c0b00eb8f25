"""A retrieve call: its checks, pins, copies (batch by batch or layer-wise, K turned where
asked), unpins and report, and the prefetch of remote matches (``dataplane.transfer`` says the
order and why)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from kvblend.dataplane.backend import Direction
from kvblend.dataplane.calls import (Call, Shared, StartOnce, batches, check_layer_groups, drain,
                                     match_rows, namespace_of, tokens_of)
from kvblend.dataplane.errors import BadRequest
from kvblend.dataplane.messages import (MAX_POSITION, ChunkFailure, LayersReady, PrefetchChunks,
                                        RetrieveChunks, TransferDone)
from kvblend.shm.errors import CapacityError
from kvblend.shm.keys import hash_keys, keys_of
from kvblend.shm.slots import NOT_PINNED, OTHER_LAYOUT, OTHER_TOKENS, VERIFIED
from kvblend.shm.store import Store
from kvblend.shm.telemetry import RETRIEVE_SECONDS, Counter, RetrieveEnd, RetrieveStart

if TYPE_CHECKING:
    from kvblend.dataplane.backend import InstanceBuffer
    from kvblend.dataplane.instance import Instance


PIN_BATCH = 512  # matches pinned at once by one retrieve; it holds at most two batches


def retrieve_call(sh: Shared, inst: "Instance", msg: RetrieveChunks,
                  progress: Callable[[LayersReady], None] | None = None) -> Call:
    """Copy the matches into the instance's buffer; a layer-wise retrieve announces each group
    of layers through ``progress`` (``dataplane.messages.RetrieveChunks``), any other once every
    copy is queued and the done event recorded. Its phases are ``_RetrieveCall``'s, in order."""
    call = _RetrieveCall(sh, inst, msg)  # every check, before any side effect
    buf = inst.buffer
    try:
        call.promote()
        buf.begin(msg.event, msg.order)
        call.copy(progress)  # logs the call's start once its first copies are queued
        call.started()
        marker = buf.end(msg.done_event)
        if progress is not None and not msg.layer_groups:
            progress(LayersReady(instance_id=inst.id, layers=inst.layout.num_layers,
                                 failed=np.flatnonzero(call.why != VERIFIED).tolist()))
        yield
        buf.wait(marker)
    except BaseException:
        drain(buf)  # first: nothing may keep the copies in flight past the unpins
        call.started()  # ahead of the error that the caller logs
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
        m = match_rows(msg.matches, len(self.tokens), C, msg.offset, buf.bind(msg.block_table))
        n = len(m)
        check_layer_groups("retrieve", msg, n, buf)
        self.C, self.n = C, n
        self.cur = m[:, 2]
        self.turn = _Turn.of(inst, msg, self.cur, C)
        self.old = m[:, 0] if inst.request.rotary is not None and not msg.rotate else None
        buf.check(msg.offset + self.cur, C)
        buf.check_order(msg.order)
        self.ns = namespace_of(inst, msg.cache_salt)
        self.base = dict(request_id=msg.request_id, instance_id=inst.id,
                         tokens=len(self.tokens), chunks=n)
        self.keys = hash_keys(self.ns.id, m[:, 4:], inst.rank)
        self.started = StartOnce(sh.events, RetrieveStart(**self.base))
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
        ok = lo + np.flatnonzero(self.why[lo:hi] == VERIFIED)
        if self.old is not None and len(ok):  # copied unturned: where the match said
            moved = store.positions(self.slots[ok]) != self.old[ok]
            self.why[ok[moved]] = MOVED
            ok = ok[~moved]
        return ok

    def _copy_batches(self) -> None:
        """Pin, check and copy batch by batch; a batch is unpinned once the next one is
        copying."""
        sh, store, buf, C, turn = self.sh, self.sh.store, self.inst.buffer, self.C, self.turn
        for lo, hi in batches(self.n, self.inst.layout.chunk_bytes(C), sh.tuning.first_bytes,
                               PIN_BATCH):
            idx = self._pin_and_check(lo, hi)
            if len(idx):
                at = (self.msg.offset + self.cur[idx]).tolist()
                buf.copy(Direction.FROM_SLAB, at, C, store.kv_offsets(self.slots[idx]).tolist())
                if turn is not None:
                    buf.turn_k(at, C, turn.of_batch(idx, store.positions(self.slots[idx])),
                               turn.cfg, 0, self.inst.layout.num_layers)
            self.held[-1] = (lo, hi, buf.mark())
            self.started()
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
        copies = buf.layer_copies(Direction.FROM_SLAB, starts, C, offsets)
        try:
            for g in range(msg.layer_groups):
                if len(idx):
                    copies.copy(bounds[g], bounds[g + 1])
                    if turn is not None:
                        buf.turn_k(starts, C, batch, turn.cfg, bounds[g], bounds[g + 1])
                ready = None
                if msg.layer_events:
                    buf.record(msg.layer_events[g])  # the engine's stream waits on it
                elif (ready := buf.signal()) is None:
                    buf.wait(buf.mark())  # the group's copies completed (CPU: at once)
                progress(LayersReady(instance_id=self.inst.id, layers=bounds[g + 1],
                                     failed=failed, ready=ready))
                self.started()
                if g == 0 and (msg.layer_events or ready is not None) and msg.layer_groups > 1:
                    # Layer 0 alone before the rest is queued: the engine waits on its event
                    # from another CUDA context, which the GPU serves at a context switch; behind
                    # 31 queued kernels that came 3.2-3.8 ms after the call, alone 1.5-1.9 ms.
                    buf.wait(buf.mark())
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
MOVED = 5  # and: stored from another position than the match's old_st (an unturned copy)
_FAILURES = {NOT_PINNED: ChunkFailure.MISSING, OTHER_LAYOUT: ChunkFailure.LAYOUT_MISMATCH,
             OTHER_TOKENS: ChunkFailure.TOKENS_MISMATCH, PINS_FULL: ChunkFailure.PINS_FULL,
             MOVED: ChunkFailure.MOVED}


def _release(store: Store, buf: "InstanceBuffer", slots: np.ndarray,
             batch: tuple[int, int, Any]) -> None:
    """Unpin a batch once the copies before its marker completed."""
    lo, hi, marker = batch
    buf.wait(buf.mark() if marker is None else marker)
    store.unpin_slots(slots[lo:hi])


def prefetch(sh: Shared, inst: "Instance", msg: PrefetchChunks) -> int:
    """Start promoting the remote chunks among ``msg``'s matches (``dataplane.promote``) and
    return at once; a retrieve of them later waits for those promotions. Returns how many
    chunks are being promoted (0 without a remote tier)."""
    tokens = tokens_of(msg.token_ids)
    m = match_rows(msg.matches, len(tokens), sh.chunk_size)
    if sh.promoter is None or not len(m):
        return 0
    ns = namespace_of(inst, msg.cache_salt)
    keys = keys_of(hash_keys(ns.id, m[:, 4:], inst.rank))
    rows = tokens[m[:, 2, None] + np.arange(sh.chunk_size)]
    return len(sh.promoter.start(inst.class_id, ns.root, keys, rows))


__all__ = ["retrieve_call", "prefetch", "PIN_BATCH"]
