"""The shared-memory event log: ring order and wrap-around, counters, several processes, dead writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shm.events import EventLog
from shm.telemetry import COUNTER_NAMES, Counter, LookupEnd, RetrieveEnd, StoreError


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


def test_an_error_event_keeps_its_fields(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix) as log:
        log.record(StoreError(request_id="r", instance_id=7, error="Boom()"))
        (event,) = log.recent(1)
        assert {k: event[k] for k in ("kind", "request_id", "instance_id", "error")} == {
            "kind": "store_error", "request_id": "r", "instance_id": 7, "error": "Boom()"}


_WRITER = """
import sys
from shm.events import EventLog
from shm.telemetry import LookupEnd
log = EventLog.open(sys.argv[1])
for i in range(200):
    log.record(LookupEnd(request_id=sys.argv[2], requested_tokens=i, hit_tokens=0, num_chunks=0,
                         duration_ms=0.0))
    log.add("stores")
"""


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
from shm.events import EventLog
log = EventLog.open(sys.argv[1])
log._lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


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
