"""``/metrics`` and ``/v1/events``: read from shared memory, so every worker reports the same."""

from __future__ import annotations

import numpy as np
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvblend.api.app import create_app
from kvblend.shm.events import EventLog
from kvblend.shm.hashing import Namespace
from kvblend.shm.telemetry import StoreError
from tests.api.apps import ADMIN, bearer, serving
from tests.api.conftest import CHUNK, TOKEN, Cache, make_settings, problem


def samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def lookup(client: TestClient, tokens: np.ndarray, request_id: str) -> None:
    r = client.post("/v1/lookup", json={"model_name": "model-a", "token_ids": tokens.tolist()},
                    headers={"x-request-id": request_id})
    assert r.status_code == 200


def test_metrics_reflect_lookups_and_storage(client: TestClient, cache: Cache) -> None:
    tokens = np.arange(4 * CHUNK, dtype=np.uint32)
    cache.put(Namespace("model-a", 1), tokens[:2 * CHUNK])
    lookup(client, tokens, "r1")
    lookup(client, tokens[:CHUNK + 3], "r2")
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = samples(r.text)
    assert m["kvblend_lookups_total"] == 2
    assert m["kvblend_lookup_requested_tokens_total"] == 5 * CHUNK
    assert m["kvblend_lookup_hit_tokens_total"] == 3 * CHUNK
    assert m["kvblend_lookup_duration_seconds_count"] == 2
    assert m["kvblend_lookup_duration_seconds_bucket{le=+Inf}"] == 2
    assert m["kvblend_lookup_duration_seconds_sum"] > 0
    assert m["kvblend_stored_chunks"] == 2 and m["kvblend_pinned_chunks"] == 0
    assert m["kvblend_storage_used_bytes"] > 0
    assert m["kvblend_storage_capacity_bytes"] == cache.store.size
    assert m["kvblend_fingerprint_entries"] == 2
    for name in ("stores", "store_chunks", "store_bytes", "store_failures", "retrieves",
                 "retrieve_chunks", "retrieve_bytes", "retrieve_failures", "dataplane_restarts"):
        assert m[f"kvblend_{name}_total"] == 0
    assert m["kvblend_evictions_total"] == 0


def test_two_apps_on_one_prefix_agree(shm_prefix: str, client: TestClient, cache: Cache) -> None:
    """Two API workers share counters: what one counts, the other reports."""
    with TestClient(create_app(make_settings(shm_prefix))) as other:
        lookup(other, np.arange(CHUNK, dtype=np.uint32), "from-other")
        events = EventLog.open(shm_prefix)
        events.add("store_chunks", 5)  # as the data plane does
        events.close()
        assert samples(client.get("/metrics").text)["kvblend_lookups_total"] == 1
        assert samples(other.get("/metrics").text)["kvblend_store_chunks_total"] == 5


def test_events_hold_lookups_with_their_request_ids(client: TestClient, cache: Cache) -> None:
    tokens = np.arange(2 * CHUNK, dtype=np.uint32)
    cache.put(Namespace("model-a", 1), tokens)
    lookup(client, tokens, "req-7")
    events = client.get("/v1/events").json()["events"]
    start, end = events[-2], events[-1]
    assert start["kind"] == "lookup_start" and end["kind"] == "lookup_end"
    assert start["request_id"] == end["request_id"] == "req-7"  # no token: everyone is admin
    assert start["model_name"] == "model-a"
    assert start["num_tokens"] == 2 * CHUNK
    assert end["hit_tokens"] == 2 * CHUNK and end["num_chunks"] == 2
    assert end["duration_ms"] >= 0 and end["seq"] == start["seq"] + 1


def test_events_limit_and_kind_filter(client: TestClient) -> None:
    for i in range(5):
        lookup(client, np.arange(3, dtype=np.uint32), f"q{i}")
    last = client.get("/v1/events", params={"limit": 3}).json()["events"]
    assert len(last) == 3 and last[-1]["request_id"] == "q4"
    ends = client.get("/v1/events", params={"kind": "lookup_end", "limit": 2}).json()["events"]
    assert [e["request_id"] for e in ends] == ["q3", "q4"]
    assert client.get("/v1/events", params={"limit": 0}).status_code == 422


# -- who sees who asked: request ids and model names are the admin's ------------------------------

SECRET_ID, SECRET_MODEL = "tenant-a-req-1", "tenant-a/secret-model"


def lookup_as(client: TestClient, token: str | None) -> None:
    headers = {"x-request-id": SECRET_ID, **(bearer(token) if token else {})}
    r = client.post("/v1/lookup", headers=headers,
                    json={"model_name": SECRET_MODEL, "token_ids": list(range(2 * CHUNK))})
    assert r.status_code == 200, r.text


def events_as(client: TestClient, token: str | None, **params: object) -> list[dict]:
    r = client.get("/v1/events", headers=bearer(token) if token else {}, params=params)
    assert r.status_code == 200, r.text
    events: list[dict] = r.json()["events"]
    assert events
    return events


def assert_redacted(client: TestClient, token: str | None) -> None:
    for params in ({}, {"kind": "lookup_start"}, {"limit": 1}):
        events = events_as(client, token, **params)
        assert all(e["request_id"] is None and e["model_name"] is None for e in events), events
        assert SECRET_ID not in str(events) and SECRET_MODEL not in str(events)


def assert_visible(client: TestClient, token: str | None) -> None:
    start = events_as(client, token, kind="lookup_start")[-1]
    assert start["request_id"] == SECRET_ID and start["model_name"] == SECRET_MODEL


def test_events_hide_who_asked_from_api_token_holders(shm_prefix: str, cache: Cache) -> None:
    with serving(shm_prefix, api_token=TOKEN, admin_token=ADMIN) as client:
        lookup_as(client, TOKEN)
        assert_redacted(client, TOKEN)
        assert_visible(client, ADMIN)
        problem(client.get("/v1/events", headers=[("authorization", f"Bearer {ADMIN}")] * 2), 401)


def test_with_only_an_api_token_nobody_sees_who_asked(auth_client: TestClient) -> None:
    lookup_as(auth_client, TOKEN)
    assert_redacted(auth_client, TOKEN)


def test_with_only_an_admin_token_the_open_api_is_redacted(shm_prefix: str, cache: Cache) -> None:
    with serving(shm_prefix, admin_token=ADMIN) as client:
        lookup_as(client, None)
        assert_redacted(client, None)
        assert_redacted(client, "wrong-token")
        assert_visible(client, ADMIN)


def test_error_texts_are_redacted_too(shm_prefix: str, cache: Cache) -> None:
    events = EventLog.open(shm_prefix)
    events.record(StoreError(request_id="r-9", instance_id=3,
                             error="LayoutMismatch(\"model 'tenant-secret' is stored with L=2\")"))
    events.close()
    with serving(shm_prefix, api_token=TOKEN, admin_token=ADMIN) as client:
        def error_seen(token: str) -> object:
            got = client.get("/v1/events?kind=store_error", headers=bearer(token)).json()
            return got["events"][-1]["error"]
        assert error_seen(TOKEN) is None
        assert "tenant-secret" in str(error_seen(ADMIN))
