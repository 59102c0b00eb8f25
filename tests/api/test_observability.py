"""``/metrics`` and ``/v1/events``: read from shared memory, so every worker reports the same.
``X-Request-ID`` on every answer and in the log; ``HEAD`` wherever ``GET`` is served."""

from __future__ import annotations

import logging
import re

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from kvblend.api.app import create_app
from kvblend.api.requestid import MAX_LENGTH
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


# -- X-Request-ID: on every answer, the caller's when fit, else fresh -----------------------------

FIT_IDS = ["r", "req-7", "a b", "~" * MAX_LENGTH, "0123abcd-ef45-6789-abcd-ef0123456789"]
UNFIT_IDS = [b"", b" leading", b"trailing ", b"x" * (MAX_LENGTH + 1), b"tab\there", b"nul\x00",
             b"caf\xc3\xa9", b"\xff"]


def every_kind_of_answer(client: TestClient, headers: list[tuple[bytes, bytes]]
                         ) -> list[httpx.Response]:
    """A 200 of a route and of the lookup fast path, a 404, a 405, a 413, a 422, a 503, a HEAD."""
    lookup_body = {"model_name": "m", "token_ids": [1, 2, 3]}
    return [client.get("/healthz", headers=headers),
            client.post("/v1/lookup", json=lookup_body, headers=headers),
            client.get("/v1/nothing", headers=headers),
            client.put("/v1/status", headers=headers),
            client.post("/v1/lookup", content=b"0" * (64 * 1024 + 1), headers=headers),
            client.post("/v1/lookup", json={"token_ids": [-1]}, headers=headers),
            client.get("/readyz", headers=headers),
            client.head("/metrics", headers=headers)]


@pytest.mark.parametrize("rid", FIT_IDS)
def test_a_fit_request_id_comes_back_on_every_answer(shm_prefix: str, cache: Cache,
                                                     rid: str) -> None:
    with serving(shm_prefix, max_request_kb=64) as client:
        answers = every_kind_of_answer(client, [(b"x-request-id", rid.encode())])
        assert [r.headers.get_list("x-request-id") for r in answers] == [[rid]] * len(answers)
        assert {r.status_code for r in answers} == {200, 404, 405, 413, 422, 503}


@pytest.mark.parametrize("raw", [[], *([v] for v in UNFIT_IDS), [b"a", b"b"]],
                         ids=lambda raw: repr(raw)[:20])
def test_an_absent_or_unfit_request_id_is_replaced(shm_prefix: str, cache: Cache,
                                                   raw: list[bytes]) -> None:
    with serving(shm_prefix, max_request_kb=64) as client:
        answers = every_kind_of_answer(client, [(b"x-request-id", v) for v in raw])
        given = [r.headers.get_list("x-request-id") for r in answers]
        assert all(len(ids) == 1 and re.fullmatch("[0-9a-f]{32}", ids[0]) for ids in given), given
        assert len({ids[0] for ids in given}) == len(answers)  # one fresh id per request


def test_the_events_and_the_answer_name_the_same_id(client: TestClient) -> None:
    r = client.post("/v1/lookup", json={"model_name": "m", "token_ids": [1, 2]},
                    headers={"x-request-id": "x" * (MAX_LENGTH + 1)})
    start, end = client.get("/v1/events", params={"limit": 2}).json()["events"]
    assert start["request_id"] == end["request_id"] == r.headers["x-request-id"]


def test_the_log_line_of_a_failed_request_names_its_id(shm_prefix: str, cache: Cache,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    with serving(shm_prefix) as client:

        @client.app.get("/test-bug")  # type: ignore[attr-defined]
        def bug() -> None:
            raise RuntimeError("a bug")

        with caplog.at_level(logging.ERROR, logger="kvblend.api"):
            given = client.get("/test-bug", headers={"x-request-id": "req-42"})
            fresh = client.get("/test-bug")
    assert problem(given, 500)["code"] == "internal_error"
    assert given.headers["x-request-id"] == "req-42"
    lines = [(r.getMessage(), getattr(r, "request_id", None)) for r in caplog.records
             if r.name == "kvblend.api"]
    rid = fresh.headers["x-request-id"]
    assert lines == [("GET /test-bug failed (request id req-42)", "req-42"),
                     (f"GET /test-bug failed (request id {rid})", rid)]


# -- HEAD wherever GET is served ------------------------------------------------------------------

def get_paths(client: TestClient) -> list[str]:
    """Every path the app serves GET at: the documented operations and the API's docs pages."""
    paths = [p.replace("{instance_id}", "1") for p, item in
             client.get("/openapi.json").json()["paths"].items() if "get" in item]
    return [*paths, "/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui.css"]


def test_head_answers_as_get_does_without_a_body(client: TestClient) -> None:
    paths = get_paths(client)
    assert {"/healthz", "/readyz", "/metrics", "/v1/status", "/v1/events"} <= set(paths)
    for path in paths:
        got, head = client.get(path), client.head(path)
        assert head.status_code == got.status_code, path
        assert head.headers["content-type"] == got.headers["content-type"], path
        assert head.content == b"", path
    allow = client.put("/metrics").headers["allow"]
    assert allow == "GET, HEAD"


def test_head_needs_the_token_where_get_does(auth_client: TestClient) -> None:
    for path in ("/metrics", "/v1/status", "/v1/events", "/v1/instances"):
        assert auth_client.head(path).status_code == 401, path
        assert auth_client.head(path, headers=bearer(TOKEN)).status_code in (200, 503), path
    assert auth_client.head("/healthz").status_code == 200
