"""The one open-addressing table (``shm.table``) against a dict model.

Words are small ints; a word's hash comes from a context array chosen so that homes collide and
runs wrap around the end of the table, which is where backward-shift deletion goes wrong.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from numba import njit

from kvblend.shm import table

SLOTS = 16
WORDS = 12          # at most 3/4 full: every run ends
EMPTY = np.int64(-1)


@njit(cache=True)
def _home(homes, word):
    return np.uint64(homes[word])


@njit(cache=True)
def _is(homes, word, query):
    return word == query


@njit(cache=True)
def _insert(tab, homes, word):
    table.insert(tab, EMPTY, homes[word], np.int64(word))


@njit(cache=True)
def _remove(tab, homes, word):
    return table.remove(tab, EMPTY, homes[word], np.int64(word), _home, homes)


@njit(cache=True)
def _find(tab, homes, word):
    return table.find(tab, EMPTY, homes[word], _is, homes, np.int64(word))


ops = st.lists(st.tuples(st.sampled_from(["insert", "remove"]), st.integers(0, WORDS - 1)),
               max_size=60)
# homes in the last few slots make runs wrap; large hashes check the masking
homes_st = st.lists(st.sampled_from([0, 1, 13, 14, 15, 15 + 16 * 7, 2**63 + 14]),
                    min_size=WORDS, max_size=WORDS)


def _check(tab: np.ndarray, homes: np.ndarray, model: set[int]) -> None:
    assert sorted(int(w) for w in tab if w != EMPTY) == sorted(model)
    for w in range(WORDS):
        i = _find(tab, homes, w)
        assert (i >= 0) == (w in model), (w, tab)
        assert table.locate(tab, EMPTY, np.uint64(homes[w]), np.int64(w)) == i
        if w in model:
            # nothing empty between the word's home and the word: every search reaches it
            j = int(homes[w]) % SLOTS
            while j != i:
                assert tab[j] != EMPTY, (w, tab)
                j = (j + 1) % SLOTS


@settings(max_examples=300, deadline=None)
@given(ops, homes_st)
def test_the_table_behaves_as_a_set(steps: list[tuple[str, int]], homes_list: list[int]) -> None:
    homes = np.array(homes_list, np.uint64)
    tab = np.full(SLOTS, EMPTY, np.int64)
    model: set[int] = set()
    for op, w in steps:
        if op == "insert" and w not in model:
            _insert(tab, homes, w)
            model.add(w)
        elif op == "remove":
            assert _remove(tab, homes, w) == (w in model)
            model.discard(w)
        _check(tab, homes, model)


def test_churn_leaves_no_residue() -> None:
    """Deleting without tombstones: after any churn the table equals a fresh one's occupancy."""
    rng = np.random.default_rng(7)
    homes = rng.integers(0, 2**63, WORDS).astype(np.uint64)
    tab = np.full(SLOTS, EMPTY, np.int64)
    live: set[int] = set()
    for _ in range(2000):
        w = int(rng.integers(WORDS))
        if w in live:
            _remove(tab, homes, w)
            live.discard(w)
        else:
            _insert(tab, homes, w)
            live.add(w)
    assert int(np.count_nonzero(tab != EMPTY)) == len(live)
    _check(tab, homes, live)
