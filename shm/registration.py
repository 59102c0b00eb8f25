"""A registration of a stored sequence in the fingerprint index: what it inserts, and what it did.

This module owns the lock-free half of a registration (``prepare``: the digests and fingerprints
of each chunk, with repeated content folded to one row) and the records that cross the index's
boundary (``Registration``, ``RegisterResult``, chunk-hash words). The locked half, the insert,
is ``shm.fpkernels.register`` called by ``shm.fingerprint``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvblend.shm.hashing import DIGEST_BYTES, Namespace, as_tokens
from kvblend.shm.probe import chunk_fingerprints, digest

ChunkHashes = Sequence[bytes] | np.ndarray
"""16-byte chunk hashes, or an int64/uint64 ``[n, 2]`` array of each hash as two little-endian
words (the K0, K1 words of a store key)."""


def hash_words(chunk_hashes: ChunkHashes) -> np.ndarray:
    """Chunk hashes as a contiguous uint64 ``[n, 2]`` array.

    Raises:
        ValueError: a hash is not 16 bytes, or an array is not ``[n, 2]`` of 64-bit integers.
    """
    if isinstance(chunk_hashes, np.ndarray):
        a = chunk_hashes
        if a.ndim != 2 or a.shape[1] != 2 or a.dtype not in (np.dtype(np.int64),
                                                             np.dtype(np.uint64)):
            raise ValueError(f"chunk hash words must be an int64 [n, 2] array, got "
                             f"{a.dtype} {a.shape}")
        return np.array(a, order="C").view(np.uint64)
    for h in chunk_hashes:
        if len(h) != DIGEST_BYTES:
            raise ValueError(f"chunk hashes must be {DIGEST_BYTES} bytes, got {len(h)}")
    # writable like the array form: numba compiles a kernel again for read-only arguments
    return np.frombuffer(bytearray(b"".join(chunk_hashes)), np.uint64).reshape(-1, 2)


@dataclass(frozen=True)
class Registration:
    """Chunks ready to insert (``FingerprintIndex.prepare``), one row per distinct content."""

    keys: np.ndarray      # uint64 probe keys (fingerprint ^ namespace id)
    digests: np.ndarray   # uint64 [n, 2]: blake2b-128 of namespace root + tokens
    hashes: np.ndarray    # uint64 [n, 2]: the chunk hashes (store keys)
    old_st: np.ndarray    # int64 positions in the registered sequence
    rows: np.ndarray      # int64, one per full chunk of the sequence: the row holding its content


@dataclass(frozen=True, slots=True)
class RegisterResult:
    """What one registration did; ``int(result)`` is ``result.new``.

    Attributes:
        new: entries added (content this namespace had not indexed).
        not_indexed: ascending indexes of the registration's chunks (chunk i covers tokens
            ``[i*C, (i+1)*C)``) whose content is not findable because the index was full of live
            entries. The chunks themselves are stored; only lookups will not find them.
    """

    new: int
    not_indexed: list[int]

    def __int__(self) -> int:
        return self.new


def prepare(namespace: Namespace, token_ids: Any, chunk_hashes: Sequence[bytes],
            chunk_size: int) -> Registration:
    """What registering a stored sequence inserts, computed without the index's lock: one row per
    distinct content (its probe key, digest, chunk hash and position), and each chunk's row.

    Raises:
        ValueError: ``chunk_hashes`` does not have one key per full chunk.
    """
    tokens = as_tokens(token_ids)
    k = chunk_size
    n = len(tokens) // k
    if len(chunk_hashes) != n:
        raise ValueError(f"{n} full chunks but {len(chunk_hashes)} chunk hashes")
    if n == 0:
        empty = np.zeros((0, 2), np.uint64)
        none = np.zeros(0, np.int64)
        return Registration(np.zeros(0, np.uint64), empty, empty, none, none)
    hashes = hash_words(chunk_hashes)
    raw = tokens[: n * k].tobytes()
    step = 4 * k
    root = namespace.root
    digs = [digest(root, raw[i * step:(i + 1) * step]) for i in range(n)]
    row_of: dict[bytes, int] = {}  # content -> its row, numbered by first occurrence
    rows = np.fromiter((row_of.setdefault(d, len(row_of)) for d in digs), np.int64, n)
    idx: slice | np.ndarray = slice(None)
    if len(row_of) < n:
        idx = np.unique(rows, return_index=True)[1]  # each row's first chunk, ascending
        digs = [digs[i] for i in idx]
    return Registration(
        keys=chunk_fingerprints(tokens, k)[idx] ^ np.uint64(namespace.id),
        digests=np.frombuffer(b"".join(digs), np.uint64).reshape(-1, 2),
        hashes=np.ascontiguousarray(hashes[idx]),
        old_st=(np.arange(n, dtype=np.int64) * k)[idx],
        rows=rows)


__all__ = ["Registration", "RegisterResult", "ChunkHashes", "hash_words", "prepare"]
