"""The event log's segment: its drawing, its header words, its geometry, an event's bytes.

This module owns where every byte of ``{prefix}_events`` lives, how the segment is created and
attached, and how an event is written into a ring slot (``encode``). The object that uses it is
``shm.events.EventLog`` (recording, reading, counters); the counter names and event kinds it holds
are ``shm.telemetry``'s. A test checks that the header drawing and ``EventsHdr`` agree.

Segment ``/dev/shm/P_events`` (mode 0600), lock file ``/dev/shm/P_events.lock``::

    offset          part       shape                       notes
    0               header     int64[HEADER_WORDS]         the words of ``EventsHdr``, below
    128             names      uint8[MAX_COUNTERS, 48]     counter names, UTF-8, NUL padded
    128+48*M        values     int64[MAX_COUNTERS]         counter values
    ...             models     uint8[MAX_MODELS, 128]      model names, UTF-8, NUL padded
    ...             per model  int64[MAX_MODELS, 16]       USED (1 once the name is whole), then
                                                           the counters of MODEL_COUNTERS in order
    ...             ring       uint8[CAPACITY, SLOT_BYTES] event slots (from a 64-byte boundary)

    ring slot: int64 SEQ (0 = empty, -1 = being written), int64 LEN, then LEN bytes of JSON

Event log header (``P_events`` from byte 0, ``int64[HEADER_WORDS]``)::

    word  name        meaning                                          written by
    0     MAGIC       MAGIC once creation completed (last)             create
    1     VERSION     format version                                   create
    2     CAPACITY    slots of the ring                                create
    3     SLOT_BYTES  bytes per slot (a multiple of 8, >= 128)         create
    4     HEAD        events ever recorded (the newest event's seq)    record

Life of the segment (``EventLog.create``, ``attach`` and ``open``)::

    absent --create--> unfinished (MAGIC 0) --header written, MAGIC last--> complete
    unfinished, its creator died --create or open: unlink, create--> ...
    complete, another VERSION or size --open: unlink, create--> ... (events are disposable)

State of a slot::

    empty (SEQ 0) --writer: SEQ=-1--> being written --payload, LEN, then SEQ=n--> holds event n
    holds event n --writer of event n+CAPACITY: SEQ=-1--> being written ...

NOTE: every creation (``create`` and ``open``) holds the lock from its look at the name to its
MAGIC, so an unfinished segment seen under the lock is one whose creator died: replacing it races
no one. ``attach`` takes no lock: it maps only a complete log.
"""

from __future__ import annotations

import json
from enum import IntEnum, unique
from typing import Any

import numpy as np

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.hashing import MODEL_NAME_BYTES
from kvblend.shm.telemetry import COUNTER_NAMES, MODEL_COUNTERS

MAGIC = 0x6B76626C6576656E
VERSION = 2
HEADER_WORDS = 16
MAX_COUNTERS = 128
NAME_BYTES = 48
MAX_MODELS = 16
MODEL_BYTES = 128
MODEL_COLS = 16
#: column of each per-model counter in its model row (column 0 is USED)
MODEL_COL = {c: 1 + i for i, c in enumerate(MODEL_COUNTERS)}
assert MODEL_NAME_BYTES <= MODEL_BYTES and len(MODEL_COUNTERS) < MODEL_COLS
SLOT_HDR = 16
DEFAULT_CAPACITY = 1024
DEFAULT_SLOT_BYTES = 1024


@unique
class EventsHdr(IntEnum):
    """Positions of the event log header's words."""

    MAGIC = 0
    VERSION = 1
    CAPACITY = 2
    SLOT_BYTES = 3
    HEAD = 4


assert max(EventsHdr) < HEADER_WORDS, "an EventsHdr word past HEADER_WORDS"


