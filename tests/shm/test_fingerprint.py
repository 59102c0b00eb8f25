"""The fingerprint index: kernels against slow references, the behaviour table, collisions, processes."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvblend.shm import cover, fpformat, probe
from kvblend.shm import fingerprint as F
from kvblend.shm.fpformat import Entry, FpHdr
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.fingerprint import FingerprintIndex, RegisterResult
from kvblend.shm.matches import Match
from kvblend.shm.hashing import Namespace, chunk_hashes
from tests.harness import poll

NS = Namespace("test-model")
M64 = (1 << 64) - 1
C = 4

Make = Callable[..., FingerprintIndex]


@pytest.fixture
def make() -> Iterator[Make]:
    made: list[FingerprintIndex] = []

    def _make(chunk_size: int = C, capacity: int = 256, prefix: str | None = None,
              wipe: bool = False) -> FingerprintIndex:
        idx = FingerprintIndex.open(prefix or f"kvbt_{uuid.uuid4().hex[:8]}", chunk_size,
                                    capacity, wipe=wipe)
        made.append(idx)
        return idx

    yield _make
    for idx in made:
        idx.unlink()
        idx.close()


def toks(n: int, seed: int, high: int = 1 << 32) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, high, n, dtype=np.uint64).astype(np.uint32)


def reg(idx: FingerprintIndex, seq: np.ndarray, ns: Namespace = NS) -> list[bytes]:
    hashes = chunk_hashes(ns, seq, idx.chunk_size)
    idx.register(ns, seq, hashes)
    return hashes


def spans(matches: list[Match]) -> list[tuple[int, int, int, int]]:
    return [(m.old_st, m.old_ed, m.cur_st, m.cur_ed) for m in matches]


# -- slow references -----------------------------------------------------------------------------


def ref_hash(window: list[int]) -> int:
    h = 0
    for x in window:
        h = (h * probe.BASE + int(x)) & M64
    return h


def ref_candidates(stored: list[np.ndarray], query: np.ndarray, k: int) -> set[tuple[int, int]]:
    """(cur_st, old_st) of every occurrence of every stored chunk, by direct token comparison."""
    out = set()
    for seq in stored:
        for c in range(len(seq) // k):
            chunk = seq[c * k:(c + 1) * k]
            for p in range(len(query) - k + 1):
                if np.array_equal(query[p:p + k], chunk):
                    out.add((p, c * k))
    return out


def ref_best(cur: list[int], seq: list[int], old: list[int], k: int) -> tuple[int, int]:
    """(chosen, adjacent continuing pairs) of the best non-overlapping subset, by brute force."""
    best = (0, 0)
    n = len(cur)
    for r in range(1, n + 1):
        for sub in itertools.combinations(range(n), r):
            pts = sorted(sub, key=lambda i: cur[i])
            if any(cur[b] < cur[a] + k for a, b in zip(pts, pts[1:])):
                continue
            adj = sum(cur[b] == cur[a] + k and seq[b] == seq[a] and old[b] == old[a] + k
                      for a, b in zip(pts, pts[1:]))
            best = max(best, (r, adj))
    return best


# -- kernels -------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_chunk_fingerprints_match_reference(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 40))
    t = toks(int(rng.integers(0, 120)), seed)
    want = [ref_hash(t[c * k:(c + 1) * k].tolist()) for c in range(len(t) // k)]
    assert probe.chunk_fingerprints(t, k).tolist() == want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=60), st.integers(1, 9))
def test_chunk_fingerprints_hypothesis(values: list[int], k: int) -> None:
    t = np.array(values, np.uint32)
    want = [ref_hash(values[c * k:(c + 1) * k]) for c in range(len(values) // k)]
    assert probe.chunk_fingerprints(t, k).tolist() == want


@contextmanager
def scratch_index(chunk_size: int, capacity: int) -> Iterator[FingerprintIndex]:
    """An index of its own for one Hypothesis example (function fixtures outlive examples)."""
    idx = FingerprintIndex.open(f"kvbt_{uuid.uuid4().hex[:10]}", chunk_size, capacity)
    try:
        yield idx
    finally:
        idx.unlink()
        idx.close()


TOKENS = st.one_of(st.lists(st.integers(0, 3), max_size=300),           # repeats and overlaps
                   st.lists(st.integers(0, 2**32 - 1), max_size=300))   # the whole token range


def probe_against_reference(t: np.ndarray, k: int, stored: np.ndarray, other: set[int]) -> None:
    """Entries keyed by the slow reference hash of the windows ``stored`` picks (plus keys of no
    window) are proposed at exactly the windows whose reference key they carry, whatever
    ``chunk_fingerprints`` computes: the probe rolls its own hash over the query."""
    values = t.tolist()
    ref = [ref_hash(values[p:p + k]) ^ NS.id for p in range(len(values) - k + 1)]
    keyset = {key for key, keep in zip(ref, stored) if keep} | other
    keys = np.array(sorted(keyset), np.uint64)
    n = len(keys)
    words = np.arange(2 * n, dtype=np.uint64).reshape(n, 2)
    with scratch_index(k, max(n, 1)) as idx:
        idx.register_prepared(F.Registration(keys, words, words + np.uint64(1 << 40),
                                             np.zeros(n, np.int64), np.arange(n)))
        pos, rows = idx._candidates(t, np.uint64(NS.id))
    got = sorted((int(p), int(r[Entry.KEY])) for p, r in zip(pos, rows))
    assert got == sorted((p, key) for p, key in enumerate(ref) if key in keyset)


@settings(max_examples=60, deadline=None)
@given(values=TOKENS, k=st.integers(1, 40), data=st.data())
def test_probe_keys_match_reference_hypothesis(values: list[int], k: int,
                                               data: st.DataObject) -> None:
    windows = max(len(values) - k + 1, 0)
    stored = data.draw(st.lists(st.booleans(), min_size=windows, max_size=windows))
    other = data.draw(st.sets(st.integers(0, M64), max_size=4))
    probe_against_reference(np.array(values, np.uint32), k, np.array(stored, bool), other)


@pytest.mark.parametrize("seed", range(4))
def test_probe_keys_match_reference_on_long_queries(seed: int) -> None:
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 300))
    t = toks(int(rng.integers(k, 4000)), seed, 1 << 32 if seed % 2 else 50)
    stored = rng.random(len(t) - k + 1) < 0.2
    probe_against_reference(t, k, stored, {int(x) for x in rng.integers(0, 2**63, 8)})


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 24), st.integers(0, 2), st.integers(0, 3)), max_size=9),
       st.integers(1, 5))
def test_best_cover_is_optimal(cands: list[tuple[int, int, int]], k: int) -> None:
    cands = sorted(cands)
    cur = [c[0] for c in cands]
    seq = [c[1] for c in cands]
    old = [c[2] * k for c in cands]
    chosen = cover.best_cover(np.array(cur, np.int64), np.array(seq, np.int64),
                          np.array(old, np.int64), k).tolist()
    assert chosen == sorted(chosen)
    assert all(cur[b] >= cur[a] + k for a, b in zip(chosen, chosen[1:]))
    adj = sum(cur[b] == cur[a] + k and seq[b] == seq[a] and old[b] == old[a] + k
              for a, b in zip(chosen, chosen[1:]))
    assert (len(chosen), adj) == ref_best(cur, seq, old, k)


@pytest.mark.parametrize("seed", range(4))
def test_every_occurrence_matches_reference(make: Make, seed: int) -> None:
    rng = np.random.default_rng(seed)
    idx = make(chunk_size=3)
    vocab = 4  # a tiny vocabulary: many repeats, overlaps and shared windows
    stored = [toks(int(rng.integers(3, 13)), seed * 10 + i, vocab) for i in range(4)]
    for s in stored:
        reg(idx, s)
    query = toks(60, seed + 100, vocab)
    pos, rows = idx._candidates(query, np.uint64(NS.id))
    pos, rows = probe.verified(NS.root, query, 3, pos, rows)
    got = {(int(p), int(r[Entry.STATE] >> np.uint64(32))) for p, r in zip(pos, rows)}
    # with content dedup the entry keeps the position of the latest registration of that content
    want = ref_candidates(stored, query, 3)
    assert {p for p, _ in got} == {p for p, _ in want}
    assert got <= want
    matches = idx.match(NS, query)
    greedy, end = 0, -1
    for p in sorted({p for p, _ in want}):
        if p >= end:
            greedy, end = greedy + 1, p + 3
    assert len(matches) == greedy
    for m in matches:
        assert np.array_equal(query[m.cur_st:m.cur_ed], _chunk_of(stored, m.chunk_hash, 3))


def _chunk_of(stored: list[np.ndarray], h: bytes, k: int) -> np.ndarray:
    for s in stored:
        for i, key in enumerate(chunk_hashes(NS, s, k)):
            if key == h:
                return s[i * k:(i + 1) * k]
    raise AssertionError("match names a chunk hash that was never registered")


# -- behaviour table -----------------------------------------------------------------------------


def test_empty_index_finds_nothing(make: Make) -> None:
    assert make().match(NS, toks(50, 0)) == []


def test_query_shorter_than_a_chunk_finds_nothing(make: Make) -> None:
    idx = make()
    doc = toks(8, 1)
    reg(idx, doc)
    assert idx.match(NS, doc[:3]) == []
    assert idx.match(NS, []) == []


def test_chunk_registered_alone_is_found_at_zero(make: Make) -> None:
    idx = make()
    doc = toks(4, 2)
    (h,) = reg(idx, doc)
    assert idx.match(NS, doc) == [Match(0, 4, 0, 4, h)]


def test_chunk_found_inside_other_tokens(make: Make) -> None:
    idx = make()
    doc = toks(4, 3, 90)
    (h,) = reg(idx, doc)
    query = [100, 200, *doc.tolist(), 300]
    assert idx.match(NS, query) == [Match(0, 4, 2, 6, h)]


def test_second_chunk_found_at_unaligned_offset(make: Make) -> None:
    idx = make()
    doc = toks(8, 4, 1000)
    hashes = reg(idx, doc)
    query = [5000, 5001, 5002, *doc[4:].tolist(), 5003]
    assert idx.match(NS, query) == [Match(C, 2 * C, 3, 3 + C, hashes[1])]


def test_disjoint_query_finds_nothing(make: Make) -> None:
    idx = make()
    reg(idx, toks(40, 5, 1000))
    assert idx.match(NS, toks(200, 6, 1000) + 1000) == []


def test_other_namespace_finds_nothing(make: Make) -> None:
    idx = make()
    doc = toks(8, 7)
    reg(idx, doc)
    assert idx.match(Namespace("other"), doc) == []
    assert len(idx.match(NS, doc)) == 2


def test_remove_one_all_and_unknown(make: Make) -> None:
    idx = make()
    doc = toks(12, 8)
    hashes = reg(idx, doc)
    assert idx.remove([hashes[1]]) == 1
    assert spans(idx.match(NS, doc)) == [(0, 4, 0, 4), (8, 12, 8, 12)]
    assert idx.remove([b"\x00" * 16]) == 0
    assert idx.remove([]) == 0
    assert idx.remove(hashes) == 2
    assert len(idx) == 0 and idx.match(NS, doc) == []


def test_reregister_after_removal(make: Make) -> None:
    idx = make()
    doc = toks(8, 9)
    hashes = reg(idx, doc)
    idx.remove(hashes)
    assert idx.register(NS, doc, hashes) == RegisterResult(2, [])
    assert [m.chunk_hash for m in idx.match(NS, doc)] == hashes


def test_contains(make: Make) -> None:
    idx = make()
    hashes = reg(idx, toks(8, 10))
    assert idx.contains(hashes[0]) and idx.contains(hashes[1])
    assert not idx.contains(b"\x01" * 16)
    idx.remove(hashes[:1])
    assert not idx.contains(hashes[0])


def test_document_quoted_twice_is_found_twice(make: Make) -> None:
    idx = make()
    doc = toks(8, 11, 1000)
    hashes = reg(idx, doc)
    query = np.concatenate([doc, [7777], doc]).astype(np.uint32)
    got = idx.match(NS, query)
    assert spans(got) == [(0, 4, 0, 4), (4, 8, 4, 8), (0, 4, 9, 13), (4, 8, 13, 17)]
    assert [m.chunk_hash for m in got] == hashes * 2


def test_register_rejects_wrong_hash_count_and_size(make: Make) -> None:
    idx = make()
    with pytest.raises(ValueError):
        idx.register(NS, toks(8, 12), [b"\x00" * 16])
    with pytest.raises(ValueError):
        idx.register(NS, toks(4, 12), [b"\x00" * 8])
    assert idx.register(NS, toks(3, 12), []) == RegisterResult(0, [])


# -- cover rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize("run_first", [True, False])
def test_cover_prefers_a_consecutive_run(make: Make, run_first: bool) -> None:
    # query q: A = q[0:4], B = q[4:8] and D = q[2:6], E = q[6:10] give two covers of 8 tokens
    idx = make()
    q = toks(10, 13)
    singles = [q[2:6], q[6:10]] if run_first else [q[0:4], q[4:8]]
    run = q[0:8] if run_first else q[2:10]
    for s in singles:
        reg(idx, s)
    reg(idx, run)
    got = idx.match(NS, q)
    want = [(0, 4, 0, 4), (4, 8, 4, 8)] if run_first else [(0, 4, 2, 6), (4, 8, 6, 10)]
    assert spans(got) == want


def test_cover_maximizes_covered_tokens(make: Make) -> None:
    # candidates at 0, 2, 4: the cover {0, 4} beats the single overlapping one at 2
    idx = make()
    q = toks(8, 14)
    reg(idx, q[2:6])
    reg(idx, q[0:4])
    reg(idx, q[4:8])
    assert [m.cur_st for m in idx.match(NS, q)] == [0, 4]


# -- content dedup -------------------------------------------------------------------------------


def test_same_content_gets_one_entry(make: Make) -> None:
    idx = make()
    doc = toks(8, 15)
    first = reg(idx, doc)
    assert idx.register(NS, doc, first) == RegisterResult(0, [])
    assert len(idx) == 2
    # the same document behind a one-chunk prefix: chunk keys differ, content is the same
    behind = np.concatenate([toks(4, 16), doc]).astype(np.uint32)
    second = chunk_hashes(NS, behind, C)
    assert idx.register(NS, behind, second) == RegisterResult(1, [])
    assert len(idx) == 3
    got = idx.match(NS, doc)
    assert [m.chunk_hash for m in got] == second[1:]  # re-pointed to the latest copy
    assert spans(got) == [(4, 8, 0, 4), (8, 12, 4, 8)]
    assert not idx.contains(first[0]) and idx.contains(second[1])


def test_chunk_repeated_inside_one_sequence_gets_one_entry(make: Make) -> None:
    idx = make()
    a = toks(4, 17)
    doc = np.concatenate([a, toks(4, 18), a]).astype(np.uint32)
    assert idx.register(NS, doc, chunk_hashes(NS, doc, C)) == RegisterResult(2, [])
    assert [m.old_st for m in idx.match(NS, a)] == [0]


# -- adversarial collisions ----------------------------------------------------------------------


def thue_morse(n: int) -> np.ndarray:
    return np.array([bin(i).count("1") & 1 for i in range(n)], np.uint32)


def test_thue_morse_pair_collides_but_never_matches(make: Make) -> None:
    k = 1024
    t = thue_morse(k)
    x = (1000 + 7 * t).astype(np.uint32)
    y = (1000 + 7 * (1 - t)).astype(np.uint32)
    assert not np.array_equal(x, y)
    assert ref_hash(x.tolist()) == ref_hash(y.tolist())  # a real 64-bit collision
    assert probe.chunk_fingerprints(x, k)[0] == probe.chunk_fingerprints(y, k)[0]
    idx = make(chunk_size=k, capacity=16)
    (hx,) = reg(idx, x)
    pos, _ = idx._candidates(y, np.uint64(NS.id))
    assert pos.tolist() == [0]  # the probe proposes it ...
    assert idx.match(NS, y) == []  # ... and verification rejects it
    (hy,) = reg(idx, y)
    assert len(idx) == 2  # equal fingerprints, both stay findable
    both = np.concatenate([y, x]).astype(np.uint32)
    assert [(m.cur_st, m.chunk_hash) for m in idx.match(NS, both)] == [(0, hy), (k, hx)]
    idx.remove([hy])
    assert idx.match(NS, y) == [] and idx.match(NS, x) == [Match(0, k, 0, k, hx)]


def low44_pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Two chunk-256 windows whose rolling hashes agree in the low 44 bits only.

    H is linear in the tokens: changing token 255 by d1 and token 254 by d2 moves H by
    d1 + d2*B; pick d2 so that d2*B mod 2^44 lies within 2^30 of 0 and cancel it with d1.
    """
    mod = 1 << 44
    d2s = np.arange(1, 1 << 22, dtype=np.uint64)
    r = (d2s * np.uint64(probe.BASE)) & np.uint64(mod - 1)
    ok = np.nonzero((r < (1 << 30)) | (r > mod - (1 << 30)))[0]
    d2 = int(d2s[ok[seed]])
    rem = (d2 * probe.BASE) % mod
    d1 = -rem if rem < (1 << 30) else mod - rem
    x = toks(256, seed, 1 << 31).astype(np.int64) + (1 << 30)
    y = x.copy()
    y[255] += d1
    y[254] += d2
    return x.astype(np.uint32), y.astype(np.uint32)


