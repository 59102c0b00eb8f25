"""The declared telemetry: every counter fits the log and is counted somewhere, every event kind
round-trips through the log with its fields."""

from __future__ import annotations

import re
from pathlib import Path

import msgspec
import pytest

from kvblend.shm.events import MAX_COUNTERS, NAME_BYTES, EventLog
from kvblend.shm.telemetry import COUNTER_NAMES, EVENT_KINDS, Counter, EventKind, kind_of

ROOT = Path(__file__).resolve().parents[2]


def test_every_counter_name_fits_the_log_once() -> None:
    assert len(COUNTER_NAMES) == len(set(COUNTER_NAMES)) <= MAX_COUNTERS
    assert all(0 < len(name.encode()) < NAME_BYTES for name in COUNTER_NAMES)
    assert all(c.help.endswith(".") or c.help.endswith(").") for c in Counter)


def test_every_counter_is_counted_by_the_service() -> None:
    code = "\n".join(p.read_text() for pkg in ("api", "dataplane", "shm")
                     for p in (ROOT / pkg).rglob("*.py") if p.name != "telemetry.py")
    used = set(re.findall(r"Counter\.([A-Z_]+)", code))
    # lookups count through api.metrics.count_lookup, which names its three counters too
    assert {c.name for c in Counter} - used == set()


def _example(kind: type) -> object:
    values = {int: 3, float: 0.25, str: "s", bool: True, list[int]: [1, 2], str | None: "r-1"}
    fields = msgspec.structs.fields(kind)
    return kind(**{f.name: values[f.type] for f in fields})


@pytest.mark.parametrize("kind", EVENT_KINDS, ids=lambda k: kind_of(_example(k)))
def test_every_event_kind_round_trips_through_the_log(shm_prefix: str, kind: type) -> None:
    event = _example(kind)
    with EventLog.open(shm_prefix) as log:
        log.record(event)
        (got,) = log.recent(1)
    assert EventKind(got.pop("kind")) == kind_of(event)
    assert {k: got[k] for k in ("seq", "time", "pid")} and \
        msgspec.convert({k: v for k, v in got.items() if k not in ("seq", "time", "pid")},
                        kind) == event
