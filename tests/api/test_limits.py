"""The request body limit (``api.limits``): 413 problem+json, before any side effect, never
reading much past the limit, on every route and in front of the lookup fast path."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvblend.api.lookup import OCTET_STREAM
from kvblend.api.openapi import schema
from kvblend.shm.hashing import Namespace
from tests.api.apps import bearer, serving
from tests.api.conftest import CHUNK, TOKEN, Cache, problem

KB = 64
LIMIT = KB * 1024
PIECE = 16 * 1024
ROUTES = [("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/v1/status"),
          ("GET", "/v1/instances"), ("POST", "/v1/instances"), ("GET", "/v1/instances/1"),
          ("DELETE", "/v1/instances/1"), ("POST", "/v1/lookup"), ("DELETE", "/v1/chunks"),
          ("GET", "/v1/events"), ("GET", "/metrics"), ("GET", "/openapi.json")]


@pytest.fixture
def small(shm_prefix: str, cache: Cache) -> Iterator[TestClient]:
    """A service that takes bodies of at most 64 KiB, behind the API token."""
    with serving(shm_prefix, api_token=TOKEN, max_request_kb=KB) as client:
        client.headers.update(bearer(TOKEN))
        yield client


def too_large(response: httpx.Response) -> None:
    body = problem(response, 413)
    assert body["code"] == "payload_too_large" and str(LIMIT) in body["detail"]
    assert response.headers["connection"] == "close"


def lookup_events(client: TestClient) -> list[dict]:
    return [e for e in client.get("/v1/events").json()["events"] if e["kind"].startswith("lookup")]


@pytest.mark.parametrize("method,path", ROUTES)
def test_a_declared_oversize_body_is_refused_before_the_app(small: TestClient, method: str,
                                                            path: str) -> None:
    """The declared length alone is enough: the route never runs, whatever it is."""
    headers = {"content-length": str(LIMIT + 1)}
    too_large(small.request(method, path, content=b"{}", headers=headers))
    too_large(small.request(method, path, content=b"{}", headers={"content-length": "9" * 40}))


def test_a_refused_clear_clears_nothing(small: TestClient, cache: Cache) -> None:
    cache.put(Namespace("model-a", 1), np.arange(2 * CHUNK, dtype=np.uint32))
    too_large(small.delete("/v1/chunks", headers={"content-length": str(LIMIT + 1)}))
    assert small.get("/v1/status").json()["storage"]["num_chunks"] == 2


def test_the_limit_is_inclusive_on_the_fast_path(small: TestClient) -> None:
    """A binary lookup of exactly the limit is served; four bytes more are 413 and no lookup."""
    at_limit = np.zeros(LIMIT // 4, dtype="<u4").tobytes()
    served = small.post("/v1/lookup", params={"model_name": "m"}, content=at_limit,
                        headers={"content-type": OCTET_STREAM})
    assert served.status_code == 200 and served.json()["requested_tokens"] == LIMIT // 4
    assert len(lookup_events(small)) == 2
    too_large(small.post("/v1/lookup", params={"model_name": "m"}, content=at_limit + b"\0" * 4,
                         headers={"content-type": OCTET_STREAM}))
    assert len(lookup_events(small)) == 2


def padded_json(size: int) -> bytes:
    """A valid JSON lookup of exactly ``size`` bytes (padded with whitespace)."""
    body = b'{"model_name": "m", "token_ids": [1, 2, 3]}'
    return body + b" " * (size - len(body))


@pytest.mark.parametrize("ctype", ["application/json", "application/vnd.kvblend+json"])
def test_an_oversize_json_lookup_is_413(small: TestClient, ctype: str) -> None:
    """The fast path (plain JSON) and the route (a type the fast path leaves) alike."""
    assert small.post("/v1/lookup", content=padded_json(LIMIT),
                      headers={"content-type": ctype}).status_code == 200
    too_large(small.post("/v1/lookup", content=padded_json(LIMIT + 1),
                         headers={"content-type": ctype}))
    assert len(lookup_events(small)) == 2  # only the one served


def chunked(body: bytes) -> Iterator[bytes]:
    """``body`` as a chunked upload: no Content-Length, so only counting can bound it."""
    for at in range(0, len(body), PIECE):
        yield body[at:at + PIECE]


@pytest.mark.parametrize("path,ctype,params", [
    ("/v1/lookup", OCTET_STREAM, {"model_name": "m"}),                   # the fast path
    ("/v1/lookup", "application/json", {}),                              # the fast path
    ("/v1/lookup", "application/vnd.kvblend+json", {}),                  # the route
    ("/v1/instances", "application/json", {}),                           # FastAPI's own parser
])
def test_an_oversize_chunked_body_is_counted(small: TestClient, path: str, ctype: str,
                                             params: dict) -> None:
    body = padded_json(LIMIT + 1) if "json" in ctype else b"\0" * (LIMIT + 4)
    r = small.post(path, params=params, content=chunked(body), headers={"content-type": ctype})
    assert "content-length" not in r.request.headers
    too_large(r)
    assert lookup_events(small) == []


async def streamed(app: object, path: str, ctype: str, params: dict, pieces: int
                   ) -> tuple[httpx.Response, int]:
    """POST ``pieces`` pieces of PIECE bytes, handed over one at a time as the app asks; returns
    the answer and how many pieces the app took."""
    taken = 0

    async def upload() -> AsyncIterator[bytes]:
        nonlocal taken
        for _ in range(pieces):
            taken += 1
            yield b" " * PIECE

    transport = httpx.ASGITransport(app=app)  # type: ignore[arg-type]
    async with httpx.AsyncClient(transport=transport, base_url="http://kvblend") as client:
        r = await client.post(path, params=params, content=upload(),
                              headers={"content-type": ctype, **bearer(TOKEN)})
    return r, taken


@pytest.mark.parametrize("path,ctype,params", [
    ("/v1/lookup", OCTET_STREAM, {"model_name": "m"}),
    ("/v1/lookup", "application/vnd.kvblend+json", {}),
    ("/v1/instances", "application/json", {}),
])
def test_reading_stops_at_the_limit(small: TestClient, path: str, ctype: str,
                                    params: dict) -> None:
    """A 4 MiB upload is cut off after the piece that crosses 64 KiB: nothing buffers it."""
    r, taken = asyncio.run(streamed(small.app, path, ctype, params, pieces=256))
    too_large(r)
    assert taken == LIMIT // PIECE + 1


def test_the_default_limit_serves_a_large_lookup(shm_prefix: str, cache: Cache) -> None:
    """8 MiB by default: a 1 M-token binary lookup (4 MiB) passes, 8 MiB and 4 bytes do not."""
    with serving(shm_prefix) as client:
        ids = np.zeros(1 << 20, dtype="<u4").tobytes()
        r = client.post("/v1/lookup", params={"model_name": "m"}, content=ids,
                        headers={"content-type": OCTET_STREAM})
        assert r.status_code == 200
        r = client.post("/v1/lookup", params={"model_name": "m"}, content=b"\0" * (8 << 20 | 4),
                        headers={"content-type": OCTET_STREAM})
        assert problem(r, 413)["code"] == "payload_too_large"


def test_every_operation_with_a_body_documents_413() -> None:
    ops = [op for item in schema()["paths"].values() for op in item.values()
           if "requestBody" in op]
    assert {op["operationId"] for op in ops} >= {"lookup", "registerInstance"}
    for op in ops:
        doc = op["responses"]["413"]
        assert doc["content"] == {"application/problem+json": {
            "schema": {"$ref": "#/components/schemas/Problem"}}}, op["operationId"]