def test_pairs_equal_in_low_44_bits_never_match(make: Make) -> None:
    idx = make(chunk_size=256, capacity=64)
    pairs = [low44_pair(s) for s in range(3)]
    for x, y in pairs:
        hx, hy = ref_hash(x.tolist()), ref_hash(y.tolist())
        assert hx & ((1 << 44) - 1) == hy & ((1 << 44) - 1) and hx != hy
        reg(idx, x)
    for x, y in pairs:
        assert idx.match(NS, y) == []
        assert len(idx.match(NS, x)) == 1
    for _, y in pairs:
        reg(idx, y)
    assert len(idx) == 6
    for x, y in pairs:
        assert len(idx.match(NS, np.concatenate([x, y]).astype(np.uint32))) == 2


# -- capacity, ids, staleness --------------------------------------------------------------------


def test_capacity_is_live_entries_and_ids_are_reused(make: Make) -> None:
    idx = make(capacity=4)
    doc = toks(16, 19)
    hashes = reg(idx, doc)
    assert len(idx) == 4 and idx.stats()["capacity"] == 4
    more = toks(8, 20)
    assert idx.register(NS, more, chunk_hashes(NS, more, C)) == RegisterResult(0, [0, 1])
    assert len(idx) == 4 and len(idx.match(NS, doc)) == 4 and idx.match(NS, more) == []
    for i in range(50):  # far more registrations than capacity: ids come back
        idx.remove([hashes[i % 4]])
        new = toks(4, 100 + i)
        hashes[i % 4] = reg(idx, new)[0]
        assert len(idx) == 4 and idx.match(NS, new)[0].chunk_hash == hashes[i % 4]
    assert int(idx._hdr[FpHdr.HIGH]) == 4


