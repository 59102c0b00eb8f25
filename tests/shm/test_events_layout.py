"""The event log's header is one executable fact: the drawing in ``shm.eventformat`` and
``EventsHdr`` agree, no two words share a position, and a created log reads back by those
names."""

from __future__ import annotations

import numpy as np

from kvblend.shm import eventformat
from kvblend.shm.eventformat import HEADER_WORDS, EventsHdr
from kvblend.shm.events import EventLog
from kvblend.shm.segment import Segment
from kvblend.shm.telemetry import LookupEnd
from tests.harness import assert_drawing_is_declaration


def test_the_drawing_is_the_declaration() -> None:
    assert_drawing_is_declaration(eventformat, "Event log header", EventsHdr)
    assert max(EventsHdr) < HEADER_WORDS


def test_a_created_header_reads_back_by_its_names(shm_prefix: str) -> None:
    with EventLog.create(shm_prefix, capacity=8, slot_bytes=256) as log:
        log.record(LookupEnd(request_id="r", requested_tokens=1, hit_tokens=0, num_chunks=0,
                             duration_ms=0.0))
        with Segment(log.name) as seg:
            h = np.frombuffer(seg.buf, np.int64, HEADER_WORDS).copy()
    assert (h[EventsHdr.MAGIC], h[EventsHdr.VERSION]) == (eventformat.MAGIC, eventformat.VERSION)
    assert (h[EventsHdr.CAPACITY], h[EventsHdr.SLOT_BYTES], h[EventsHdr.HEAD]) == (8, 256, 1)
    assert not h[len(EventsHdr):].any()  # the words past the declared ones are unused
