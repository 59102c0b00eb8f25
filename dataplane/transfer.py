"""Store and retrieve: keys, reservations, pins, copies and commits for one call of one instance.

This module owns the order of operations that keeps the store consistent whatever the backend:

- store: compute the chunk keys, reserve a slot per full chunk (None = already stored or being
  stored elsewhere: not copied again), enqueue its copy, wait until every copy completed, then
  commit; on any failure abort every reservation of the call. Rank 0 (``worker_id`` 0 or None)
  registers the chunks' fingerprints (the index deduplicates content).
- retrieve: pin every matched chunk, copy each into ``offset + cur_st`` of the buffer, wait until
  the copies completed, then unpin. A chunk evicted meanwhile, of another layout, or whose tokens
  differ from the prompt's at ``cur_st`` is reported failed by match index; nothing is written
  for it.

It does not own threads or sockets (``dataplane.server``) or how bytes move (``dataplane.backend``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dataplane.errors import BadRequest, OutOfRange
from dataplane.messages import RetrieveChunks, StoreChunks, TransferDone
from shm.errors import StoreFull
from shm.events import EventLog
from shm.fingerprint import H_CAP, FingerprintIndex
from shm.hashing import DIGEST_BYTES, Namespace, chunk_hashes
from shm.segment import Segment
from shm.store import ChunkKey, PinnedChunk, Reservation, Store

if TYPE_CHECKING:
    from dataplane.instances import Instance


@dataclass(frozen=True)
class Shared:
    """The shared-memory state a transfer works on."""

    store: Store
    fingerprints: FingerprintIndex
    events: EventLog
    chunk_size: int


def open_fingerprints(prefix: str, chunk_size: int) -> FingerprintIndex:
    """Attach the existing fingerprint index with the capacity it was created with.

    Raises:
        FileNotFoundError: the supervisor has not created it.
    """
    seg = Segment(f"{prefix}_fp")
    capacity = int(np.ndarray((H_CAP + 1,), np.int64, seg.buf)[H_CAP])
    seg.close()
    return FingerprintIndex.open(prefix, chunk_size, capacity=capacity)


def tokens_of(raw: bytes) -> np.ndarray:
    if len(raw) % 4:
        raise BadRequest(f"token_ids must be little-endian uint32 bytes, got {len(raw)} bytes")
    return np.frombuffer(raw, "<u4")


def _namespace(inst: "Instance", cache_salt: str) -> Namespace:
    return Namespace(inst.request.model_name, inst.request.world_size, cache_salt)


def run_store(sh: Shared, inst: "Instance", msg: StoreChunks) -> TransferDone:
    t0 = time.monotonic()
    tokens = tokens_of(msg.token_ids)
    C, T = sh.chunk_size, inst.layout.num_tokens
    if msg.offset < 0 or msg.offset + len(tokens) > T:
        raise OutOfRange(f"offset {msg.offset} + {len(tokens)} tokens exceeds the buffer's {T}")
    ns = _namespace(inst, msg.cache_salt)
    hashes = chunk_hashes(ns, tokens, C)
    base = dict(request_id=msg.request_id, instance_id=inst.id, store_kind=msg.kind.value,
                tokens=len(tokens), chunks=len(hashes))
    sh.events.record("store_start", **base)
    reserved: list[Reservation] = []
    failed: list[int] = []
    skipped = 0
    try:
        inst.buffer.begin(msg.event)
        for i, h in enumerate(hashes):
            try:
                res = sh.store.reserve(inst.class_id, ChunkKey(ns.id, h, inst.rank),
                                       tokens[i * C:(i + 1) * C])
            except StoreFull:
                failed.append(i)
                continue
            if res is None:
                skipped += 1
                continue
            reserved.append(res)
            inst.buffer.to_slab(msg.offset + i * C, C, sh.store.slot_region(res.slot)[0])
        inst.buffer.finish(msg.done_event)
    except BaseException:
        for res in reserved:
            res.abort()
        raise
    for res in reserved:
        res.commit()
    new = _register_fingerprints(sh, inst, ns, tokens[:len(hashes) * C], hashes)
    nbytes = len(reserved) * inst.layout.chunk_bytes(C)
    done = TransferDone(instance_id=inst.id, num_chunks=len(hashes), copied=len(reserved),
                        failed=failed, nbytes=nbytes, duration_s=time.monotonic() - t0)
    sh.events.record("store_end", **base, copied=len(reserved), storage_hits=skipped,
                     failed=failed, fingerprint_new=new, bytes=nbytes,
                     duration_s=done.duration_s, ok=not failed)
    sh.events.add_many({"stores": 1, "store_chunks": len(reserved),
                        "store_skipped_chunks": skipped, "store_bytes": nbytes,
                        "store_failed_chunks": len(failed),
                        "fingerprint_new_entries": new})
    return done


def _register_fingerprints(sh: Shared, inst: "Instance", ns: Namespace, tokens: np.ndarray,
                           hashes: list[bytes]) -> int:
    """Rank 0 registers the chunks' fingerprints. Another rank registers only those the index
    lacks: a lookup that ran while rank 0's shard was stored but this rank's was not found the
    chunks not live and dropped their entries."""
    if not hashes:
        return 0
    if inst.rank != 0 and all(sh.fingerprints.contains(h) for h in hashes):
        return 0
    return sh.fingerprints.register(ns, tokens, hashes)


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


def run_retrieve(sh: Shared, inst: "Instance", msg: RetrieveChunks) -> TransferDone:
    t0 = time.monotonic()
    tokens = tokens_of(msg.token_ids)
    C = sh.chunk_size
    _check_matches(msg, len(tokens), C, inst.layout.num_tokens)
    ns = _namespace(inst, msg.cache_salt)
    base = dict(request_id=msg.request_id, instance_id=inst.id, tokens=len(tokens),
                chunks=len(msg.matches))
    sh.events.record("retrieve_start", **base)
    pins = sh.store.pin([ChunkKey(ns.id, m.chunk_hash, inst.rank) for m in msg.matches])
    failed: list[int] = []
    try:
        inst.buffer.begin(msg.event)
        for j, (m, p) in enumerate(zip(msg.matches, pins)):
            if not _usable(p, inst, tokens[m.cur_st:m.cur_ed]):
                failed.append(j)
                continue
            assert p is not None
            inst.buffer.from_slab(sh.store.slot_region(p.slot)[0], C, msg.offset + m.cur_st)
        inst.buffer.finish(msg.done_event)
    finally:
        sh.store.unpin(pins)
    copied = len(msg.matches) - len(failed)
    nbytes = copied * inst.layout.chunk_bytes(C)
    done = TransferDone(instance_id=inst.id, num_chunks=len(msg.matches), copied=copied,
                        failed=failed, nbytes=nbytes, duration_s=time.monotonic() - t0)
    sh.events.record("retrieve_end", **base, copied=copied, failed=failed, bytes=nbytes,
                     duration_s=done.duration_s, ok=not failed)
    sh.events.add_many({"retrieves": 1, "retrieve_chunks": copied, "retrieve_bytes": nbytes,
                        "retrieve_failed_chunks": len(failed)})
    return done


def _usable(p: PinnedChunk | None, inst: "Instance", want_tokens: np.ndarray) -> bool:
    """Pinned, of this instance's layout, and holding exactly the prompt's tokens there."""
    if p is None:
        return False
    lay = inst.layout
    if p.kv.shape[1] != lay.num_layers or p.kv.shape[3] != lay.hidden_dim or \
            p.kv.dtype.itemsize != lay.dtype.itemsize:
        return False
    return bool(np.array_equal(p.token_ids, want_tokens))


__all__ = ["Shared", "open_fingerprints", "run_store", "run_retrieve", "tokens_of"]
