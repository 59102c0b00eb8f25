"""The table of remote-known chunks: the real table against a dictionary model (Hypothesis), making
room, another process, a writer killed inside its critical section, names, both read paths."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import uuid
from collections.abc import Iterator

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvblend.shm import remotes
from kvblend.shm.errors import Busy, LayoutMismatch
from kvblend.shm.lock import FileLock
from kvblend.shm.names import Names, destroy
from kvblend.shm.private import shm_path
from kvblend.shm.remotes import HEADER_BYTES, RemoteChunks, RemoteHdr, Slot
from kvblend.shm.segment import Segment
from tests.harness import assert_drawing_is_declaration

CAP = 64
T0 = 1_000_000  # ms: a clock far from 0 (EXPIRES 0 marks a free slot)
# the model's clock moves in ticks; an expiry is a tick plus a serial number below TICK, so no two
# are equal and the soonest to expire are one set, in the model as in the table
TICK = 1 << 20
BOTH = pytest.mark.parametrize("lock_free", [True, False], ids=["lock-free", "locked"])

Key = tuple[bytes, int]
Value = tuple[int, int, int]  # expires_ms, pos0, origin


def hashes(n: int, seed: int) -> list[bytes]:
    return [bytes(h) for h in np.random.default_rng(seed).integers(0, 256, (n, 16), np.uint8)]


def words(hs: list[bytes]) -> np.ndarray:
    return np.frombuffer(b"".join(hs), np.int64).reshape(-1, 2).copy()


def header(rc: RemoteChunks) -> np.ndarray:
    with Segment(rc.name) as seg:
        return np.frombuffer(seg.buf, np.int64, HEADER_BYTES // 8).copy()


def occupied(rc: RemoteChunks) -> int:
    """Slots whose EXPIRES is set, counted in the segment itself."""
    with Segment(rc.name) as seg:
        slots = np.frombuffer(seg.buf, np.int64, offset=HEADER_BYTES).reshape(-1, 6)
        return int((slots[:, Slot.EXPIRES] != 0).sum())


@pytest.fixture
def table(shm_prefix: str) -> Iterator[RemoteChunks]:
    with RemoteChunks.open(shm_prefix, CAP) as rc:
        yield rc


# -- the layout is one fact ------------------------------------------------------------------------


def test_the_drawing_is_the_declaration(table: RemoteChunks) -> None:
    assert_drawing_is_declaration(remotes, "Remote header", RemoteHdr)
    assert_drawing_is_declaration(remotes, "Slot (", Slot)
    h = header(table)
    assert (h[RemoteHdr.MAGIC], h[RemoteHdr.VERSION]) == (remotes.MAGIC, remotes.VERSION)
    assert (h[RemoteHdr.CAP], h[RemoteHdr.SLOTS]) == (CAP, 2 * CAP)
    assert not h[len(RemoteHdr):].any()
    with Segment(table.name) as seg:
        assert seg.size == remotes.segment_bytes(CAP) == HEADER_BYTES + 2 * CAP * 48


# -- the model -------------------------------------------------------------------------------------


class Model:
    """What the table must answer: a dict, and the rule for making room spelled out plainly."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.held: dict[Key, Value] = {}
        self.reclaimed = self.dropped = 0

    def put(self, rows: list[tuple[bytes, int, int, int, int]], now: int) -> int:
        batch: dict[Key, Value] = {}
        for h, rank, exp, pos0, origin in rows:
            batch[(h, rank)] = (exp, pos0, origin)
        new = {k: v for k, v in batch.items() if k not in self.held}
        self.held.update({k: v for k, v in batch.items() if k in self.held})
        if len(self.held) + len(new) > self.capacity:
            kept = {k: v for k, v in self.held.items() if v[0] > now}
            self.reclaimed += len(self.held) - len(kept)
            pool = list(kept.items()) + list(new.items())
            room = self.capacity * 3 // 4
            if len(pool) > room:  # expiries are unique: no tie to break
                pool.sort(key=lambda kv: -kv[1][0])
                self.dropped += len(pool) - room
                pool = pool[:room]
            self.held = dict(pool)
            return sum(k in new for k in self.held)
        self.held.update(new)
        return len(new)

    def live(self, key: Key, now: int) -> bool:
        return key in self.held and self.held[key][0] > now


