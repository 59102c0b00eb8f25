"""The event log: a bounded ring of recent request events and named int64 counters, in shared memory.

This module owns ``EventLog``, one log per prefix, attached. The data plane records
store/retrieve events into it, the API records lookup events, and the API serves ``/v1/events``
and ``/metrics`` from it. It knows nothing of what the events mean: an event is a flat dict of
JSON-able fields. It does not own the segment's layout, creation and attach, nor an event's
bytes in its slot (``shm.eventformat``, whose names are re-exported here), nor the counter names
and event kinds (``shm.telemetry``).

NOTE: writers serialize on an ``flock`` (the kernel releases it when a writer dies, so a SIGKILLed
writer never wedges the others). A writer killed mid-record leaves its slot at SEQ=-1: readers skip
it and the next writer of that slot overwrites it (a slot's states are drawn in
``shm.eventformat``). Readers take no lock: they read SEQ, copy the payload, then re-read SEQ, and
keep the copy only when both reads agree (a seqlock). HEAD is the number of events ever recorded;
it is bumped after the slot is complete, so ``recent`` never waits. Counters are single aligned
int64 words updated under the lock; reads are lock-free.

NOTE: a model row is claimed under the lock (name first, USED last) by the data plane's first
store or retrieve of a registered instance of that model, and never released while the log lives:
at most MAX_MODELS models get rows, later ones count in the totals only. Readers skip rows whose
USED is 0, so they never see half a name.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import msgspec
import numpy as np

from kvblend.shm import segment
from kvblend.shm.errors import LayoutMismatch
from kvblend.shm.eventformat import (DEFAULT_CAPACITY, DEFAULT_SLOT_BYTES, HEADER_WORDS, MAGIC,
                                     MAX_COUNTERS, MAX_MODELS, MODEL_BYTES, MODEL_COL, MODEL_COLS,
                                     NAME_BYTES, SLOT_HDR, VERSION, EventsHdr, attach_segment,
                                     check_geometry, create_segment, encode, layout)
from kvblend.shm.lock import FileLock, held
from kvblend.shm.names import Names
from kvblend.shm.telemetry import COUNTER_NAMES, Event

_DECLARED = frozenset(COUNTER_NAMES)


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
        names_at, values_at, models_at, model_values_at, ring_at, _ = layout(
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
        check_geometry(capacity, slot_bytes)
        with held(Names(prefix).lock("events")) as lock:
            seg = create_segment(Names(prefix).events, capacity, slot_bytes)
        return cls(prefix, seg, lock)

    @classmethod
    def attach(cls, prefix: str) -> "EventLog":
        """Attach to the existing ``{prefix}_events`` with the geometry in its header.

        Raises:
            FileNotFoundError: there is no log under ``prefix``, or it is unfinished.
            LayoutMismatch: it is of another format version, or its size disagrees with its header.
            ForeignObject: the segment or lock file is not ours; nothing was mapped.
        """
        seg = attach_segment(Names(prefix).events)
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
        check_geometry(capacity, slot_bytes)
        name = Names(prefix).events
        with held(Names(prefix).lock("events")) as lock:
            try:
                seg = attach_segment(name)
            except (FileNotFoundError, LayoutMismatch):
                segment.unlink(name)
                seg = create_segment(name, capacity, slot_bytes)
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
            payload = encode(event, self.slot_bytes - SLOT_HDR)
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
        cols = [MODEL_COL[c] for c in counts]  # KeyError on a counter not kept per model
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
                str(c): values[col] for c, col in MODEL_COL.items()}
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


__all__ = ["EventLog", "EventsHdr", "HEADER_WORDS", "MAGIC", "VERSION", "MAX_COUNTERS",
           "NAME_BYTES", "MAX_MODELS"]
