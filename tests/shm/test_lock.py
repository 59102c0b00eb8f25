"""Lock-free reads only where loads keep program order: the platform decision, and both paths of
``Guarded.read_stable`` and of the fingerprint index forced on any host."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvblend.shm import lock as L
from kvblend.shm.errors import Busy
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.lock import FileLock, Guarded
from kvblend.shm.names import Names
from kvblend.shm.private import shm_path

NS = Namespace("ordering-model")


@pytest.mark.parametrize("machine,ordered", [
    ("x86_64", True), ("AMD64", True), ("amd64", True),
    ("aarch64", False), ("arm64", False), ("ARM64", False), ("armv7l", False),
    ("ppc64le", False), ("s390x", False), ("riscv64", False), ("i686", False), ("", False),
])
def test_only_x86_64_reads_without_the_lock(machine: str, ordered: bool) -> None:
    assert L.ordered_loads(machine) is ordered


def test_the_host_decision_is_made_once_from_the_machine() -> None:
    assert L.LOCK_FREE_READS is L.ordered_loads(platform.machine())


class Shared:
    """A guarded counter pair in a real lock file, plus a second opener of the same lock."""

    def __init__(self, prefix: str, lock_free_reads: bool | None) -> None:
        path = shm_path(f"{prefix}_order.lock")
        self.lock = FileLock(path)
        self.other = FileLock(path)  # another open file description: excluded like a process
        self.words = np.zeros(2, np.int64)  # [0] dirty, [1] seq
        self.data = np.zeros(4, np.int64)
        self.guard = Guarded(self.lock, self.words[0:1], lambda: None, self.words[1:2],
                             lock_free_reads=lock_free_reads)

    def close(self) -> None:
        self.lock.close()
        self.other.close()

    def others_can_lock(self) -> bool:
        try:
            self.other.acquire(0)
        except Busy:
            return False
        self.other.release()
        return True


@pytest.fixture
def shared(shm_prefix: str, request: pytest.FixtureRequest) -> Iterator[Shared]:
    s = Shared(shm_prefix, request.param)
    yield s
    s.close()


@pytest.mark.parametrize("shared", [None], indirect=True)
def test_guard_defaults_to_the_host_decision(shared: Shared) -> None:
    assert shared.guard.lock_free_reads is L.LOCK_FREE_READS


@pytest.mark.parametrize("shared", [False], indirect=True)
def test_forced_locked_path_reads_under_the_lock(shared: Shared) -> None:
    shared.data[:] = (1, 2, 3, 4)
    seen: list[tuple[bool, int]] = []

    def read() -> np.ndarray:
        seen.append((shared.others_can_lock(), int(shared.words[1])))
        return shared.data.copy()

    got = shared.guard.read_stable(read)
    assert got.tolist() == [1, 2, 3, 4]
    assert seen == [(False, 1)]            # once, lock held, inside a section (odd counter)
    assert int(shared.words[1]) == 2 and int(shared.words[0]) == 0


@pytest.mark.parametrize("shared", [True], indirect=True)
def test_forced_lock_free_path_takes_no_lock(shared: Shared) -> None:
    shared.data[:] = (5, 6, 7, 8)
    seen: list[bool] = []

    def read() -> np.ndarray:
        seen.append(shared.others_can_lock())
        return shared.data.copy()

    assert shared.guard.read_stable(read).tolist() == [5, 6, 7, 8]
    assert seen == [True] and int(shared.words[1]) == 0


@pytest.mark.parametrize("shared", [False], indirect=True)
def test_locked_path_follows_the_timeout_rule(shared: Shared) -> None:
    shared.other.acquire(0)
    try:
        with pytest.raises(Busy):
            shared.guard.read_stable(lambda: 1, timeout=0)
    finally:
        shared.other.release()
    assert shared.guard.read_stable(lambda: 2, timeout=0) == 2


@pytest.mark.parametrize("shared", [True], indirect=True)
def test_lock_free_path_falls_back_to_the_lock_while_a_holder_is_inside(shared: Shared) -> None:
    shared.words[1] = 7  # odd: a holder is inside (or died inside)
    calls: list[bool] = []

    def read() -> int:
        calls.append(shared.others_can_lock())
        return 3

    assert shared.guard.read_stable(read, attempts=4) == 3
    assert calls == [False]  # never read while odd; once under the lock


# the prefix only names two lock files, which every example may share
@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(values=st.lists(st.integers(-2**63, 2**63 - 1), min_size=4, max_size=4),
       writes=st.integers(0, 3))
def test_both_paths_read_the_same_values(shm_prefix: str, values: list[int], writes: int) -> None:
    paths = [Shared(f"{shm_prefix}_{flag}", flag) for flag in (False, True)]
    try:
        results = []
        for s in paths:
            for w in range(writes):  # whole critical sections before the read
                with s.guard():
                    s.data[w] = values[w]
            with s.guard():
                s.data[:] = values
            results.append(s.guard.read_stable(lambda s=s: s.data.copy()).tolist())
        assert results == [values, values]
    finally:
        for s in paths:
            s.close()


# -- the fingerprint index ------------------------------------------------------------------------


def test_fingerprint_match_takes_the_lock_unless_reads_may_skip_it(shm_prefix: str) -> None:
    """The emptiness check in ``match`` is the index's one lock-free read: forced off, even a match
    on an empty index waits for the lock; forced on, it answers without it. Both answer alike."""
    locked = FingerprintIndex.open(shm_prefix, 4, 64, lock_timeout=0, lock_free_reads=False)
    free = FingerprintIndex.open(shm_prefix, 4, 64, lock_timeout=0, lock_free_reads=True)
    holder = FileLock(Names(shm_prefix).lock("fp"))
    try:
        query = np.arange(12, dtype=np.uint32)
        holder.acquire(0)
        try:
            with pytest.raises(Busy):
                locked.match(NS, query)
            assert free.match(NS, query) == []
        finally:
            holder.release()
        doc = np.arange(100, 116, dtype=np.uint32)
        locked.register(NS, doc, chunk_hashes(NS, doc, 4))
        query = np.concatenate([query, doc])
        assert locked.match(NS, query) == free.match(NS, query) and len(free.match(NS, query)) == 4
        assert locked.__reduce__()[1][-1] is False  # a pickled handle keeps the choice
    finally:
        holder.close()
        for idx in (locked, free):
            idx.close()
        locked.unlink()