def check(rc: RemoteChunks, model: Model, universe: list[bytes], now: int, world: int) -> None:
    live = rc.live(universe, world, now)
    assert live.tolist() == [[model.live((h, r), now) for r in range(world)] for h in universe]
    assert rc.knows(words(universe), now, rank=1).tolist() == [model.live((h, 1), now)
                                                               for h in universe]
    pos0, origin = rc.provenance(universe, now)
    want = [model.held[(h, 0)] if model.live((h, 0), now) else (0, -1, -1) for h in universe]
    assert pos0.dtype == np.int64 and origin.dtype == np.int8
    assert pos0.tolist() == [w[1] for w in want] and origin.tolist() == [w[2] for w in want]
    assert len(rc) == len(model.held) == occupied(rc) <= rc.capacity
    assert rc.stats() == {"entries": len(model.held), "capacity": rc.capacity,
                          "reclaimed": model.reclaimed, "dropped": model.dropped}


def universe_of(seed: int) -> list[bytes]:
    """40 hashes, 8 of which share their low word with another (a probe stops on the first word
    alone, then must go on past a slot of another key)."""
    hs = hashes(40, seed)
    for i in range(8):
        hs[i + 8] = hs[i][:8] + hs[i + 8][8:]
    return hs


ROW = st.tuples(st.integers(0, 39), st.integers(0, 2), st.integers(-3, 12), st.integers(0, 1 << 20),
                st.sampled_from([1, 2]))


class RemoteMachine(RuleBasedStateMachine):
    """40 hashes x 3 ranks against a capacity of 64: rebuilds, reclaims and drops happen often."""

    lock_free = True

    def __init__(self) -> None:
        super().__init__()
        self.prefix = f"kvbt_{uuid.uuid4().hex[:10]}"
        self.rc = RemoteChunks.open(self.prefix, CAP, lock_free_reads=self.lock_free)
        self.model = Model(CAP)
        self.universe = universe_of(3)
        self.tick, self.serial = 10, 0

    @rule(rows=st.lists(ROW, max_size=16), as_words=st.booleans())
    def put(self, rows: list[tuple[int, int, int, int, int]], as_words: bool) -> None:
        batch = []
        for i, rank, delta, pos0, origin in rows:
            self.serial += 1
            batch.append((self.universe[i], rank, (self.tick + delta) * TICK + self.serial, pos0,
                          origin))
        hs = [b[0] for b in batch]
        cols = [np.array([b[c] for b in batch], np.int64) for c in range(1, 5)]
        got = self.rc.put(words(hs) if as_words else hs, *cols, now_ms=self.tick * TICK)
        assert got == self.model.put(batch, self.tick * TICK)

    @rule(ticks=st.integers(0, 6))
    def advance(self, ticks: int) -> None:
        self.tick += ticks

    @rule()
    def clear(self) -> None:
        self.rc.clear()
        self.model.held.clear()

    @invariant()
    def agrees(self) -> None:
        check(self.rc, self.model, self.universe, self.tick * TICK, 3)

    def teardown(self) -> None:
        self.rc.unlink()
        self.rc.close()


class LockedRemoteMachine(RemoteMachine):
    lock_free = False


