"""The store/retrieve order of operations in-process, with a recording copy engine: batched
reservations and pins, commits only after their group's copies completed, abort on failure, and
the checks of pinned chunks (tokens, layout class) before anything is copied."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

import kvblend.dataplane.transfer as tr
from kvblend.dataplane.errors import BackendError
from kvblend.dataplane.backend import Direction, InstanceBuffer
from kvblend.dataplane.client_transfer import match_bytes
from kvblend.dataplane.messages import (ChunkFailure, RetrieveChunks, StoreChunks,
                                        StoreKind)
from kvblend.shm.events import EventLog
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.keys import keys_of
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.matches import Match
from kvblend.shm.store import ChunkKey, Store
from tests.dataplane.conftest import CHUNK, create_store

L, D, N = 2, 64, 12


class Recorder(InstanceBuffer):
    """Copies with numpy like the CPU engine, but logs every step; copies 'complete' only at
    ``wait`` (a copy's bytes land in the slab when its marker is waited for)."""

    def __init__(self, layout: KVLayout, store: Store, fail_at: int | None = None,
                 release_at: int | None = None) -> None:
        self.layout, self.store, self.fail_at = layout, store, fail_at
        self.release_at = release_at  # the marker whose wait the lease runs out in
        self.log: list[tuple[Any, ...]] = []
        self.pending: list[int] = []
        self.marks = 0

    def begin(self, engine_event: bytes | None, order: int | None = None) -> None:
        self.log.append(("begin",))

    def copy(self, direction: Direction, token_starts: list[int], chunk_size: int,
             slab_offsets: list[int], layers: tuple[int, int] | None = None) -> None:
        for token_start in token_starts:
            if direction is Direction.TO_SLAB:
                if self.fail_at is not None and token_start // chunk_size == self.fail_at:
                    raise RuntimeError("copy failed")
                self.pending.append(token_start // chunk_size)
            self.log.append(("copy", token_start // chunk_size))

    def mark(self) -> Any:
        self.marks += 1
        self.log.append(("mark", self.marks, tuple(self.pending)))
        return self.marks, tuple(self.pending)

    def wait(self, marker: Any) -> None:
        self.log.append(("wait", marker[0]))
        self.done = set(getattr(self, "done", set())) | set(marker[1])
        if marker[0] == self.release_at:
            self.release()

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        pass


class FakeInst:
    def __init__(self, model: str, class_id: int, layout: KVLayout, buffer: InstanceBuffer
                 ) -> None:
        self.id, self.class_id, self.layout, self.buffer, self.rank = 1, class_id, layout, buffer, 0
        self.request = type("R", (), {"model_name": model, "world_size": 1, "rotary": None})()


@pytest.fixture
def shared(shm_prefix: str) -> Iterator[tr.Shared]:
    create_store(shm_prefix)
    store = Store.open(shm_prefix)
    fp = FingerprintIndex.attach(shm_prefix, CHUNK)
    events = EventLog.open(shm_prefix)
    yield tr.Shared(store, fp, events, CHUNK)
    events.close()
    fp.close()
    store.close()


def make_inst(sh: tr.Shared, model: str = "m", hidden: int = D, fail_at: int | None = None
              ) -> FakeInst:
    layout = KVLayout(L, (N + 1) * CHUNK, hidden, DType.parse("bfloat16"))
    cid = sh.store.register_class(ChunkClass.of(model, 1, layout, CHUNK))
    return FakeInst(model, cid, layout, Recorder(layout, sh.store, fail_at))


def store_msg(tokens: np.ndarray) -> StoreChunks:
    return StoreChunks(instance_id=1, token_ids=tokens.astype("<u4").tobytes(), offset=0,
                       kind=StoreKind.PRE_COMPUTED, cache_salt="", event=None, done_event=None,
                       request_id="r")


CHUNK_BYTES = 2 * L * CHUNK * D * 2


@pytest.fixture
def grouped(shared: tr.Shared) -> tr.Shared:
    """``shared`` batching a first batch of 2 chunks, then groups of 3."""
    return replace(shared, tuning=tr.Tuning(first_bytes=2 * CHUNK_BYTES,
                                            group_bytes=3 * CHUNK_BYTES))


def test_commits_each_group_only_after_its_copies_completed(
        grouped: tr.Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = grouped
    inst = make_inst(shared)
    buf = inst.buffer
    assert isinstance(buf, Recorder)
    commits: list[list[int]] = []
    real_commit = shared.store.commit_slots

    def commit_slots(slots: np.ndarray, keys: np.ndarray) -> None:
        hashes = [k.chunk_hash for k in keys_of(keys)]  # the call's keys are words
        idx = [all_hashes.index(h) for h, s in zip(hashes, slots) if s >= 0]
        assert set(idx) <= buf.done, "a chunk was committed before its copy completed"
        commits.append(idx)
        real_commit(slots, keys)

    monkeypatch.setattr(shared.store, "commit_slots", commit_slots)
    tokens = np.arange(N * CHUNK + 5) + 100
    ns = Namespace("m", 1, "")
    all_hashes = chunk_hashes(ns, tokens, CHUNK)
    done = tr.run_store(shared, inst, store_msg(tokens))  # type: ignore[arg-type]
    assert done.copied == N and done.failed == [] and done.num_chunks == N
    # batches [0, 2), [2, 6), [6, 12) (each twice the one before), each in groups of at most
    # 3: five commits, in order
    assert commits == [[0, 1], [2, 3, 4], [5], [6, 7, 8], [9, 10, 11]]
    assert sum(1 for e in buf.log if e[0] == "mark") == 5
    assert shared.store.contains([ChunkKey(ns.id, h) for h in all_hashes]).all()
    assert shared.store.stats().num_reserved == 0
    # stored again: every chunk exists, nothing copied or committed
    commits.clear()
    again = tr.run_store(shared, inst, store_msg(tokens))  # type: ignore[arg-type]
    assert again.copied == 0 and again.failed == [] and commits == []


def test_a_store_released_in_flight_commits_nothing_after(grouped: tr.Shared) -> None:
    # the instance's lease runs out while its store waits for its second group: that group
    # and every later one may have copied before the engine wrote them, and are not committed
    shared = grouped
    inst = make_inst(shared)
    inst.buffer = Recorder(inst.layout, shared.store, release_at=2)
    tokens = np.arange(N * CHUNK) + 11
    with pytest.raises(BackendError, match="lease ran out"):
        tr.run_store(shared, inst, store_msg(tokens))  # type: ignore[arg-type]
    ns = Namespace("m", 1, "")
    found = shared.store.contains([ChunkKey(ns.id, h) for h in chunk_hashes(ns, tokens, CHUNK)])
    assert found.tolist() == [True, True] + [False] * (N - 2)  # the first group [0, 2) only
    stats = shared.store.stats()
    assert stats.num_reserved == 0 and stats.num_objects == 2


def test_a_failed_copy_aborts_every_reservation(grouped: tr.Shared) -> None:
    shared = grouped
    inst = make_inst(shared, fail_at=7)
    tokens = np.arange(N * CHUNK) + 7
    with pytest.raises(RuntimeError, match="copy failed"):
        tr.run_store(shared, inst, store_msg(tokens))  # type: ignore[arg-type]
    ns = Namespace("m", 1, "")
    keys = [ChunkKey(ns.id, h) for h in chunk_hashes(ns, tokens, CHUNK)]
    assert not shared.store.contains(keys).any()
    stats = shared.store.stats()
    assert stats.num_reserved == 0 and stats.num_objects == 0
    assert isinstance(inst.buffer, Recorder) and inst.buffer.log[-1][0] == "wait"  # drained


def test_a_call_that_fails_first_cleans_up_even_where_its_start_cannot_be_logged(
        grouped: tr.Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    # a call that failed before its first copies logs its start on the way out; a log that
    # fails then must not keep the reservations or the drain from happening first
    shared = grouped
    inst = make_inst(shared, fail_at=0)  # the first copy fails: no start logged before
    tokens = np.arange(4 * CHUNK) + 3
    real = shared.events.record

    def record(event: Any) -> int:
        if type(event).__name__ in ("StoreStart", "RetrieveStart"):
            raise OSError("event log unavailable")
        return real(event)

    monkeypatch.setattr(shared.events, "record", record)
    with pytest.raises(OSError, match="event log unavailable"):
        tr.run_store(shared, inst, store_msg(tokens))  # type: ignore[arg-type]
    stats = shared.store.stats()
    assert stats.num_reserved == 0 and stats.num_objects == 0  # given back all the same
    monkeypatch.setattr(shared.events, "record", real)
    ok = make_inst(shared)
    assert tr.run_store(shared, ok, store_msg(tokens)).copied == 4  # type: ignore[arg-type]
    hashes = chunk_hashes(Namespace("m", 1, ""), tokens, CHUNK)
    buf = ok.buffer
    assert isinstance(buf, Recorder)

    def copy(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("copy failed")

    monkeypatch.setattr(buf, "copy", copy)
    monkeypatch.setattr(shared.events, "record", record)
    buf.log.clear()
    with pytest.raises(OSError, match="event log unavailable"):
        _retrieve(shared, ok, tokens, hashes, [0, CHUNK])
    assert buf.log[-1][0] == "wait"  # drained before the start was tried
    assert shared.store.stats().num_pinned == 0


def _retrieve(sh: tr.Shared, inst: FakeInst, prompt: np.ndarray, hashes: list[bytes],
              at: list[int]) -> Any:
    specs = match_bytes([Match(0, CHUNK, s, s + CHUNK, h) for s, h in zip(at, hashes)])
    msg = RetrieveChunks(instance_id=1, token_ids=prompt.astype("<u4").tobytes(), matches=specs,
                         offset=0, cache_salt="", event=None, done_event=None, request_id="q")
    return tr.run_retrieve(sh, inst, msg)  # type: ignore[arg-type]


def test_retrieve_checks_tokens_and_layout_of_each_pinned_chunk(grouped: tr.Shared) -> None:
    shared = grouped
    inst = make_inst(shared)
    tokens = np.arange(6 * CHUNK) + 1
    assert tr.run_store(shared, inst, store_msg(tokens)).copied == 6  # type: ignore[arg-type]
    ns = Namespace("m", 1, "")
    hashes = chunk_hashes(ns, tokens, CHUNK)
    # a chunk of the same key space stored under another layout class (D differs)
    other = make_inst(shared, model="other", hidden=2 * D)
    foreign = tokens[:CHUNK] + 10**6
    fh = chunk_hashes(ns, foreign, CHUNK)[0]
    res = shared.store.reserve(other.class_id, ChunkKey(ns.id, fh), foreign)
    assert res is not None
    res.commit()
    prompt = np.concatenate([tokens, foreign])
    bad_tokens = prompt.copy()
    bad_tokens[3 * CHUNK + 2] += 1  # the prompt differs from chunk 3's tokens
    absent = b"\x01" * 16
    at = [0, CHUNK, 2 * CHUNK, 3 * CHUNK, 4 * CHUNK, 5 * CHUNK, 6 * CHUNK, 0]
    buf = inst.buffer
    assert isinstance(buf, Recorder)
    buf.log.clear()
    done = _retrieve(shared, inst, bad_tokens, hashes + [fh, absent], at)
    assert done.failed == [3, 6, 7] and done.copied == 5
    assert done.reasons == [ChunkFailure.TOKENS_MISMATCH, ChunkFailure.LAYOUT_MISMATCH,
                            ChunkFailure.MISSING]
    assert [e[1] for e in buf.log if e[0] == "copy"] == [0, 1, 2, 4, 5]  # nothing for the rest
    assert shared.store.stats().num_pinned == 0
    ok = _retrieve(shared, inst, prompt, hashes, at[:6])
    assert ok.failed == [] and ok.copied == 6
    assert shared.store.stats().num_pinned == 0


def test_failed_chunks_say_why(grouped: tr.Shared) -> None:
    shared = grouped
    # a store larger than the whole store: its tail finds every slot reserved by its own head
    big = KVLayout(L, 49 * CHUNK, 15 * 1024, DType.parse("bfloat16"))  # ~1.9 MiB chunks
    cid = shared.store.register_class(ChunkClass.of("big", 1, big, CHUNK))
    inst = FakeInst("big", cid, big, Recorder(big, shared.store))
    done = tr.run_store(shared, inst, store_msg(np.arange(48 * CHUNK) + 5))  # type: ignore[arg-type]
    assert done.failed and done.failed == list(range(48 - len(done.failed), 48))
    assert done.copied == 48 - len(done.failed)
    assert done.reasons == [ChunkFailure.NO_ROOM] * len(done.failed)
    shared.store.clear()
    # a retrieve that finds the pin table full: this process holds every pin it can
    small = make_inst(shared)
    keys: list[ChunkKey] = []
    ns = Namespace("m", 1, "")
    for d in range(2048 // N + 1):
        tokens = np.arange(N * CHUNK) + 10**6 * (d + 1)
        assert tr.run_store(shared, small, store_msg(tokens)).copied == N  # type: ignore[arg-type]
        keys += [ChunkKey(ns.id, h) for h in chunk_hashes(ns, tokens, CHUNK)]
    *held, last = keys
    pinned = shared.store.pin_slots(held[:2048])
    assert (pinned >= 0).all()
    try:
        tokens = np.arange(N * CHUNK) + 10**6 * (2048 // N + 1)
        done = _retrieve(shared, small, tokens, [last.chunk_hash], [(N - 1) * CHUNK])
        assert done.failed == [0] and done.reasons == [ChunkFailure.PINS_FULL]
    finally:
        shared.store.unpin_slots(pinned)
    done = _retrieve(shared, small, tokens, [last.chunk_hash], [(N - 1) * CHUNK])
    assert done.failed == [] and done.reasons == []
