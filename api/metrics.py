"""Prometheus metrics, read from shared memory at scrape time so every API worker reports the same.

The counters live in the event log's shared int64 counters (the data plane adds store and retrieve
counts there, the API lookup counts), and the gauges come from the store and fingerprint index. A
custom collector turns them into metric families on each scrape; nothing is kept per process, so
with ``--workers 4`` whichever worker answers the scrape gives the whole service's numbers.

Every counter declared in ``shm.telemetry`` is exported with its help text, 0 until first
counted. The lookup latency histogram is kept the same way: one shared counter per bucket (not
cumulative) and the sum in microseconds (``shm.telemetry.LOOKUP_SECONDS``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from shm.events import EventLog
from shm.telemetry import LOOKUP_SECONDS, Counter

if TYPE_CHECKING:
    from api.services import Services


def count_lookup(events: EventLog, requested: int, hit: int, seconds: float) -> None:
    """Count one lookup, its tokens and its latency (one lock acquisition)."""
    events.add_many({Counter.LOOKUPS: 1, Counter.LOOKUP_REQUESTED_TOKENS: requested,
                     Counter.LOOKUP_HIT_TOKENS: hit, **LOOKUP_SECONDS.observe(seconds)})


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
        for counter in sorted(Counter):
            yield CounterMetricFamily(f"kvblend_{counter}", counter.help,
                                      value=counters.get(counter, 0))

    @staticmethod
    def _histogram(counters: dict[str, int]) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        h = LOOKUP_SECONDS
        for name, bound in zip(h.buckets, (*h.bounds, float("inf"))):
            cumulative += counters.get(name, 0)
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily("kvblend_lookup_duration_seconds", h.help, buckets=buckets,
                                     sum_value=counters.get(h.sum_us, 0) / 1e6)


def build_registry(services: "Services") -> CollectorRegistry:
    """A registry of this app alone (never the process-global one)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SharedCollector(services))
    return registry
