"""The shared-memory event log: ring order and wrap-around, counters, several processes, dead
writers, and its create / attach / open surface."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys

import numpy as np
import pytest

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.events import HEADER_WORDS, MAX_MODELS, VERSION, EventLog, EventsHdr
from kvblend.shm.names import Names
from kvblend.shm.segment import Segment
from kvblend.shm.telemetry import COUNTER_NAMES, Counter, LookupEnd, RetrieveEnd, StoreError


def _lookup(i: int, request_id: str | None = None) -> LookupEnd:
    return LookupEnd(request_id=request_id, requested_tokens=i, hit_tokens=0, num_chunks=0,
                     duration_ms=0.5)


def test_record_and_recent_newest_last(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=8) as log:
        for i in range(5):
            log.record(_lookup(i, f"r{i}"))
        events = log.recent(3)
        assert [e["request_id"] for e in events] == ["r2", "r3", "r4"]
        assert [e["seq"] for e in events] == [3, 4, 5]
        assert events[-1]["kind"] == "lookup_end" and events[-1]["pid"] == os.getpid()
        assert events[-1]["requested_tokens"] == 4 and events[-1]["duration_ms"] == 0.5


def test_ring_wraps_and_keeps_capacity_events(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=4) as log:
        for i in range(11):
            log.record(_lookup(i))
        assert [e["requested_tokens"] for e in log.recent()] == [7, 8, 9, 10]
        assert log.head == 11


def test_oversized_event_is_truncated_not_dropped(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=4, slot_bytes=256) as log:
        log.record(RetrieveEnd(request_id="big", instance_id=1, tokens=8000, chunks=500,
                               copied=0, failed=list(range(500)), bytes=0, duration_s=0.0,
                               ok=False))
        (event,) = log.recent(1)
        assert event["truncated"] is True and event["request_id"] == "big"
        assert "failed" not in event


def test_counters_declared_and_added(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix) as log:
        assert set(log.counters()) == set(COUNTER_NAMES)
        log.add(Counter.STORE_CHUNKS, 3)
        log.add_many({Counter.STORE_CHUNKS: 2, Counter.API_RESTARTS: 1})
        with EventLog.open(shm_prefix) as other:  # a second attach sees the same words
            assert other.counters()["store_chunks"] == 5
            assert other.counters()["api_restarts"] == 1
        for undeclared in ("custom_total", "x" * 100):
            with pytest.raises(ValueError, match="not declared"):
                log.add(undeclared)
        assert "custom_total" not in log.counters()


def test_models_get_rows_only_when_claimed_and_at_most_max_models(shm_prefix: str) -> None:
    """Per-model counters: a lookup naming any model cannot add a label; a claim (a registered
    instance's store or retrieve) can, up to MAX_MODELS; another process sees the same rows."""
    with EventLog.open(shm_prefix) as log:
        assert not log.add_model("guessed", {Counter.LOOKUPS: 1})
        assert log.model_counters() == {}
        assert log.add_model("m0", {Counter.STORE_CHUNKS: 2, Counter.STORE_BYTES: 64}, claim=True)
        assert log.add_model("m0", {Counter.LOOKUPS: 1, Counter.LOOKUP_HIT_TOKENS: 16})
        for i in range(1, MAX_MODELS):
            assert log.add_model(f"m{i}", {Counter.RETRIEVE_CHUNKS: i}, claim=True)
        assert not log.add_model("one-too-many", {Counter.RETRIEVE_CHUNKS: 1}, claim=True)
        with EventLog.open(shm_prefix) as other:
            seen = other.model_counters()
            assert other.add_model("m1", {Counter.RETRIEVE_CHUNKS: 10})
        assert sorted(seen) == sorted(f"m{i}" for i in range(MAX_MODELS))
        assert seen["m0"] == {"lookups": 1, "lookup_requested_tokens": 0, "lookup_hit_tokens": 16,
                              "store_chunks": 2, "store_bytes": 64, "retrieve_chunks": 0,
                              "retrieve_bytes": 0}
        assert log.model_counters()["m1"]["retrieve_chunks"] == 11
        with pytest.raises(KeyError):
            log.add_model("m0", {Counter.API_RESTARTS: 1})  # not kept per model


def test_an_error_event_keeps_its_fields(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix) as log:
        log.record(StoreError(request_id="r", instance_id=7, error="Boom()"))
        (event,) = log.recent(1)
        assert {k: event[k] for k in ("kind", "request_id", "instance_id", "error")} == {
            "kind": "store_error", "request_id": "r", "instance_id": 7, "error": "Boom()"}


_WRITER = """
import sys
from kvblend.shm.events import EventLog
from kvblend.shm.telemetry import LookupEnd
log = EventLog.open(sys.argv[1])
for i in range(200):
    log.record(LookupEnd(request_id=sys.argv[2], requested_tokens=i, hit_tokens=0, num_chunks=0,
                         duration_ms=0.0))
    log.add("stores")
"""


@pytest.mark.slow
def test_concurrent_writer_processes(shm_prefix: str) -> None:
    EventLog.open(shm_prefix, capacity=1024).close()
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, shm_prefix, str(w)],
                              env=os.environ.copy()) for w in range(2)]
    for p in procs:
        assert p.wait(timeout=60) == 0
    with EventLog.open(shm_prefix) as log:
        assert log.counters()["stores"] == 400
        events = log.recent()
        assert len(events) == 400
        for w in ("0", "1"):
            assert [e["requested_tokens"] for e in events if e["request_id"] == w] == \
                list(range(200))


