"""Promotion: a chunk read from the remote tier becomes a local chunk, committed in the slab like
any store's, so that the copy to the engine finds it local.

This module owns that one step, fetch then commit, and nothing of when it is asked for. The
value was checked by ``dataplane.remote.decode`` (key, root, rank, layout, tokens, digest) before
a byte reaches the slab; a miss leaves the store as it was.

Life of one promotion::

    fetch --a Miss--> nothing reserved, the Miss is the answer
    fetched --reserve: already committed or being written by someone else--> EXISTS
            --reserve: no room--> the store's StoreFull
            --reserved: copy, set its provenance, commit--> PROMOTED
    an error between reserve and commit --> the slot is aborted (nothing half-written is seen)
"""

from __future__ import annotations

from enum import Enum

import numpy as np

from dataplane.remote import ChunkId, Fetched, Miss, RemoteTier
from shm.store import ChunkKey, Store


class Promoted(Enum):
    """A promotion that found a chunk."""

    PROMOTED = "promoted"  # fetched and committed here
    EXISTS = "exists"      # the store holds it already (or another writer is storing it)


def promote(store: Store, tier: RemoteTier, class_id: int, namespace_id: int, chunk: ChunkId,
            tokens: np.ndarray) -> Promoted | Miss:
    """Fetch ``chunk`` (whose token ids are ``tokens``) and commit it in ``store`` under layout
    class ``class_id``.

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
    got = tier.get(chunk, tokens)
    if not isinstance(got, Fetched):
        return got
    res = store.reserve(class_id, key, tokens)
    if res is None:
        return Promoted.EXISTS
    try:
        res.kv.reshape(-1).view(np.uint8)[:] = np.frombuffer(got.kv, np.uint8)
        store.set_positions(np.array([res.slot]), np.array([got.pos0]), got.origin)
    except BaseException:
        res.abort()
        raise
    res.commit()
    return Promoted.PROMOTED


__all__ = ["promote", "Promoted"]