_SETTINGS = settings(max_examples=60, stateful_step_count=30, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestRemoteLockFree = RemoteMachine.TestCase
TestRemoteLockFree.settings = _SETTINGS
TestRemoteLocked = LockedRemoteMachine.TestCase
TestRemoteLocked.settings = _SETTINGS


@BOTH
def test_seeded_random_batches_against_the_model(shm_prefix: str, lock_free: bool) -> None:
    """Large batches (keys repeated inside one), a moving clock, world size 4, absent hashes."""
    rng = np.random.default_rng(11)
    universe = hashes(300, 5)  # hashes 200.. are never put
    model, tick, serial = Model(256), 10, 0
    with RemoteChunks.open(shm_prefix, 256, lock_free_reads=lock_free) as rc:
        for _ in range(40):
            n = int(rng.integers(0, 120))
            idx, ranks = rng.integers(0, 200, n), rng.integers(0, 4, n)
            expires = (tick + rng.integers(-2, 30, n)) * TICK + serial + np.arange(n) + 1
            serial += n
            pos0, origin = rng.integers(0, 4096, n), rng.integers(1, 3, n)
            batch = [(universe[i], int(r), int(e), int(p), int(o))
                     for i, r, e, p, o in zip(idx, ranks, expires, pos0, origin)]
            got = rc.put([b[0] for b in batch], ranks, expires, pos0, origin, now_ms=tick * TICK)
            assert got == model.put(batch, tick * TICK)
            tick += int(rng.integers(0, 4))
            check(rc, model, universe, tick * TICK, 4)


@BOTH
def test_an_entry_is_live_until_the_ms_it_expires(shm_prefix: str, lock_free: bool) -> None:
    hs = hashes(2, 15)
    with RemoteChunks.open(shm_prefix, CAP, lock_free_reads=lock_free) as rc:
        rc.put(hs, [0, 1], [T0, T0 + 1], [11, 12], [1, 2], now_ms=T0)
        assert rc.live(hs, 2, T0 - 1).tolist() == [[True, False], [False, True]]
        assert rc.live(hs, 2, T0).tolist() == [[False, False], [False, True]]
        assert rc.knows(hs, T0 - 1).tolist() == [True, False]
        assert [a.tolist() for a in rc.provenance(hs, T0 - 1)] == [[11, -1], [1, -1]]
        assert [a.tolist() for a in rc.provenance(hs, T0)] == [[-1, -1], [-1, -1]]
        rc.put(hs[:1], 0, T0 + 5, 13, 2)  # the last write wins, even an earlier expiry
        rc.put(hs[:1], 0, T0 + 2, 14, 1)
        assert [a.tolist() for a in rc.provenance(hs, T0 + 1)] == [[14, -1], [1, -1]]
        assert not rc.knows(hs, T0 + 2).any() and len(rc) == 2


# -- making room -----------------------------------------------------------------------------------


def test_expired_entries_are_reclaimed_before_any_is_dropped(table: RemoteChunks) -> None:
    hs = hashes(CAP + 1, 1)
    assert table.put(hs[:CAP], 0, T0 + 1 + np.arange(CAP), 7, 1, now_ms=T0) == CAP
    assert len(table) == CAP == occupied(table)  # full: half the slots
    assert table.put(hs[CAP:], 0, T0 + 10_000, 8, 2, now_ms=T0 + 40) == 1  # 40 have expired
    assert table.stats() == {"entries": CAP - 40 + 1, "capacity": CAP, "reclaimed": 40,
                             "dropped": 0}
    assert table.knows(hs, T0).tolist() == [False] * 40 + [True] * (CAP - 40 + 1)
    assert occupied(table) == len(table)


def test_then_the_soonest_to_expire_are_dropped_down_to_three_quarters(table: RemoteChunks) -> None:
    hs = hashes(CAP + 8, 2)
    expires = T0 + 1000 + np.arange(CAP)[::-1]  # the last ones put expire first
    table.put(hs[:CAP], 0, expires, 0, 1, now_ms=T0)
    assert table.put(hs[CAP:], 0, T0 + 5000, 0, 1, now_ms=T0) == 8
    assert table.stats()["dropped"] == CAP + 8 - CAP * 3 // 4
    assert len(table) == CAP * 3 // 4 == occupied(table)
    kept = table.knows(hs, T0)
    assert kept.tolist() == [True] * (CAP * 3 // 4 - 8) + [False] * (CAP + 8 - CAP * 3 // 4) + \
        [True] * 8
    # an update in place never makes room
    assert table.put(hs[:4], 0, T0 + 9000, 1, 2, now_ms=T0) == 0
    assert table.stats()["dropped"] == CAP + 8 - CAP * 3 // 4


def test_a_put_larger_than_the_table_keeps_its_latest(table: RemoteChunks) -> None:
    hs = hashes(3 * CAP, 3)
    assert table.put(hs, 0, T0 + np.arange(3 * CAP) + 1, 0, 1, now_ms=T0) == CAP * 3 // 4
    assert table.knows(hs, T0).tolist() == [False] * (3 * CAP - CAP * 3 // 4) + [True] * (CAP * 3 // 4)
    assert len(table) == occupied(table) == CAP * 3 // 4


def _same_home(rc: RemoteChunks, n: int, seed: int) -> np.ndarray:
    """``n`` hash words whose (hash, rank 0) probes all start at one slot."""
    rng = np.random.default_rng(seed)
    cand = rng.integers(-(1 << 63), (1 << 63) - 1, (1 << 18, 2), dtype=np.int64)
    keys = np.zeros((len(cand), 3), np.int64)
    keys[:, :2] = cand
    home = rc._home(keys)
    return cand[home == np.bincount(home).argmax()][:n]


@BOTH
def test_long_clusters_are_probed_past_the_first_window(shm_prefix: str, lock_free: bool) -> None:
    with RemoteChunks.open(shm_prefix, 1024, lock_free_reads=lock_free) as rc:
        crowd = _same_home(rc, 150, 4)
        assert len(crowd) >= 100
        held, absent = crowd[: len(crowd) // 2], crowd[len(crowd) // 2:]
        twins = held.copy()
        twins[:, 1] ^= 1  # the first word of a held key: stops a probe, is not its key
        rc.put(held, 0, T0 + 1 + np.arange(len(held)), np.arange(len(held)), 1, now_ms=T0)
        assert rc.knows(held, T0).all()
        assert not rc.knows(absent, T0).any() and not rc.knows(twins, T0).any()
        assert rc.provenance(held, T0)[0].tolist() == list(range(len(held)))
        assert not rc.live(held, 2, T0)[:, 1].any()


# -- processes and crashes -------------------------------------------------------------------------


def _reader_writer(rc: RemoteChunks, probe: list[bytes], mine: list[bytes], out: mp.Queue) -> None:
    try:
        out.put(rc.knows(probe, T0).tolist())
        rc.put(mine, 1, T0 + 500, 3, 2)
        out.put(None)
    except BaseException as exc:  # reported to the parent, which fails the test
        out.put(repr(exc))


@pytest.mark.slow
def test_another_process_sees_what_one_wrote_and_writes_back(table: RemoteChunks) -> None:
    hs = hashes(20, 6)
    table.put(hs[:10], 0, T0 + 100, 5, 1, now_ms=T0)
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    child = ctx.Process(target=_reader_writer, args=(table, hs[:15], hs[15:], out))  # pickled
    child.start()
    answers = [out.get(timeout=120), out.get(timeout=120)]
    child.join(timeout=60)
    assert child.exitcode == 0 and answers == [[True] * 10 + [False] * 5, None]
    assert table.live(hs[15:], 2, T0).tolist() == [[False, True]] * 5
    assert len(table) == 15


def _die_inside(prefix: str) -> None:
    rc = RemoteChunks.attach(prefix)
    with rc._guard(None):
        # a torn table no writer could leave: every slot held, garbage words, some sharing the
        # probed hashes' first word
        rng = np.random.default_rng(9)
        garbage = rng.integers(1, 1 << 62, rc._slots.shape)
        garbage[::3, Slot.HASH0] = int(np.frombuffer(b"".join(hashes(1, 8)), np.int64)[0])
        rc._slots[:] = garbage
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.slow
@BOTH
def test_a_writer_killed_inside_leaves_dirty_and_the_next_holder_empties(
        table: RemoteChunks, lock_free: bool) -> None:
    hs = hashes(12, 8)
    table.put(hs, 0, T0 + 100, 0, 1, now_ms=T0)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_die_inside, args=(table.prefix,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    h = header(table)
    assert h[RemoteHdr.DIRTY] == 1 and h[RemoteHdr.SEQ] % 2 == 1
    # a read that sees the torn table (as a lock-free one may) ends, bounded by the slot count
    keys = np.zeros((len(hs), 3), np.int64)
    keys[:, :2] = words(hs)
    slot, hit, _ = table._probe(keys)
    assert (slot == -1).all() and not hit.any()
    with RemoteChunks.attach(table.prefix, lock_free_reads=lock_free) as rc:
        assert not rc.knows(hs, T0).any()  # SEQ stays odd: the read takes the lock and repairs
        assert header(rc)[RemoteHdr.DIRTY] == 0 and len(rc) == 0 == occupied(rc)
        assert rc.put(hs[:3], 0, T0 + 100, 0, 1, now_ms=T0) == 3
        assert rc.knows(hs, T0).tolist() == [True] * 3 + [False] * 9


@pytest.mark.slow
def test_a_writer_killed_inside_is_repaired_by_the_next_writer(table: RemoteChunks) -> None:
    hs = hashes(4, 8)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_die_inside, args=(table.prefix,))
    child.start()
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL and len(table) == 0  # COUNT was never touched
    assert table.put(hs, 0, T0 + 100, 0, 1, now_ms=T0) == 4
    assert header(table)[RemoteHdr.DIRTY] == 0 and len(table) == 4 == occupied(table)


# -- both read paths -------------------------------------------------------------------------------


def test_lock_free_reads_go_on_while_the_lock_is_held_and_locked_ones_wait(shm_prefix: str) -> None:
    hs = hashes(3, 10)
    with RemoteChunks.open(shm_prefix, CAP, lock_timeout=0, lock_free_reads=True) as free, \
            RemoteChunks.attach(shm_prefix, lock_timeout=0, lock_free_reads=False) as locked:
        free.put(hs, 0, T0 + 5, 0, 1, now_ms=T0)
        other = FileLock(Names(shm_prefix).lock("remote"))  # another open file: excludes us
        other.acquire()
        try:
            assert free.knows(hs, T0).all()
            with pytest.raises(Busy):
                locked.knows(hs, T0)
            with pytest.raises(Busy):
                free.put(hs, 0, T0 + 6, 0, 1)
        finally:
            other.release()
            other.close()
        assert locked.knows(hs, T0).all()


# -- names and lifetime ----------------------------------------------------------------------------


def test_destroy_removes_the_segment_and_its_lock(shm_prefix: str) -> None:
    RemoteChunks.open(shm_prefix, CAP).close()
    names = Names(shm_prefix)
    paths = [shm_path(names.remote), names.lock("remote")]
    assert all(os.path.exists(p) for p in paths)
    assert set(paths) <= set(names.service_paths())
    assert destroy(shm_prefix) == 2
    assert not any(os.path.exists(p) for p in paths)
    with pytest.raises(FileNotFoundError):
        RemoteChunks.attach(shm_prefix)


def test_another_capacity_is_refused_unless_wiped(table: RemoteChunks) -> None:
    hs = hashes(2, 12)
    table.put(hs, 0, T0 + 5, 0, 1, now_ms=T0)
    with pytest.raises(LayoutMismatch):
        RemoteChunks.open(table.prefix, 2 * CAP)
    with RemoteChunks.open(table.prefix, CAP) as same:
        assert same.knows(hs, T0).all()
    with RemoteChunks.open(table.prefix, 2 * CAP, wipe=True) as wiped:
        assert wiped.capacity == 2 * CAP and len(wiped) == 0 and not wiped.knows(hs, T0).any()
    with RemoteChunks.attach(table.prefix) as again:
        assert again.capacity == 2 * CAP


def test_an_unfinished_segment_is_replaced(shm_prefix: str) -> None:
    Segment(Names(shm_prefix).remote, 4096, create=True).close()  # no magic: its creator died
    with pytest.raises(FileNotFoundError):
        RemoteChunks.attach(shm_prefix)
    with RemoteChunks.open(shm_prefix, CAP) as rc:
        assert rc.capacity == CAP and len(rc) == 0


def test_pickles_by_prefix(table: RemoteChunks) -> None:
    hs = hashes(2, 13)
    table.put(hs, 0, T0 + 5, 0, 1, now_ms=T0)
    with pickle.loads(pickle.dumps(table)) as copy:
        assert copy.name == table.name and copy.capacity == CAP and copy.knows(hs, T0).all()


def test_bad_arguments_are_refused(table: RemoteChunks, shm_prefix: str) -> None:
    for capacity in (32, 100, 1 << 31):
        with pytest.raises(ValueError):
            RemoteChunks.open(shm_prefix + "x", capacity)
    hs = hashes(2, 14)
    for ranks, expires in ((-1, T0), (0, 0), ([0, 1, 2], T0)):
        with pytest.raises(ValueError):
            table.put(hs, ranks, expires, 0, 1)
    with pytest.raises(ValueError):
        table.knows([b"short"], T0)
    assert len(table) == 0 and table.put([], 0, T0, 0, 1) == 0
    assert table.live([], 2, T0).shape == (0, 2)
