"""The probe: every stored chunk's window inside a query, proposed by rolling hash, kept by digest.

This module owns how a query is searched (steps 1 and 2 of ``shm.matcher``'s lookup): the
polynomial rolling hash over every ``chunk_size`` window, ``H = sum x_i * B^(k-1-i) mod 2^64`` with
``B = 0x9E3779B97F4A7C15``, updated incrementally; its probe of the presence filter and the
fingerprint table (``shm.fpformat``); and the 128-bit digest that turns a candidate into a match.
It does not own the index's mutations (``shm.fpkernels``) nor the choice among matches
(``shm.cover``).
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import hashlib

import numpy as np
from numba import njit

from kvblend.shm import table
from kvblend.shm.fpformat import E_DIG0, E_DIG1, E_KEY, LO32, U32, filter_bits, mix
from kvblend.shm.hashing import DIGEST_BYTES

BASE = 0x9E3779B97F4A7C15


@njit(cache=True)
def chunk_fingerprints(tokens: np.ndarray, k: int) -> np.ndarray:
    """Rolling hash of each non-overlapping full chunk ``tokens[i*k:(i+1)*k]`` (uint64)."""
    n = tokens.shape[0] // k
    out = np.empty(n, np.uint64)
    b = np.uint64(BASE)
    for c in range(n):
        h = np.uint64(0)
        for i in range(c * k, (c + 1) * k):
            h = h * b + np.uint64(tokens[i])
        out[c] = h
    return out


@njit(cache=True)
def probe(tokens, k, nsid, E, fpt, bloom, near, keys, out_pos, out_ent):
    """Every (query position, entry) pair with equal 64-bit key; returns how many (may exceed out).

    One branch-free pass rolls the hash and tests each window against the presence filter, which is
    a few bytes per entry and stays in cache; only the few windows that pass pay a miss in the much
    larger table. ``near`` and ``keys`` are scratch of at least ``len(tokens)`` elements, reused by
    the caller (fresh large temporaries would cost page faults on every call).
    """
    n = tokens.shape[0] - k + 1
    if n <= 0:
        return 0
    b = np.uint64(BASE)
    top = np.uint64(1)
    for _ in range(k - 1):
        top = top * b
    h = np.uint64(0)
    for i in range(k - 1):
        h = h * b + np.uint64(tokens[i])
    wmask = np.uint64(bloom.shape[0] - 1)
    nn = 0
    for j in range(n):
        if j > 0:
            h -= np.uint64(tokens[j - 1]) * top
        h = h * b + np.uint64(tokens[j + k - 1])
        key = h ^ nsid
        w, bits = filter_bits(mix(key), wmask)
        near[nn] = j
        keys[nn] = key
        nn += (bloom[w] & bits) == bits
    cap = out_pos.shape[0]
    count = 0
    for c in range(nn):
        key = keys[c]
        m = mix(key)
        tag = m >> U32
        i = table.slot_of(fpt, m)
        while fpt[i] != 0:
            s = fpt[i]
            if (s >> U32) == tag:
                e = np.int64(s & LO32) - 1
                if E[e, E_KEY] == key:
                    if count < cap:
                        out_pos[count] = near[c]
                        out_ent[count] = e
                    count += 1
            i = table.step(fpt, i)
    return count


def digest(root: bytes, window: bytes) -> bytes:
    """blake2b-128 of (namespace root, a window's tokens as little-endian uint32): an entry's DIG."""
    h = hashlib.blake2b(root, digest_size=DIGEST_BYTES)
    h.update(window)
    return h.digest()


def verified(root: bytes, tokens: np.ndarray, k: int, pos: np.ndarray,
             rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The candidates (query position, entry row) whose window's digest equals the entry's:
    a 64-bit key only proposes (mod 2^64 the rolling hash collides), the digest decides."""
    keep = np.zeros(len(pos), bool)
    want = rows[:, E_DIG0:E_DIG1 + 1]
    seen: dict[int, bytes] = {}
    for c in range(len(pos)):
        p = int(pos[c])
        d = seen.get(p)
        if d is None:
            d = seen[p] = digest(root, tokens[p:p + k].tobytes())
        keep[c] = d == want[c].tobytes()
    return pos[keep], rows[keep]


__all__ = ["BASE", "chunk_fingerprints", "probe", "digest", "verified"]