_HOLDER = """
import sys
from kvblend.shm.events import EventLog
log = EventLog.open(sys.argv[1])
log._lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.slow
def test_writer_killed_holding_the_lock_wedges_nobody(shm_prefix: str) -> None:
    log = EventLog.open(shm_prefix)
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, shm_prefix], env=os.environ.copy(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert holder.stdin is not None and holder.stdout is not None and holder.stdout.readline() == b"held\n"
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    holder.stdin.close()
    holder.stdout.close()
    log.record(_lookup(3))
    log.add("lookups")
    assert log.recent(1)[0]["requested_tokens"] == 3 and log.counters()["lookups"] == 1
    log.close()


# -- create, attach, open ---------------------------------------------------------------------


def _poke(prefix: str, word: EventsHdr, value: int) -> None:
    """Write one header word of the log under ``prefix``, as another build or a crash would."""
    with Segment(Names(prefix).events) as seg:
        h = np.ndarray((HEADER_WORDS,), np.int64, seg.buf)
        h[word] = value
        del h


def _unfinished(prefix: str) -> None:
    """What a creator killed before its MAGIC leaves: a sized segment, header all zeros."""
    Segment(Names(prefix).events, 1 << 16, create=True).close()


def test_create_refuses_an_existing_log_and_leaves_it(shm_prefix: str) -> None:
    with EventLog.create(shm_prefix, capacity=8) as log:
        log.add(Counter.LOOKUPS, 2)
        with pytest.raises(FileExistsError):
            EventLog.create(shm_prefix)
        assert log.counters()["lookups"] == 2


def test_attach_to_an_absent_log_creates_nothing(shm_prefix: str) -> None:
    with pytest.raises(FileNotFoundError):
        EventLog.attach(shm_prefix)
    assert not segment.exists(Names(shm_prefix).events)


def test_attach_reads_the_geometry_from_the_header(shm_prefix: str) -> None:
    with EventLog.create(shm_prefix, capacity=8, slot_bytes=256) as made:
        made.record(_lookup(7, "r"))
        with EventLog.attach(shm_prefix) as log:
            assert (log.capacity, log.slot_bytes, log.head) == (8, 256, 1)
            assert log.recent()[0]["request_id"] == "r"
        with EventLog.open(shm_prefix, capacity=99, slot_bytes=1024) as log:  # keeps its own
            assert (log.capacity, log.slot_bytes) == (8, 256)


@pytest.mark.parametrize("word,value", [(EventsHdr.VERSION, VERSION + 1),
                                        (EventsHdr.CAPACITY, 9)])
def test_another_version_or_size_is_a_layout_mismatch_that_open_replaces(
        shm_prefix: str, word: EventsHdr, value: int) -> None:
    with EventLog.create(shm_prefix, capacity=8) as log:
        log.add(Counter.LOOKUPS)
    _poke(shm_prefix, word, value)
    with pytest.raises(LayoutMismatch):
        EventLog.attach(shm_prefix)
    with pytest.raises(FileExistsError):
        EventLog.create(shm_prefix)
    with EventLog.open(shm_prefix, capacity=4) as log:  # events are disposable
        assert (log.capacity, log.head, log.counters()["lookups"]) == (4, 0, 0)


@pytest.mark.parametrize("how", ["create", "open"])
def test_an_unfinished_log_is_not_attached_but_replaced(shm_prefix: str, how: str) -> None:
    _unfinished(shm_prefix)
    with pytest.raises(FileNotFoundError, match="never finished"):
        EventLog.attach(shm_prefix)
    with getattr(EventLog, how)(shm_prefix, capacity=4) as log:
        log.record(_lookup(1))
        assert (log.capacity, log.head) == (4, 1)
    with EventLog.attach(shm_prefix) as log:
        assert (log.capacity, log.head) == (4, 1)


def test_pickles_by_name_through_attach(shm_prefix: str) -> None:
    with EventLog.create(shm_prefix, capacity=8) as log:
        log.add(Counter.LOOKUPS, 3)
        with pickle.loads(pickle.dumps(log)) as copy:
            assert (copy.name, copy.capacity) == (log.name, 8)
            copy.add(Counter.LOOKUPS)
            assert log.counters()["lookups"] == 4
        blob = pickle.dumps(log)
        log.unlink()
    with pytest.raises(FileNotFoundError):
        pickle.loads(blob)