def layout(capacity: int, slot_bytes: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of names, values, model names, model values and ring, and the size."""
    names_at = HEADER_WORDS * 8
    values_at = names_at + MAX_COUNTERS * NAME_BYTES
    models_at = values_at + MAX_COUNTERS * 8
    model_values_at = models_at + MAX_MODELS * MODEL_BYTES
    ring_at = model_values_at + MAX_MODELS * MODEL_COLS * 8
    ring_at += -ring_at % 64
    return names_at, values_at, models_at, model_values_at, ring_at, ring_at + capacity * slot_bytes


def encode(event: dict[str, Any], limit: int) -> bytes:
    """An event's JSON, at most ``limit`` bytes: whole when it fits, else only its scalar fields
    that fit and ``"truncated": true``, else only its kind and seq."""
    payload = json.dumps(event, separators=(",", ":"), default=str).encode()
    if len(payload) <= limit:
        return payload
    small = {k: v for k, v in event.items() if isinstance(v, (int, float, bool, type(None)))
             or (isinstance(v, str) and len(v) <= 128)}
    small["truncated"] = True
    payload = json.dumps(small, separators=(",", ":")).encode()
    if len(payload) > limit:
        payload = json.dumps({"kind": str(event["kind"])[:64], "seq": event["seq"],
                              "truncated": True}).encode()
    return payload


def check_geometry(capacity: int, slot_bytes: int) -> None:
    """Raises ``ValueError`` unless ``capacity >= 1`` and ``slot_bytes >= 128``, a multiple of 8."""
    if capacity < 1 or slot_bytes < 128 or slot_bytes % 8:
        raise ValueError("need capacity >= 1 and slot_bytes >= 128, a multiple of 8")


def attach_segment(name: str) -> segment.Segment:
    """The complete log at ``name``, its size checked against its header's geometry."""
    seg = segment.attach_checked(name, MAGIC, VERSION, "event log")
    try:
        if seg.size < HEADER_WORDS * 8:
            raise LayoutMismatch(f"event log {name!r} is shorter than its header")
        h = np.frombuffer(seg.buf, np.int64, HEADER_WORDS).copy()
        capacity, slot_bytes = int(h[EventsHdr.CAPACITY]), int(h[EventsHdr.SLOT_BYTES])
        if capacity < 1 or slot_bytes < 128 or seg.size != layout(capacity, slot_bytes)[-1]:
            raise LayoutMismatch(f"event log {name!r} holds {seg.size} bytes, not the "
                                 f"{capacity} x {slot_bytes} of its header")
    except BaseException:
        seg.close()
        raise
    return seg


def create_segment(name: str, capacity: int, slot_bytes: int) -> segment.Segment:
    """A new log at ``name``, replacing an unfinished one. The caller holds the log's lock."""
    size = layout(capacity, slot_bytes)[-1]
    try:
        seg = segment.Segment(name, size, create=True)
    except FileExistsError:
        _unlink_unfinished(name)
        seg = segment.Segment(name, size, create=True)
    h = np.ndarray((HEADER_WORDS,), np.int64, seg.buf)
    names_at = layout(capacity, slot_bytes)[0]
    names = np.ndarray((MAX_COUNTERS, NAME_BYTES), np.uint8, seg.buf, names_at)
    for i, counter in enumerate(COUNTER_NAMES):
        raw = counter.encode()
        names[i, :len(raw)] = np.frombuffer(raw, np.uint8)
    h[[EventsHdr.CAPACITY, EventsHdr.SLOT_BYTES, EventsHdr.VERSION]] = [capacity, slot_bytes,
                                                                         VERSION]
    h[EventsHdr.MAGIC] = MAGIC  # last: a half-built log is recognized and replaced
    del h, names
    return seg


def _unlink_unfinished(name: str) -> None:
    """Remove the log at ``name`` if its creator died before its MAGIC (under the log's lock no
    creator is alive but us).

    Raises:
        FileExistsError: the log at ``name`` is complete, of this version or another.
    """
    try:
        segment.attach_checked(name, MAGIC, VERSION, "event log").close()
    except FileNotFoundError:
        segment.unlink(name)  # unfinished (or gone since)
        return
    except LayoutMismatch:
        pass
    raise FileExistsError(f"event log {name!r} exists")


__all__ = ["EventsHdr", "HEADER_WORDS", "MAGIC", "VERSION", "MAX_COUNTERS", "NAME_BYTES",
           "MAX_MODELS", "MODEL_BYTES", "MODEL_COLS", "MODEL_COL", "SLOT_HDR", "DEFAULT_CAPACITY",
           "DEFAULT_SLOT_BYTES", "layout", "encode", "check_geometry", "attach_segment",
           "create_segment"]
