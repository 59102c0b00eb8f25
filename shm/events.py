"""The event log: a bounded ring of recent request events and named int64 counters, in shared memory.

This module owns one segment per prefix and nothing else. The data plane records store/retrieve
events into it, the API records lookup events, and the API serves ``/v1/events`` and ``/metrics``
from it. It knows nothing of what the events mean: an event is a flat dict of JSON-able fields.

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

NOTE: writers serialize on an ``flock`` (the kernel releases it when a writer dies, so a SIGKILLed
writer never wedges the others). A writer killed mid-record leaves its slot at SEQ=-1: readers skip
it and the next writer of that slot overwrites it. Readers take no lock: they read SEQ, copy the
payload, then re-read SEQ, and keep the copy only when both reads agree (a seqlock). HEAD is the
number of events ever recorded; it is bumped after the slot is complete, so ``recent`` never waits.
Counters are single aligned int64 words updated under the lock; reads are lock-free.

NOTE: a model row is claimed under the lock (name first, USED last) by the data plane's first
store or retrieve of a registered instance of that model, and never released while the log lives:
at most MAX_MODELS models get rows, later ones count in the totals only. Readers skip rows whose
USED is 0, so they never see half a name.

NOTE: every creation (``create`` and ``open``) holds the lock from its look at the name to its
MAGIC, so an unfinished segment seen under the lock is one whose creator died: replacing it races
no one. ``attach`` takes no lock: it maps only a complete log.
"""

from __future__ import annotations

import json
import os
import time
from enum import IntEnum, unique
from typing import Any

import msgspec
import numpy as np

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.hashing import MODEL_NAME_BYTES
from kvblend.shm.lock import FileLock, held
from kvblend.shm.names import Names
from kvblend.shm.telemetry import COUNTER_NAMES, MODEL_COUNTERS, Event

_DECLARED = frozenset(COUNTER_NAMES)

MAGIC = 0x6B76626C6576656E
VERSION = 2
HEADER_WORDS = 16
MAX_COUNTERS = 128
NAME_BYTES = 48
MAX_MODELS = 16
MODEL_BYTES = 128
MODEL_COLS = 16
_MODEL_COL = {c: 1 + i for i, c in enumerate(MODEL_COUNTERS)}
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


def _layout(capacity: int, slot_bytes: int) -> tuple[int, int, int, int, int, int]:
    """Byte offsets of names, values, model names, model values and ring, and the size."""
    names_at = HEADER_WORDS * 8
    values_at = names_at + MAX_COUNTERS * NAME_BYTES
    models_at = values_at + MAX_COUNTERS * 8
    model_values_at = models_at + MAX_MODELS * MODEL_BYTES
    ring_at = model_values_at + MAX_MODELS * MODEL_COLS * 8
    ring_at += -ring_at % 64
    return names_at, values_at, models_at, model_values_at, ring_at, ring_at + capacity * slot_bytes


