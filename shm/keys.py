"""The key of one stored object, and its four int64 words as the kernels compare them.

This module owns ``ChunkKey`` (namespace id, 16-byte chunk hash, tensor-parallel rank) and its word
form. It does not own how a chunk hash is computed (``shm.hashing``) nor where the words are kept
(``shm.index``: the obj columns K0, K1, NS, RANK; ``shm.header.SlotHdr`` in each slot).

Word form (int64 each, the order of the obj columns and of ``Store.take_evicted`` rows)::

    word  meaning
    0     chunk_hash[0:8], little-endian, signed
    1     chunk_hash[8:16], little-endian, signed
    2     namespace_id as a signed 64-bit word (ids are unsigned 64-bit)
    3     rank
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ChunkKey:
    """Key of one stored object: namespace id, 16-byte chunk hash, tensor-parallel rank."""

    namespace_id: int
    chunk_hash: bytes
    rank: int = 0
    _words: tuple[int, int, int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.chunk_hash) != 16:
            raise ValueError(f"a chunk hash has 16 bytes, got {len(self.chunk_hash)}")
        object.__setattr__(self, "_words", (
            int.from_bytes(self.chunk_hash[:8], "little", signed=True),
            int.from_bytes(self.chunk_hash[8:16], "little", signed=True),
            signed64(self.namespace_id), self.rank))

    def words(self) -> tuple[int, int, int, int]:
        """The key as the four int64 words the kernels compare."""
        return self._words


Keys = Sequence[ChunkKey] | np.ndarray
"""Keys of a batch: ``ChunkKey`` objects, or already their int64 ``[n, 4]`` words (``key_words``:
the data plane's calls build no object per chunk)."""


def key_words(keys: Keys) -> np.ndarray:
    """Keys as an int64 ``[n, 4]`` array for the kernels (words are taken as they are).

    Raises:
        ValueError: an array that is not int64 ``[n, 4]``.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.int64 or keys.ndim != 2 or keys.shape[1] != 4:
            raise ValueError(f"key words are int64 [n, 4], got {keys.dtype} {keys.shape}")
        return np.ascontiguousarray(keys)
    if len(keys) == 1:
        return np.array([keys[0].words()], np.int64)
    out = np.empty((len(keys), 4), np.int64)
    raw = b"".join(k.chunk_hash for k in keys)
    out[:, :2] = np.frombuffer(raw, "<i8").reshape(len(keys), 2)
    out[:, 2] = [signed64(k.namespace_id) for k in keys]
    out[:, 3] = [k.rank for k in keys]
    return out


def batch_words(namespace_id: int, chunk_hashes: Sequence[bytes], rank: int) -> np.ndarray:
    """The words of the keys ``(namespace_id, h, rank)`` of every hash, without key objects."""
    return hash_keys(namespace_id, np.frombuffer(b"".join(chunk_hashes), "<i8").reshape(-1, 2),
                     rank)


def hash_keys(namespace_id: int, hash_words: np.ndarray, rank: int) -> np.ndarray:
    """``batch_words`` of hashes given as their two little-endian int64 words, ``[n, 2]``."""
    words = np.empty((len(hash_words), 4), np.int64)
    words[:, :2] = hash_words
    words[:, 2], words[:, 3] = signed64(namespace_id), rank
    return words


def shard_words(namespace_id: int, chunk_hashes: Sequence[bytes], world_size: int) -> np.ndarray:
    """The keys of every rank's shard of each chunk, int64 ``[len(chunk_hashes) * world_size, 4]``
    (chunk-major), built without ``ChunkKey`` objects."""
    words = np.repeat(batch_words(namespace_id, chunk_hashes, 0), world_size, axis=0)
    words[:, 3] = np.tile(np.arange(world_size), len(chunk_hashes))
    return words


def hashes_among(held: np.ndarray, words: np.ndarray) -> np.ndarray:
    """Boolean per row of ``words`` (int64 ``[n, 2]``, chunk-hash words): the pair is a row of
    ``held`` (int64 ``[m, 2]``, in any order, repeats allowed)."""
    order = np.lexsort((held[:, 1], held[:, 0]))
    k0, k1 = held[order, 0], held[order, 1]
    lo = np.searchsorted(k0, words[:, 0], "left")
    hi = np.searchsorted(k0, words[:, 0], "right")
    first = np.minimum(lo, max(len(k0) - 1, 0))
    out = (hi > lo) & (k1[first] == words[:, 1]) if len(k0) else np.zeros(len(words), bool)
    for i in np.flatnonzero(hi - lo > 1):  # one k0 in several objects: compare all their k1
        out[i] = bool((k1[lo[i]:hi[i]] == words[i, 1]).any())
    return out


def keys_of(words: np.ndarray) -> list[ChunkKey]:
    """The ``ChunkKey`` objects of int64 ``[n, 4]`` key words (``key_words``' inverse)."""
    return [ChunkKey(ns & ((1 << 64) - 1), int(k0).to_bytes(8, "little", signed=True)
                     + int(k1).to_bytes(8, "little", signed=True), rank)
            for k0, k1, ns, rank in np.asarray(words, np.int64).tolist()]


def signed64(u: int) -> int:
    """An unsigned 64-bit number as the signed int64 word holding the same bits."""
    return u - (1 << 64) if u >= 1 << 63 else u


__all__ = ["ChunkKey", "Keys", "key_words", "batch_words", "hash_keys", "keys_of", "shard_words",
           "hashes_among", "signed64"]
