"""The kvblend connector's counters in vLLM's own stats: its log line and its Prometheus metrics.

This module runs inside vLLM's processes. It owns the counters a worker-side connector keeps
between two of vLLM's stats collections (``KVBlendStats``) and the Prometheus counters they feed
(``KVBlendPromMetrics``, named ``vllm:kvblend_<counter>_total``, labelled as vLLM labels its own
metrics). vLLM collects the worker's counters each step (``get_kv_connector_stats``), sums them
over workers and steps (``aggregate``), logs them (``reduce``) and hands them to the Prometheus
side (``observe``); with ``disable_log_stats`` it does none of that.

    counter           what it counts
    loads             requests whose claimed KV was loaded (prefix or blend mode)
    loaded_tokens     positions the connector filled (chunks loaded, gaps computed)
    gap_tokens        of those, positions no stored chunk covered, computed by the blend loop
    recomputed_rows   rows the blend loop computed, summed over layers (gaps included)
    blend_layers      layers the blend loop ran, summed over requests
    load_errors       blocks reported to vLLM as not loaded (vLLM recomputed them)
    stores            prompt stores issued
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

COUNTERS = ("loads", "loaded_tokens", "gap_tokens", "recomputed_rows", "blend_layers",
            "load_errors", "stores")


def _zero() -> dict[str, Any]:
    return dict.fromkeys(COUNTERS, 0)


@dataclass
class KVBlendStats(KVConnectorStats):
    """Counters since vLLM last collected them (module docstring)."""

    data: dict[str, Any] = field(default_factory=_zero)

    def add(self, **counts: int) -> None:
        for name, n in counts.items():
            self.data[name] = self.data.get(name, 0) + int(n)

    def reset(self) -> None:
        self.data = _zero()

    def aggregate(self, other: KVConnectorStats) -> "KVBlendStats":
        self.add(**{k: v for k, v in other.data.items() if k in COUNTERS})
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.get(k, 0) for k in COUNTERS)


class KVBlendPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per entry of ``COUNTERS``, per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in COUNTERS:
            metric = self._counter_cls(name=f"vllm:kvblend_{name}",
                                       documentation=f"kvblend connector: {name.replace('_', ' ')}",
                                       labelnames=labelnames)
            self.counters[name] = {idx: metric.labels(*values)
                                   for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, by_engine in self.counters.items():
            n = transfer_stats_data.get(name, 0)
            if n:
                by_engine[engine_idx].inc(n)


__all__ = ["COUNTERS", "KVBlendPromMetrics", "KVBlendStats"]
