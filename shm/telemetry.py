"""What the event log may hold: every counter with its help text, the lookup-latency histogram, and
every event kind with its fields.

This module owns the names; ``shm.events`` stores them (and refuses a counter not declared here),
``api.metrics`` exports each counter with its help, and ``GET /v1/events`` lists the kinds. A new
counter or event is one line here. It knows nothing of shared memory.

Events are tagged msgspec structs: the tag is the event's ``kind`` on the wire, the fields are
exactly those below; the log adds ``seq``, ``time`` and ``pid`` when it records one.
"""

from __future__ import annotations

import bisect
from enum import StrEnum

import msgspec


class Counter(StrEnum):
    """A monotonically increasing count in the event log; ``help`` is its Prometheus help text."""

    help: str

    def __new__(cls, value: str, help: str) -> "Counter":
        member = str.__new__(cls, value)
        member._value_ = value
        member.help = help
        return member

    LOOKUPS = "lookups", "Lookups served."
    LOOKUP_REQUESTED_TOKENS = ("lookup_requested_tokens",
                               "Tokens asked for by lookups (whole chunks only).")
    LOOKUP_HIT_TOKENS = "lookup_hit_tokens", "Tokens covered by stored chunks in lookups."
    STORES = "stores", "Store calls (store_pre_computed and store_final)."
    STORE_CHUNKS = "store_chunks", "Chunks copied into the store."
    STORE_SKIPPED_CHUNKS = "store_skipped_chunks", "Chunks a store found already stored."
    STORE_BYTES = "store_bytes", "KV bytes copied into the store."
    STORE_FAILURES = "store_failures", "Store calls that failed."
    STORE_FAILED_CHUNKS = "store_failed_chunks", "Chunks a store could not store."
    RETRIEVES = "retrieves", "Retrieve calls."
    RETRIEVE_CHUNKS = "retrieve_chunks", "Chunks copied into engine buffers."
    RETRIEVE_BYTES = "retrieve_bytes", "KV bytes copied into engine buffers."
    RETRIEVE_FAILURES = "retrieve_failures", "Retrieve calls that failed."
    RETRIEVE_FAILED_CHUNKS = ("retrieve_failed_chunks",
                              "Chunks a retrieve could not deliver (evicted meanwhile).")
    FINGERPRINT_NEW_ENTRIES = "fingerprint_new_entries", "Fingerprint entries added."
    FINGERPRINT_EVICTED_ENTRIES = ("fingerprint_evicted_entries",
                                   "Fingerprint entries dropped because their chunk was evicted.")
    FINGERPRINT_NOT_INDEXED_CHUNKS = (
        "fingerprint_not_indexed_chunks",
        "Chunks stored but not indexed: the fingerprint index was full of live entries "
        "(raise --fingerprint-capacity).")
    DATAPLANE_STARTS = "dataplane_starts", "Times a data plane became ready."
    DATAPLANE_RESTARTS = "dataplane_restarts", "Times the supervisor restarted the data plane."
    DATAPLANE_ERRORS = "dataplane_errors", "Data-plane calls answered with an error."
    API_RESTARTS = "api_restarts", "Times the supervisor restarted the API."
    LEASE_RENEWALS = "lease_renewals", "Instance leases renewed by their owners."
    INSTANCES_EXPIRED = "instances_expired", "Instances dropped because their lease ran out."
    CLEARED_CHUNKS = "cleared_chunks", "Chunks dropped by clear (admin); not counted as evictions."
    REMOTE_WRITTEN_CHUNKS = "remote_written_chunks", "Chunks written behind to the remote tier."
    REMOTE_DROPPED_CHUNKS = ("remote_dropped_chunks",
                             "Chunks not written behind: the queue was full.")
    REMOTE_SKIPPED_CHUNKS = ("remote_skipped_chunks",
                             "Chunks not written behind: gone from the store before their turn.")
    REMOTE_FAILED_WRITES = ("remote_failed_writes",
                            "Remote writes that failed (remote down, slow, or its breaker open).")
    REMOTE_REPLAYED_WRITES = ("remote_replayed_writes",
                              "Failed remote writes offered again once their node was back.")
    REMOTE_REPLAY_DROPPED_WRITES = ("remote_replay_dropped_writes",
                                    "Failed remote writes given up: past the bounds of those "
                                    "held for replay (oldest first).")
    REMOTE_RECORDS = "remote_records", "Records of remote chunks read from the remote tier's stream."
    REMOTE_MALFORMED_RECORDS = ("remote_malformed_records",
                                "Records of the remote tier's stream that did not parse.")
    REMOTE_DISCOVERED_CHUNKS = ("remote_discovered_chunks",
                                "Remote chunks entered in the fingerprint index (findable here).")
    REMOTE_PROMOTED_CHUNKS = ("remote_promoted_chunks",
                              "Chunks fetched from the remote tier into the local store.")
    REMOTE_FETCH_MISSES = ("remote_fetch_misses",
                           "Remote fetches that gave no chunk: absent, expired, corrupt, "
                           "truncated, or the remote unavailable.")
    REMOTE_PEER_READS = ("remote_peer_reads",
                         "Chunks read from their holder's slab (peer reads), digest checked.")
    REMOTE_PEER_MISSES = ("remote_peer_misses",
                          "Peer reads that gave no chunk: the holder unavailable or too slow, or "
                          "its slot held other bytes (evicted or reused).")
    REMOTE_PEER_FALLBACKS = ("remote_peer_fallbacks",
                             "Peer-read misses that fell back to the chunk's value.")
    REMOTE_PEER_TIMEOUTS = ("remote_peer_timeouts",
                            "Peer reads given up on for time (also misses): not returned within "
                            "the bound (the holder stopped), its holder's earlier read still "
                            "stuck, or no staging buffer free.")