def test_capacity_16m_fits_in_about_94_bytes_per_entry() -> None:
    n = 16 << 20
    assert fpformat.segment_bytes(n) <= 94 * n + fpformat.HEADER_BYTES + 64
    with pytest.raises(ValueError):
        fpformat.segment_bytes(0)


def test_stale_entries_are_dropped_and_live_ones_kept(make: Make) -> None:
    idx = make()
    doc = toks(12, 21)
    hashes = reg(idx, doc)
    asked: list[list[bytes]] = []

    def is_live(hs: list[bytes]) -> list[bool]:
        asked.append(hs)
        return [h != hashes[1] for h in hs]

    got = idx.match(NS, doc, is_live=is_live)
    assert [m.chunk_hash for m in got] == [hashes[0], hashes[2]]
    assert sorted(asked[0]) == sorted(hashes)
    assert len(idx) == 2 and not idx.contains(hashes[1])
    assert idx.match(NS, doc, is_live=lambda hs: [True] * len(hs)) == got
    assert len(idx) == 2


def test_stale_removal_spares_an_entry_registered_meanwhile(make: Make) -> None:
    idx = make()
    doc = toks(4, 22)
    (h,) = reg(idx, doc)
    pos, rows = idx._candidates(doc, np.uint64(NS.id))
    idx.register(NS, doc, [h])  # stored again after the store said it was gone
    idx._drop_stale(pos, rows, lambda hs: [False] * len(hs))
    assert idx.contains(h) and len(idx.match(NS, doc)) == 1


