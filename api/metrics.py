"""Prometheus metrics, read from shared memory at scrape time so every API worker reports the same.

The counters live in the event log's shared int64 counters (the data plane adds store and retrieve
counts there, the API lookup counts), and the gauges come from the store and fingerprint index. A
custom collector turns them into metric families on each scrape; nothing is kept per process, so
with ``--workers 4`` whichever worker answers the scrape gives the whole service's numbers.

The lookup latency histogram is kept the same way: one shared counter per bucket
(``lookup_seconds_bucket_<i>``, not cumulative) and the sum in microseconds.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shm.events import EventLog

if TYPE_CHECKING:
    from api.services import Services

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
_BUCKET = "lookup_seconds_bucket_"
_SUM_US = "lookup_seconds_sum_us"

HELP = {
    "lookups": "Lookups served.",
    "lookup_requested_tokens": "Tokens asked for by lookups (whole chunks only).",
    "lookup_hit_tokens": "Tokens covered by stored chunks in lookups.",
    "stores": "Store calls (store_pre_computed and store_final).",
    "store_chunks": "Chunks copied into the store.",
    "store_skipped_chunks": "Chunks a store found already stored.",
    "store_bytes": "KV bytes copied into the store.",
    "store_failures": "Store calls that failed.",
    "store_failed_chunks": "Chunks a store could not store.",
    "retrieves": "Retrieve calls.",
    "retrieve_chunks": "Chunks copied into engine buffers.",
    "retrieve_bytes": "KV bytes copied into engine buffers.",
    "retrieve_failures": "Retrieve calls that failed.",
    "retrieve_failed_chunks": "Chunks a retrieve could not deliver (evicted meanwhile).",
    "fingerprint_new_entries": "Fingerprint entries added.",
    "fingerprint_evicted_entries": "Fingerprint entries dropped because their chunk was evicted.",
    "fingerprint_not_indexed_chunks": "Chunks stored but not indexed: the fingerprint index was "
                                      "full of live entries (raise --fingerprint-capacity).",
    "dataplane_restarts": "Times the supervisor restarted the data plane.",
    "dataplane_errors": "Data-plane calls answered with an error.",
}


def count_lookup(events: EventLog, requested: int, hit: int, seconds: float) -> None:
    """Count one lookup, its tokens and its latency (one lock acquisition)."""
    events.add_many({"lookups": 1, "lookup_requested_tokens": requested,
                     "lookup_hit_tokens": hit,
                     _BUCKET + str(bisect.bisect_left(LATENCY_BUCKETS, seconds)): 1,
                     _SUM_US: int(seconds * 1e6)})


class SharedCollector(Collector):
    """Metric families built from the shared state of one service."""

    def __init__(self, services: "Services") -> None:
        self._services = services

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily | HistogramMetricFamily]:
        s = self._services
        counters = s.events.counters()
        yield from self._counters(counters)
        yield self._histogram(counters)
        st = s.store.stats()
        fp = s.fingerprints.stats()
        yield CounterMetricFamily("kvblend_evictions", "Chunks evicted from the store.",
                                  value=st.evictions)
        for name, doc, value in (
                ("kvblend_storage_used_bytes", "Slab bytes holding chunks.", st.used_bytes),
                ("kvblend_storage_capacity_bytes", "Slab budget.", st.capacity_bytes),
                ("kvblend_stored_chunks", "Committed chunk objects.", st.num_objects),
                ("kvblend_pinned_chunks", "Chunk objects pinned by retrieves.", st.num_pinned),
                ("kvblend_reserved_chunks", "Slots reserved by stores in flight.", st.num_reserved),
                ("kvblend_fingerprint_entries", "Fingerprint index entries.", fp["num_entries"]),
                ("kvblend_fingerprint_capacity", "Fingerprint index capacity.", fp["capacity"])):
            yield GaugeMetricFamily(name, doc, value=value)

    @staticmethod
    def _counters(counters: dict[str, int]) -> Iterator[CounterMetricFamily]:
        for name, value in sorted(counters.items()):
            if name.startswith(_BUCKET) or name == _SUM_US:
                continue
            yield CounterMetricFamily(f"kvblend_{name}", HELP.get(name, name.replace("_", " ")),
                                      value=value)

    @staticmethod
    def _histogram(counters: dict[str, int]) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for i, bound in enumerate((*LATENCY_BUCKETS, float("inf"))):
            cumulative += counters.get(_BUCKET + str(i), 0)
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(
            "kvblend_lookup_duration_seconds", "Time to serve a lookup, body parse to answer.",
            buckets=buckets, sum_value=counters.get(_SUM_US, 0) / 1e6)


def build_registry(services: "Services") -> CollectorRegistry:
    """A registry of this app alone (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SharedCollector(services))
    return registry