class Histogram:
    """A latency histogram kept as plain counters: one per bucket and the sum in microseconds.

    Attributes:
        name: the metric's base name (``kvblend_<name>``).
        help: its help text.
        bounds: the buckets' upper bounds in seconds, ascending (``+Inf`` is implied).
    """

    def __init__(self, name: str, help: str, bounds: tuple[float, ...]) -> None:
        self.name, self.help, self.bounds = name, help, bounds
        self.buckets = tuple(f"{name}_bucket_{i}" for i in range(len(bounds) + 1))
        self.sum_us = f"{name}_sum_us"

    def observe(self, seconds: float) -> dict[str, int]:
        """The counter increments of one observation."""
        return {self.buckets[bisect.bisect_left(self.bounds, seconds)]: 1,
                self.sum_us: int(seconds * 1e6)}

    @property
    def counters(self) -> tuple[str, ...]:
        return (*self.buckets, self.sum_us)


LOOKUP_SECONDS = Histogram("lookup_seconds", "Time to serve a lookup, body parse to answer.",
                           (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0))
_COPY_BOUNDS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
STORE_SECONDS = Histogram("store_seconds", "Time a store call took in the data plane, request "
                          "to the last chunk committed.", _COPY_BOUNDS)
RETRIEVE_SECONDS = Histogram("retrieve_seconds", "Time a retrieve call took in the data plane, "
                             "request to the last chunk copied.", _COPY_BOUNDS)
HISTOGRAMS: tuple[Histogram, ...] = (LOOKUP_SECONDS, STORE_SECONDS, RETRIEVE_SECONDS)

#: Every counter name the log holds, in creation order.
COUNTER_NAMES: tuple[str, ...] = (*(c.value for c in Counter),
                                  *(name for h in HISTOGRAMS for name in h.counters))

#: The counters also kept per model (``kvblend_model_<counter>{model=...}``), for the models of
#: registered instances only, so callers cannot grow the label set (``shm.events.MAX_MODELS``).
MODEL_COUNTERS: tuple[Counter, ...] = (
    Counter.LOOKUPS, Counter.LOOKUP_REQUESTED_TOKENS, Counter.LOOKUP_HIT_TOKENS,
    Counter.STORE_CHUNKS, Counter.STORE_BYTES, Counter.RETRIEVE_CHUNKS, Counter.RETRIEVE_BYTES)


# -- events ---------------------------------------------------------------------------------------

class Event(msgspec.Struct, tag_field="kind", kw_only=True, frozen=True):
    """A request event; subclasses are the kinds (their tag)."""


class LookupStart(Event, tag="lookup_start"):
    request_id: str | None
    model_name: str
    num_tokens: int


class LookupEnd(Event, tag="lookup_end"):
    request_id: str | None
    requested_tokens: int
    hit_tokens: int
    num_chunks: int
    duration_ms: float


class StoreStart(Event, tag="store_start"):
    request_id: str | None
    instance_id: int
    store_kind: str
    tokens: int
    chunks: int


class StoreEnd(StoreStart, tag="store_end"):
    copied: int
    storage_hits: int
    failed: list[int]
    fingerprint_new: int
    not_indexed: int
    bytes: int
    duration_s: float
    ok: bool


class RetrieveStart(Event, tag="retrieve_start"):
    request_id: str | None
    instance_id: int
    tokens: int
    chunks: int


class RetrieveEnd(RetrieveStart, tag="retrieve_end"):
    copied: int
    failed: list[int]
    bytes: int
    duration_s: float
    ok: bool


class StoreError(Event, tag="store_error"):
    request_id: str | None
    instance_id: int
    error: str


class RetrieveError(StoreError, tag="retrieve_error"):
    pass


class Clear(Event, tag="clear"):
    chunks_removed: int
    fingerprints_removed: int


EVENT_KINDS: tuple[type[Event], ...] = (LookupStart, LookupEnd, StoreStart, StoreEnd,
                                        RetrieveStart, RetrieveEnd, StoreError, RetrieveError,
                                        Clear)
EventKind = StrEnum("EventKind", {str(t.__struct_config__.tag).upper(): str(t.__struct_config__.tag)
                                  for t in EVENT_KINDS})
EventKind.__doc__ = "The kind of a recorded event (its tag)."


def kind_of(event: Event) -> str:
    return str(type(event).__struct_config__.tag)


__all__ = ["Counter", "Histogram", "LOOKUP_SECONDS", "STORE_SECONDS", "RETRIEVE_SECONDS",
           "HISTOGRAMS", "COUNTER_NAMES", "MODEL_COUNTERS", "Event", "EventKind",
           "EVENT_KINDS", "kind_of", "LookupStart", "LookupEnd", "StoreStart", "StoreEnd",
           "RetrieveStart", "RetrieveEnd", "StoreError", "RetrieveError", "Clear"]