def test_filter_rebuild_after_many_removals(make: Make) -> None:
    idx = make(capacity=16)
    for i in range(200):
        doc = toks(8, 1000 + i)
        hashes = reg(idx, doc)
        assert len(idx.match(NS, doc)) == 2
        idx.remove(hashes)
    assert len(idx) == 0 and int(idx._hdr[FpHdr.STALE]) <= 16 // 4 + 64


# -- repair, attach, processes -------------------------------------------------------------------


def test_dirty_flag_rebuilds_derived_state(make: Make) -> None:
    idx = make(capacity=32)
    docs = [toks(8, 30 + i) for i in range(5)]
    hashes = [reg(idx, d) for d in docs]
    idx.remove(hashes[0])
    # a holder died mid-update: tables and counters wrong, and an entry written without its state
    idx._fpt[:] = 0
    idx._idt[: len(idx._idt) // 2] = 0
    idx._bloom[:] = 0
    idx._hdr[[FpHdr.LIVE, FpHdr.FREE_TOP]] = (999, 0)
    high = int(idx._hdr[FpHdr.HIGH])
    idx._E[high, Entry.KEY] = 12345
    idx._hdr[FpHdr.HIGH] = high + 1
    idx._hdr[FpHdr.DIRTY] = 1
    assert len(idx.match(NS, docs[1])) == 2  # the next holder repairs first
    assert int(idx._hdr[FpHdr.DIRTY]) == 0
    assert len(idx) == 8
    assert all(idx.contains(h) for hs in hashes[1:] for h in hs)
    assert idx.remove(hashes[2]) == 2 and len(idx) == 6
    fresh = [toks(4, 60 + i) for i in range(3)]  # the freed ids and the half-written one
    for f in fresh:
        reg(idx, f)
    assert int(idx._hdr[FpHdr.HIGH]) == high + 1
    assert all(len(idx.match(NS, f)) == 1 for f in fresh)


def test_attach_sees_the_same_entries_and_checks_layout(make: Make) -> None:
    idx = make(capacity=64)
    doc = toks(8, 40)
    reg(idx, doc)
    again = make(capacity=64, prefix=idx.prefix)
    assert len(again) == 2 and len(again.match(NS, doc)) == 2
    with pytest.raises(LayoutMismatch, match="chunk_size"):
        FingerprintIndex.open(idx.prefix, C + 1, 64)
    with pytest.raises(LayoutMismatch):
        FingerprintIndex.open(idx.prefix, C, 128)
    wiped = make(capacity=128, prefix=idx.prefix, wipe=True)
    assert len(wiped) == 0 and wiped.stats()["capacity"] == 128
    wiped.clear()
    assert len(wiped) == 0


def test_create_attach_open_share_one_surface(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        FingerprintIndex.attach(shm_prefix)
    made = FingerprintIndex.create(shm_prefix, C, 64)
    try:
        reg(made, toks(8, 42))
        with pytest.raises(FileExistsError):
            FingerprintIndex.create(shm_prefix, C, 64)
        with FingerprintIndex.attach(shm_prefix) as seen:  # geometry from the header
            assert (seen.chunk_size, seen.capacity, len(seen)) == (C, 64, 2)
        with FingerprintIndex.attach(shm_prefix, C) as seen:  # the reader's chunk size agrees
            assert seen.chunk_size == C
        with pytest.raises(LayoutMismatch, match=f"chunks of {C} tokens, its reader was started "
                                                 f"for {2 * C}"):
            FingerprintIndex.attach(shm_prefix, 2 * C)
        with FingerprintIndex.open(shm_prefix, C, 64) as opened:
            assert len(opened) == 2
        made._hdr[FpHdr.VERSION] += 1
        with pytest.raises(LayoutMismatch, match="version"):
            FingerprintIndex.attach(shm_prefix)
        with pytest.raises(LayoutMismatch, match="version"):
            FingerprintIndex.open(shm_prefix, C, 64)
    finally:
        made.close()


@pytest.mark.parametrize("how", ["create", "open"])
@pytest.mark.parametrize("size", [0, fpformat.segment_bytes(16)])
def test_an_unfinished_index_is_replaced(shm_prefix: str, how: str, size: int) -> None:
    """A creator killed before sizing the segment, or before writing the magic word, leaves a
    segment nobody attaches."""
    import posix_ipc

    from kvblend.shm.names import Names
    posix_ipc.SharedMemory("/" + Names(shm_prefix).fp, posix_ipc.O_CREX, mode=0o600,
                           size=size).close_fd()
    with pytest.raises(FileNotFoundError, match="never finished"):
        FingerprintIndex.attach(shm_prefix)
    with getattr(FingerprintIndex, how)(shm_prefix, C, 64) as idx:
        reg(idx, toks(8, 43))
        assert (idx.capacity, len(idx)) == (64, 2)
    with FingerprintIndex.attach(shm_prefix) as idx:
        assert len(idx) == 2


def test_clear_drops_everything(make: Make) -> None:
    idx = make()
    doc = toks(8, 41)
    hashes = reg(idx, doc)
    idx.clear()
    assert len(idx) == 0 and idx.match(NS, doc) == [] and not idx.contains(hashes[0])
    assert idx.register(NS, doc, hashes) == RegisterResult(2, [])


def _worker(prefix: str, seed: int, n_docs: int, errors: mp.Queue) -> None:
    try:
        with FingerprintIndex.open(prefix, C, 1024) as idx:
            for i in range(n_docs):
                doc = toks(12, seed * 1000 + i)
                hashes = reg(idx, doc)
                got = idx.match(NS, doc)
                assert [m.chunk_hash for m in got] == hashes, (seed, i)
        errors.put(None)
    except BaseException as exc:  # reported to the parent, which fails the test
        errors.put(repr(exc))


@pytest.mark.slow
def test_processes_register_and_match_concurrently(make: Make) -> None:
    idx = make(capacity=1024)
    ctx = mp.get_context("spawn")
    errors: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(idx.prefix, s, 25, errors)) for s in range(3)]
    for p in procs:
        p.start()
    results = [errors.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert results == [None] * 3
    assert len(idx) == 3 * 25 * 3
    for s in range(3):
        for i in range(25):
            doc = toks(12, s * 1000 + i)
            assert [m.chunk_hash for m in idx.match(NS, doc)] == chunk_hashes(NS, doc, C)


KILLED_WRITER = """
import sys
import numpy as np
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
ns = Namespace("test-model")
idx = FingerprintIndex.open(sys.argv[1], 4, 4096)
rng = np.random.default_rng(7)
while True:
    doc = rng.integers(0, 2**32, 64 * 4, dtype=np.uint64).astype(np.uint32)
    hashes = chunk_hashes(ns, doc, 4)
    if len(idx) > 3000:
        idx.clear()
    idx.register(ns, doc, hashes)
    idx.match(ns, doc)
    idx.remove(hashes[::3])
"""


@pytest.mark.slow
def test_writer_killed_with_sigkill_leaves_a_consistent_index(make: Make) -> None:
    idx = make(capacity=4096)
    repo = Path(__file__).resolve().parents[2]
    child = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, idx.prefix], cwd=repo)
    try:
        def progressed() -> bool:
            assert child.poll() is None, "writer exited early"
            return len(idx) >= 500
        # polled often: the kill is meant to fall while the writer is still writing
        poll(progressed, 60, "the writer's progress", every_s=0.001)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    doc = toks(8, 99)
    hashes = reg(idx, doc)  # repairs first when the writer died inside the lock
    assert int(idx._hdr[FpHdr.DIRTY]) == 0
    live = [e for e in range(int(idx._hdr[FpHdr.HIGH]))
            if int(idx._E[e, Entry.STATE]) & 0xFFFFFFFF == fpformat.LIVE]
    assert len(idx) == len(live)
    assert len(live) + int(idx._hdr[FpHdr.FREE_TOP]) == int(idx._hdr[FpHdr.HIGH])
    for e in live:
        assert idx.contains(idx._E[e, Entry.HASH0:Entry.HASH1 + 1].tobytes())
    assert [m.chunk_hash for m in idx.match(NS, doc)] == hashes