class EventLog:
    """The event log of one prefix, attached in this process. Build it with ``EventLog.create``,
    ``EventLog.attach`` or ``EventLog.open`` (attach, else create); it pickles by name.

    Attributes:
        prefix: the store's segment prefix.
        name: the segment name (``{prefix}_events``).
        capacity: events kept (older ones are overwritten).
        slot_bytes: bytes per event slot (its JSON is at most ``slot_bytes - 16``).
    """

    def __init__(self, prefix: str, seg: segment.Segment, lock: FileLock) -> None:
        self.prefix, self.name = prefix, seg.name
        self._seg, self._lock = seg, lock
        buf = seg.buf
        self._h = np.ndarray((HEADER_WORDS,), np.int64, buf)
        self.capacity = int(self._h[EventsHdr.CAPACITY])
        self.slot_bytes = int(self._h[EventsHdr.SLOT_BYTES])
        names_at, values_at, models_at, model_values_at, ring_at, _ = _layout(
            self.capacity, self.slot_bytes)
        self._names = np.ndarray((MAX_COUNTERS, NAME_BYTES), np.uint8, buf, names_at)
        self._values = np.ndarray((MAX_COUNTERS,), np.int64, buf, values_at)
        self._models = np.ndarray((MAX_MODELS, MODEL_BYTES), np.uint8, buf, models_at)
        self._model_values = np.ndarray((MAX_MODELS, MODEL_COLS), np.int64, buf, model_values_at)
        self._ring = np.ndarray((self.capacity, self.slot_bytes), np.uint8, buf, ring_at)
        self._slot_words = self._ring.view(np.int64)  # [capacity, slot_bytes // 8]
        self._index: dict[str, int] = {}
        self._model_rows: dict[str, int] = {}
        self._pid = os.getpid()

    @classmethod
    def create(cls, prefix: str, capacity: int = DEFAULT_CAPACITY,
               slot_bytes: int = DEFAULT_SLOT_BYTES) -> "EventLog":
        """Create ``{prefix}_events``, new and empty.

        Args:
            prefix: the store's segment prefix.
            capacity: events kept (>= 1).
            slot_bytes: bytes per event slot (>= 128, a multiple of 8).

        Raises:
            FileExistsError: a complete log (of any version) exists under ``prefix``. An unfinished
                one, whose creator died before its MAGIC, is replaced.
            ValueError: the geometry is out of bounds.
            ForeignObject: the segment or lock file is not ours (``shm.private``); it was neither
                used nor removed.
        """
        _check_geometry(capacity, slot_bytes)
        with held(Names(prefix).lock("events")) as lock:
            seg = _create(Names(prefix).events, capacity, slot_bytes)
        return cls(prefix, seg, lock)

    @classmethod
    def attach(cls, prefix: str) -> "EventLog":
        """Attach to the existing ``{prefix}_events`` with the geometry in its header.

        Raises:
            FileNotFoundError: there is no log under ``prefix``, or it is unfinished.
            LayoutMismatch: it is of another format version, or its size disagrees with its header.
            ForeignObject: the segment or lock file is not ours; nothing was mapped.
        """
        seg = _attach(Names(prefix).events)
        try:
            lock = FileLock(Names(prefix).lock("events"))
        except BaseException:
            seg.close()
            raise
        return cls(prefix, seg, lock)

    @classmethod
    def open(cls, prefix: str, capacity: int = DEFAULT_CAPACITY,
             slot_bytes: int = DEFAULT_SLOT_BYTES) -> "EventLog":
        """Attach to ``{prefix}_events``; create it when absent, unfinished or of another version
        (events are disposable). Both under the log's lock, so concurrent openers agree.

        Args:
            prefix: the store's segment prefix.
            capacity: events kept; used only when creating (an existing log keeps its own).
            slot_bytes: bytes per event (JSON); used only when creating.

        Raises:
            ValueError: the geometry is out of bounds.
            ForeignObject: the segment or lock file is not ours (``shm.private``); it was neither
                used nor removed.
        """
        _check_geometry(capacity, slot_bytes)
        name = Names(prefix).events
        with held(Names(prefix).lock("events")) as lock:
            try:
                seg = _attach(name)
            except (FileNotFoundError, LayoutMismatch):
                segment.unlink(name)
                seg = _create(name, capacity, slot_bytes)
        return cls(prefix, seg, lock)

    # -- events -----------------------------------------------------------------------------

    def record(self, event: Event) -> int:
        """Append ``event`` as ``{"kind", **its fields, "time", "pid", "seq"}``; returns its seq.

        An event longer than a slot keeps only its scalar fields that fit, and gets
        ``"truncated": true``.
        """
        event = {**msgspec.to_builtins(event), "time": time.time(), "pid": self._pid}
        self._lock.acquire()
        try:
            seq = int(self._h[EventsHdr.HEAD]) + 1
            event["seq"] = seq
            payload = _encode(event, self.slot_bytes - SLOT_HDR)
            row = seq % self.capacity
            words = self._slot_words[row]
            words[0] = -1
            self._ring[row, SLOT_HDR:SLOT_HDR + len(payload)] = np.frombuffer(payload, np.uint8)
            words[1] = len(payload)
            words[0] = seq
            self._h[EventsHdr.HEAD] = seq
        finally:
            self._lock.release()
        return seq

    def recent(self, n: int | None = None) -> list[dict[str, Any]]:
        """The last ``n`` events still in the ring (all when None), oldest first."""
        head = int(self._h[EventsHdr.HEAD])
        count = min(head, self.capacity if n is None else min(n, self.capacity))
        out = []
        for seq in range(head - count + 1, head + 1):
            event = self._read(seq)
            if event is not None:
                out.append(event)
        return out

    def _read(self, seq: int) -> dict[str, Any] | None:
        row = seq % self.capacity
        words = self._slot_words[row]
        if int(words[0]) != seq:
            return None
        length = int(words[1])
        if not 0 < length <= self.slot_bytes - SLOT_HDR:
            return None
        raw = self._ring[row, SLOT_HDR:SLOT_HDR + length].tobytes()
        if int(words[0]) != seq:  # overwritten while we copied
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    @property
    def head(self) -> int:
        """Number of events ever recorded in this log."""
        return int(self._h[EventsHdr.HEAD])

    # -- counters ---------------------------------------------------------------------------

    def add(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to a counter declared in ``shm.telemetry`` (created at 0 on first use in a
        log made by an older version).

        Raises:
            ValueError: the counter is not declared, or all ``MAX_COUNTERS`` counters exist.
        """
        self._lock.acquire()
        try:
            i = self._slot_of(counter, create=True)
            self._values[i] += n
        finally:
            self._lock.release()

    def add_many(self, counts: dict[str, int]) -> None:
        """Add to several counters under one lock acquisition."""
        self._lock.acquire()
        try:
            for counter, n in counts.items():
                self._values[self._slot_of(counter, create=True)] += n
        finally:
            self._lock.release()

    def counters(self) -> dict[str, int]:
        """Every counter's current value."""
        used = np.nonzero(self._names[:, 0])[0]
        return {bytes(self._names[i]).rstrip(b"\0").decode(): int(self._values[i])
                for i in used.tolist()}

    def add_model(self, model: str, counts: dict[str, int], claim: bool = False) -> bool:
        """Add to the per-model counters (``shm.telemetry.MODEL_COUNTERS``) of ``model``; with
        ``claim`` give it a row when it has none and one is free. Returns whether it has a row.

        Raises:
            KeyError: a counter is not kept per model.
        """
        cols = [_MODEL_COL[c] for c in counts]  # KeyError on a counter not kept per model
        row = self._model_row(model)
        if row is None and not claim:
            return False
        self._lock.acquire()
        try:
            if row is None:
                row = self._claim_model(model)
                if row is None:
                    return False
            self._model_values[row, cols] += list(counts.values())
        finally:
            self._lock.release()
        return True

    def model_counters(self) -> dict[str, dict[str, int]]:
        """The per-model counters of every model with a row: ``{model: {counter: value}}``."""
        out = {}
        for row in np.nonzero(self._model_values[:, 0])[0].tolist():
            values = self._model_values[row].tolist()
            out[bytes(self._models[row]).rstrip(b"\0").decode()] = {
                str(c): values[col] for c, col in _MODEL_COL.items()}
        return out

    def _model_row(self, model: str) -> int | None:
        row = self._model_rows.get(model)
        if row is None:
            raw = model.encode()
            for r in np.nonzero(self._model_values[:, 0])[0].tolist():
                if bytes(self._models[r]).rstrip(b"\0") == raw:
                    self._model_rows[model] = row = r
                    break
        return row

    def _claim_model(self, model: str) -> int | None:
        """The row of ``model``, claimed now if another process did not meanwhile (lock held)."""
        row = self._model_row(model)
        if row is not None:
            return row
        free = np.nonzero(self._model_values[:, 0] == 0)[0]
        if len(free) == 0:
            return None
        row, raw = int(free[0]), model.encode()[:MODEL_BYTES]
        self._models[row] = 0
        self._models[row, :len(raw)] = np.frombuffer(raw, np.uint8)
        self._model_values[row, 1:] = 0
        self._model_values[row, 0] = 1  # last: readers see the whole name or no row
        self._model_rows[model] = row
        return row

    def _slot_of(self, counter: str, create: bool) -> int:
        i = self._index.get(counter)
        if i is not None:
            return i
        if counter not in _DECLARED:
            raise ValueError(f"counter {counter!r} is not declared in shm.telemetry")
        raw = counter.encode()
        for j in range(MAX_COUNTERS):
            name = bytes(self._names[j]).rstrip(b"\0")
            if name == raw:
                self._index[counter] = j
                return j
            if not name:
                if not create:
                    break
                self._names[j, :len(raw)] = np.frombuffer(raw, np.uint8)
                self._index[counter] = j
                return j
        raise ValueError(f"all {MAX_COUNTERS} counters are in use")

    # -- life cycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Detach this process (the log stays in shared memory)."""
        for part in ("_h", "_names", "_values", "_models", "_model_values", "_ring",
                     "_slot_words"):
            self.__dict__.pop(part, None)
        self._seg.close()
        self._lock.close()

    def unlink(self) -> None:
        """Remove the segment name (mappings stay valid until closed).

        Raises:
            ForeignObject: the name is not ours; it is left in place.
        """
        segment.unlink(self.name)

    def __enter__(self) -> "EventLog":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __reduce__(self) -> tuple:
        return (EventLog.attach, (self.prefix,))

    def __repr__(self) -> str:
        return (f"EventLog(prefix={self.prefix!r}, capacity={self.capacity}, "
                f"slot_bytes={self.slot_bytes})")


def _encode(event: dict[str, Any], limit: int) -> bytes:
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


def _check_geometry(capacity: int, slot_bytes: int) -> None:
    if capacity < 1 or slot_bytes < 128 or slot_bytes % 8:
        raise ValueError("need capacity >= 1 and slot_bytes >= 128, a multiple of 8")


def _attach(name: str) -> segment.Segment:
    """The complete log at ``name``, its size checked against its header's geometry."""
    seg = segment.attach_checked(name, MAGIC, VERSION, "event log")
    try:
        if seg.size < HEADER_WORDS * 8:
            raise LayoutMismatch(f"event log {name!r} is shorter than its header")
        h = np.frombuffer(seg.buf, np.int64, HEADER_WORDS).copy()
        capacity, slot_bytes = int(h[EventsHdr.CAPACITY]), int(h[EventsHdr.SLOT_BYTES])
        if capacity < 1 or slot_bytes < 128 or seg.size != _layout(capacity, slot_bytes)[-1]:
            raise LayoutMismatch(f"event log {name!r} holds {seg.size} bytes, not the "
                                 f"{capacity} x {slot_bytes} of its header")
    except BaseException:
        seg.close()
        raise
    return seg


def _create(name: str, capacity: int, slot_bytes: int) -> segment.Segment:
    """A new log at ``name``, replacing an unfinished one. The caller holds the log's lock."""
    size = _layout(capacity, slot_bytes)[-1]
    try:
        seg = segment.Segment(name, size, create=True)
    except FileExistsError:
        _unlink_unfinished(name)
        seg = segment.Segment(name, size, create=True)
    h = np.ndarray((HEADER_WORDS,), np.int64, seg.buf)
    names_at = _layout(capacity, slot_bytes)[0]
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


__all__ = ["EventLog", "EventsHdr", "HEADER_WORDS", "MAGIC", "VERSION"]
