"""``/metrics`` of a real ``kvblend serve`` after real stores, retrieves, lookups and a clear: the
latency histograms of the three calls, per-model counters for registered models only, the build
info, the API's and the data plane's process metrics, clear apart from evictions, and the whole
exposition accepted by ``promtool check metrics`` (Debian's prometheus package) where installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from tests.api.test_observability import samples
from tests.harness import Service, remove_prefix, unique_prefix

pytestmark = pytest.mark.slow

CHUNK = 256
MODEL = "metrics-model"


def start_time(pid: int) -> float:
    """A process's start, seconds since the epoch, as /proc tells it."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        ticks = float(f.read().split(b")")[-1].split()[19])
    with open("/proc/stat", "rb") as f:
        btime = next(float(line.split()[1]) for line in f if line.startswith(b"btime "))
    return ticks / os.sysconf("SC_CLK_TCK") + btime


@pytest.fixture(scope="module")
def scraped() -> Iterator[tuple[str, str, dict]]:
    """One service through its life: register, store, retrieve, look up, clear; the scrape text
    before the clear, after it, and the status."""
    prefix = unique_prefix()
    svc = Service(prefix)
    try:
        with BlendClient(svc.url) as client:
            kv = client.cpu_kv_buffer(num_layers=2, num_tokens=4 * CHUNK, hidden_dim=32,
                                      dtype=torch.float16)
            inst = client.register_kv_cache(kv, model_name=MODEL)
            kv.normal_()
            doc = np.arange(2 * CHUNK, dtype=np.uint32)
            assert client.store_pre_computed(inst, doc).wait(timeout=60).ok
            found = client.lookup(doc, model_name=MODEL)
            assert found.hit_tokens == 2 * CHUNK
            assert client.retrieve(inst, doc, found.matches, offset=2 * CHUNK).wait(timeout=60).ok
            assert client.lookup(doc, model_name="never-registered").hit_tokens == 0
            before = svc.http.get("/metrics").text
            status = svc.status()
            assert svc.http.delete("/v1/chunks").json()["chunks_removed"] == 2
            after = svc.http.get("/metrics").text
            client.unregister(inst)
        yield before, after, status
    finally:
        svc.stop()
        remove_prefix(prefix)


def test_store_retrieve_and_lookup_latencies_are_histograms(scraped: tuple[str, str, dict]) -> None:
    m = samples(scraped[0])
    for call, n in (("store", 1), ("retrieve", 1), ("lookup", 2)):
        assert m[f"kvblend_{call}_duration_seconds_count"] == n
        assert m[f"kvblend_{call}_duration_seconds_bucket{{le=+Inf}}"] == n
        assert m[f"kvblend_{call}_duration_seconds_sum"] > 0
    assert m["kvblend_lookup_hit_ratio"] == 0.5  # 2 chunks found of 4 asked for


def test_per_model_series_only_for_registered_models(scraped: tuple[str, str, dict]) -> None:
    m = samples(scraped[0])
    label = f"{{model={MODEL}}}"
    assert m[f"kvblend_model_store_chunks_total{label}"] == 2
    assert m[f"kvblend_model_retrieve_chunks_total{label}"] == 2
    assert m[f"kvblend_model_retrieve_bytes_total{label}"] == m["kvblend_retrieve_bytes_total"] > 0
    assert m[f"kvblend_model_lookups_total{label}"] == 1  # the other lookup named no such model
    assert m[f"kvblend_model_lookup_hit_tokens_total{label}"] == 2 * CHUNK
    assert m[f"kvblend_model_stored_chunks{label}"] == 2
    assert m[f"kvblend_model_stored_bytes{label}"] >= 2 * CHUNK * 2 * 2 * 32 * 2
    assert m["kvblend_lookups_total"] == 2
    assert not [k for k in m if "never-registered" in k]


def test_build_info_and_process_metrics_of_both_processes(scraped: tuple[str, str, dict]) -> None:
    before, _, status = scraped
    m = samples(before)
    info = [k for k in m if k.startswith("kvblend_build_info{")]
    assert len(info) == 1 and f"version={status['version']}" in info[0] and m[info[0]] == 1
    assert m["process_resident_memory_bytes"] > 0 and m["process_cpu_seconds_total"] > 0
    dataplane = status["dataplane"]["pid"]
    assert m["kvblend_dataplane_process_start_time_seconds"] == pytest.approx(
        start_time(dataplane), abs=0.02)
    assert m["kvblend_dataplane_process_resident_memory_bytes"] > 0


def test_clear_is_not_counted_as_evictions(scraped: tuple[str, str, dict]) -> None:
    m = samples(scraped[1])
    assert m["kvblend_cleared_chunks_total"] == 2
    assert m["kvblend_evictions_total"] == 0
    assert m[f"kvblend_model_evictions_total{{model={MODEL}}}"] == 0
    assert m["kvblend_stored_chunks"] == 0


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not installed (Debian: apt-get install prometheus)")
def test_promtool_accepts_the_exposition(scraped: tuple[str, str, dict]) -> None:
    for text in scraped[:2]:
        done = subprocess.run(["promtool", "check", "metrics"], input=text.encode(),
                              capture_output=True, timeout=60)
        assert done.returncode == 0, (done.stdout + done.stderr).decode()