# -- stateful: the real index against a dictionary model -----------------------------------------

SMALL = st.lists(st.integers(0, 2), min_size=0, max_size=10)


MACHINE_CAPACITY = 5  # of the 9 contents of 2 tokens over 3: the index is often full


class IndexMachine(RuleBasedStateMachine):
    """Chunk size 2 over a 3-token vocabulary: contents repeat, collide, re-register and overflow
    the capacity often."""

    def __init__(self) -> None:
        super().__init__()
        self.idx = FingerprintIndex.open(f"kvbt_{uuid.uuid4().hex[:8]}", 2, MACHINE_CAPACITY)
        self.model: dict[bytes, tuple[bytes, int]] = {}  # content -> (chunk_hash, old_st)

    def teardown(self) -> None:
        self.idx.unlink()
        self.idx.close()

    @rule(doc=SMALL)
    def register(self, doc: list[int]) -> None:
        arr = np.array(doc, np.uint32)
        hashes = chunk_hashes(NS, arr, 2)
        first: dict[bytes, int] = {}
        for i in range(len(hashes)):
            first.setdefault(arr[2 * i:2 * i + 2].tobytes(), i)
        new, left_out = 0, set()
        for c, i in first.items():  # in order: re-point, else take a free entry, else left out
            if c in self.model or len(self.model) < MACHINE_CAPACITY:
                new += c not in self.model
                self.model[c] = (hashes[i], 2 * i)
            else:
                left_out.add(c)
        not_indexed = [i for i in range(len(hashes)) if arr[2 * i:2 * i + 2].tobytes() in left_out]
        assert self.idx.register(NS, arr, hashes) == RegisterResult(new, not_indexed)

    @rule(doc=SMALL, take=st.integers(0, 3), as_words=st.booleans())
    def remove(self, doc: list[int], take: int, as_words: bool) -> None:
        hashes = chunk_hashes(NS, np.array(doc, np.uint32), 2)[:take]
        gone = [c for c, (h, _) in self.model.items() if h in hashes]
        words = np.frombuffer(b"".join(hashes), "<i8").reshape(-1, 2)  # K0, K1 of store keys
        assert self.idx.remove(words if as_words else hashes) == len(gone)
        for c in gone:
            del self.model[c]

    @rule(query=st.lists(st.integers(0, 2), min_size=0, max_size=16))
    def match(self, query: list[int]) -> None:
        q = np.array(query, np.uint32)
        got = self.idx.match(NS, q)
        for m in got:
            assert self.model[q[m.cur_st:m.cur_ed].tobytes()] == (m.chunk_hash, m.old_st)
        count, end = 0, -1
        for p in range(len(q) - 1):
            if q[p:p + 2].tobytes() in self.model and p >= end:
                count, end = count + 1, p + 2
        assert len(got) == count

    @invariant()
    def sizes_agree(self) -> None:
        assert len(self.idx) == len(self.model)
        for h, _ in self.model.values():
            assert self.idx.contains(h)


IndexMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=25, deadline=None)
test_index_against_model = IndexMachine.TestCase


def test_filter_in_use_grows_with_live_entries_and_keeps_every_chunk(make: Make) -> None:
    idx = make(capacity=1 << 16)
    reserved = len(idx._bloom)                          # 16384 words (128 KiB)
    assert len(idx._filter()) == fpformat.MIN_FILTER_WORDS < reserved
    docs = [toks(C * 1024, seed) for seed in range(48)]  # up to 49152 entries
    sizes = []
    for d in docs:
        reg(idx, d)
        words = len(idx._filter())
        assert words * 64 >= 16 * len(idx), (len(idx), words)  # >= 16 bits per live entry
        sizes.append(words)
    assert sizes[:4] == [fpformat.MIN_FILTER_WORDS] * 4         # 4096 entries: still the 32 KiB minimum
    assert sorted(set(sizes)) == [fpformat.MIN_FILTER_WORDS, 2 * fpformat.MIN_FILTER_WORDS, reserved]
    assert sizes == sorted(sizes)
    for d in docs[::7]:                                 # everything stays findable
        assert len(idx.match(NS, d)) == 1024
    idx.clear()
    assert len(idx._filter()) == fpformat.MIN_FILTER_WORDS and idx.match(NS, docs[0]) == []


