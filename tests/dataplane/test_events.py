"""The shared-memory event log: ring order and wrap-around, counters, several processes, dead writers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shm.events import COUNTERS, EventLog


def test_record_and_recent_newest_last(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=8) as log:
        for i in range(5):
            log.record("store_end", request_id=f"r{i}", chunks=i)
        events = log.recent(3)
        assert [e["request_id"] for e in events] == ["r2", "r3", "r4"]
        assert [e["seq"] for e in events] == [3, 4, 5]
        assert events[-1]["kind"] == "store_end" and events[-1]["pid"] == os.getpid()


def test_ring_wraps_and_keeps_capacity_events(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=4) as log:
        for i in range(11):
            log.record("lookup", i=i)
        assert [e["i"] for e in log.recent()] == [7, 8, 9, 10]
        assert log.head == 11


def test_oversized_event_is_truncated_not_dropped(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix, capacity=4, slot_bytes=256) as log:
        log.record("retrieve_end", request_id="big", failed=list(range(500)))
        (event,) = log.recent(1)
        assert event["truncated"] is True and event["request_id"] == "big"
        assert "failed" not in event


def test_counters_predefined_and_added(shm_prefix: str) -> None:
    with EventLog.open(shm_prefix) as log:
        assert set(COUNTERS) <= set(log.counters())
        log.add("store_chunks", 3)
        log.add("custom_total")
        log.add("custom_total", 2)
        with EventLog.open(shm_prefix) as other:  # a second attach sees the same words
            assert other.counters()["store_chunks"] == 3
            assert other.counters()["custom_total"] == 3
        with pytest.raises(ValueError):
            log.add("x" * 100)


_WRITER = """
import sys
from shm.events import EventLog
log = EventLog.open(sys.argv[1])
for i in range(200):
    log.record("store_end", writer=sys.argv[2], i=i)
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
            assert [e["i"] for e in events if e["writer"] == w] == list(range(200))


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
    log.record("lookup", ok=True)
    log.add("lookups")
    assert log.recent(1)[0]["ok"] is True and log.counters()["lookups"] == 1
    log.close()
