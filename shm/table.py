"""The open-addressing hash table of every index in ``shm``, written once: linear probing,
backward-shift deletion, no tombstones.

This module owns the probing rule and nothing else: not what a word means, not where the table
lives, not locking. Its users are the object index (``shm.index``: key -> slot id) and the two
tables of the fingerprint index (``shm.fpkernels``: fingerprint -> entry, chunk hash -> entry).

A table is a power-of-two array of words; ``empty`` (a value of the array's dtype) marks a free
slot. A word names an entry in its owner's arrays, so the owner supplies, as numba functions:

    home(ctx, word) -> uint64     the hash of the word's entry; the word's home slot is
                                  ``hash & (len(table) - 1)``
    same(ctx, word, query) -> bool  whether the word's entry is the one ``query`` asks for

Invariant (checked by ``tests/shm/test_table.py`` against a dict model): every word lies on the
run of occupied slots that starts at its home, so a search walks from the home to the first empty
slot. Deletion keeps it without tombstones: the hole left by a word is filled by the next word of
the run whose home does not lie between the hole and itself (cyclically), and so on until the run
ends. So probe chains are only as long as the live words make them, after any amount of churn.

The owners keep their tables at most half full, so a run always ends.
"""

from __future__ import annotations

import kvblend.shm._jit  # noqa: F401  (numba's cache folder, before numba loads)

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def slot_of(table, h):
    """The home slot of hash ``h`` (any integer type)."""
    return np.int64(np.uint64(h) & np.uint64(table.shape[0] - 1))


@njit(cache=True, inline="always")
def step(table, i):
    """The slot after ``i``, wrapping around."""
    return (i + 1) & (table.shape[0] - 1)


@njit(cache=True)
def insert(table, empty, h, word) -> None:
    """Put ``word`` in the first free slot of the run at hash ``h``'s home."""
    i = slot_of(table, h)
    while table[i] != empty:
        i = step(table, i)
    table[i] = word


@njit(cache=True)
def locate(table, empty, h, word) -> int:
    """The slot holding exactly ``word`` (whose hash is ``h``), or -1."""
    i = slot_of(table, h)
    while table[i] != empty:
        if table[i] == word:
            return i
        i = step(table, i)
    return -1


@njit(cache=True)
def find(table, empty, h, same, ctx, query) -> int:
    """The first slot from hash ``h``'s home whose word ``same(ctx, word, query)``, or -1."""
    i = slot_of(table, h)
    while table[i] != empty:
        if same(ctx, table[i], query):
            return i
        i = step(table, i)
    return -1


@njit(cache=True)
def delete_at(table, empty, i, home, ctx) -> None:
    """Empty slot ``i`` and shift later words of its run back so every word stays findable."""
    mask = table.shape[0] - 1
    hole = i
    j = step(table, i)
    while table[j] != empty:
        # the word at j may fill the hole when the hole lies cyclically in [its home, j)
        if (j - slot_of(table, home(ctx, table[j]))) & mask >= (j - hole) & mask:
            table[hole] = table[j]
            hole = j
        j = step(table, j)
    table[hole] = empty


@njit(cache=True)
def remove(table, empty, h, word, home, ctx) -> bool:
    """Delete ``word`` (whose hash is ``h``); False when it is not in the table."""
    i = locate(table, empty, h, word)
    if i < 0:
        return False
    delete_at(table, empty, i, home, ctx)
    return True


__all__ = ["insert", "locate", "find", "delete_at", "remove", "slot_of", "step"]