def test_filter_size_follows_live_entries_after_repair(make: Make) -> None:
    idx = make(capacity=1 << 16)
    docs = [toks(C * 1024, seed) for seed in range(20)]  # 20480 entries: 5120 words needed
    for d in docs:
        reg(idx, d)
    assert len(idx._filter()) == 8192
    idx._hdr[FpHdr.FILTER_WORDS] = fpformat.MIN_FILTER_WORDS      # as if a holder died mid-resize
    idx._hdr[FpHdr.DIRTY] = 1
    assert len(idx.match(NS, docs[3])) == 1024           # repair ran first: nothing missed
    assert len(idx._filter()) == 8192


def test_prepare_then_register_prepared_is_register(make: Make) -> None:
    idx = make()
    doc = toks(C * 6, 77)
    hashes = chunk_hashes(NS, doc, C)
    prepared = idx.prepare(NS, doc, hashes)      # no lock held: the index is unchanged
    assert len(idx) == 0 and len(prepared.keys) == 6
    assert idx.register_prepared(prepared) == RegisterResult(6, [])
    assert [m.cur_st for m in idx.match(NS, doc)] == [C * i for i in range(6)]
    assert idx.register_prepared(idx.prepare(NS, doc, hashes)) == RegisterResult(0, [])  # dedup
