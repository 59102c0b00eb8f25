"""Prometheus metrics, read from shared memory at scrape time so every API worker reports the same.

The counters live in the event log's shared int64 counters (the data plane adds store and retrieve
counts there, the API lookup counts), and the gauges come from the store and fingerprint index. A
custom collector turns them into metric families on each scrape; nothing is kept per process, so
with ``--workers 4`` whichever worker answers the scrape gives the whole service's numbers.

Every counter declared in ``shm.telemetry`` is exported with its help text, 0 until first
counted. The latency histograms (lookup, store, retrieve) are kept the same way: one shared counter
per bucket (not cumulative) and the sum in microseconds (``shm.telemetry.HISTOGRAMS``).

Labels stay bounded: the only label is ``model``, on ``kvblend_model_*``, and a model gets one
only once an instance of it stored or retrieved (at most ``shm.events.MAX_MODELS``) or while the
store holds a layout class of it; a lookup naming any other model counts in the totals only.
"""

from __future__ import annotations

import platform
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    InfoMetricFamily, Metric)
from prometheus_client.registry import Collector

from kvblend.shm.events import EventLog
from kvblend.shm.records import StoreStats
from kvblend.shm.telemetry import HISTOGRAMS, LOOKUP_SECONDS, MODEL_COUNTERS, Counter, Histogram
from kvblend.shm.version import kvblend_version

if TYPE_CHECKING:
    from kvblend.api.services import Services


def count_lookup(events: EventLog, model: str, requested: int, hit: int, seconds: float) -> None:
    """Count one lookup, its tokens and its latency, and per model when ``model`` has a row (the
    models of registered instances)."""
    counts = {Counter.LOOKUPS: 1, Counter.LOOKUP_REQUESTED_TOKENS: requested,
              Counter.LOOKUP_HIT_TOKENS: hit}
    events.add_many({**counts, **LOOKUP_SECONDS.observe(seconds)})
    events.add_model(model, counts)


class SharedCollector(Collector):
    """Metric families built from the shared state of one service."""

    def __init__(self, services: "Services") -> None:
        self._services = services

    def collect(self) -> Iterator[Metric]:
        s = self._services
        counters = s.events.counters()
        yield from self._counters(counters)
        for h in HISTOGRAMS:
            yield self._histogram(h, counters)
        requested = counters.get(Counter.LOOKUP_REQUESTED_TOKENS, 0)
        yield GaugeMetricFamily(
            "kvblend_lookup_hit_ratio", "Share of the tokens asked for by lookups that stored "
            "chunks covered, since the counters began (over a window: the rate of "
            "kvblend_lookup_hit_tokens_total over that of kvblend_lookup_requested_tokens_total).",
            value=counters.get(Counter.LOOKUP_HIT_TOKENS, 0) / requested if requested else 0.0)
        st = s.store.stats()
        fp = s.fingerprints.stats()
        yield CounterMetricFamily("kvblend_evictions", "Chunks evicted from the store to make room "
                                  "(clear is counted in kvblend_cleared_chunks_total).",
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
        if s.remotes is not None:
            yield GaugeMetricFamily("kvblend_remote_known_chunks", "Entries of the table of chunk "
                                    "shards other hosts stored in the remote tier (expired ones "
                                    "not yet reclaimed included).", value=len(s.remotes))
        yield from self._per_model(s.events.model_counters(), st)
        info = InfoMetricFamily("kvblend_build", "The running kvblend's version.")
        info.add_metric([], {"version": kvblend_version(),
                             "python": platform.python_version()})
        yield info

    @staticmethod
    def _counters(counters: dict[str, int]) -> Iterator[CounterMetricFamily]:
        for counter in sorted(Counter):
            yield CounterMetricFamily(f"kvblend_{counter}", counter.help,
                                      value=counters.get(counter, 0))

    @staticmethod
    def _per_model(models: dict[str, dict[str, int]], st: StoreStats) -> Iterator[Metric]:
        """Per-model families, labelled ``model``: the counters of ``MODEL_COUNTERS`` for the
        models of registered instances (at most ``shm.events.MAX_MODELS``), and what the store
        holds for each model it has a layout class of (bounded by the class table)."""
        for counter in MODEL_COUNTERS:
            family = CounterMetricFamily(f"kvblend_model_{counter}", f"{counter.help} Per model.",
                                         labels=["model"])
            for model, values in sorted(models.items()):
                family.add_metric([model], values[counter])
            yield family
        held: dict[str, list[int]] = {}
        for c in st.classes:
            row = held.setdefault(c.chunk_class.model_name, [0, 0, 0])
            row[0] += c.objects
            row[1] += c.objects * c.slot_bytes
            row[2] += c.evictions
        chunks = GaugeMetricFamily("kvblend_model_stored_chunks", "Committed chunk objects of "
                                   "the model.", labels=["model"])
        nbytes = GaugeMetricFamily("kvblend_model_stored_bytes", "Slot bytes of the model's "
                                   "committed chunks.", labels=["model"])
        evictions = CounterMetricFamily("kvblend_model_evictions", "Chunks of the model evicted "
                                        "to make room, while its layout class lived.",
                                        labels=["model"])
        for model, (n, b, e) in sorted(held.items()):
            chunks.add_metric([model], n)
            nbytes.add_metric([model], b)
            evictions.add_metric([model], e)
        yield from (chunks, nbytes, evictions)

    @staticmethod
    def _histogram(h: Histogram, counters: dict[str, int]) -> HistogramMetricFamily:
        cumulative, buckets = 0, []
        for name, bound in zip(h.buckets, (*h.bounds, float("inf"))):
            cumulative += counters.get(name, 0)
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        return HistogramMetricFamily(f"kvblend_{h.name.removesuffix('_seconds')}_duration_seconds",
                                     h.help, buckets=buckets, sum_value=counters.get(h.sum_us, 0) / 1e6)


def build_registry(services: "Services") -> CollectorRegistry:
    """A registry of this app alone (never the process-global one): the shared state, this API
    worker's process (``process_*``) and the data plane's (``kvblend_dataplane_process_*``, absent
    while it does not answer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SharedCollector(services))
    ProcessCollector(registry=registry)

    def dataplane_pid() -> str:
        ping = services.dataplane.ping()
        return str(ping.pid) if ping is not None else "-"  # no such /proc entry: nothing exported

    ProcessCollector(namespace="kvblend_dataplane", pid=dataplane_pid, registry=registry)
    return registry
