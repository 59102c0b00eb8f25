"""Bearer-token auth: every /v1 route and /metrics, never the probes; the admin token."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvblend.api.lookup import OCTET_STREAM
from kvblend.api.openapi import schema
from kvblend.shm.hashing import Namespace
from tests.api.apps import ADMIN, bearer, serving
from tests.api.conftest import CHUNK, TOKEN, Cache, problem

PROTECTED = [("GET", "/v1/status"), ("GET", "/v1/instances"), ("GET", "/v1/instances/1"),
             ("DELETE", "/v1/instances/1"), ("POST", "/v1/instances"), ("POST", "/v1/lookup"),
             ("DELETE", "/v1/chunks"), ("GET", "/v1/events"), ("GET", "/metrics")]


@pytest.mark.parametrize("method,path", PROTECTED)
@pytest.mark.parametrize("header", [None, "Bearer wrong-token", f"Basic {TOKEN}",
                                    f"Bearer {TOKEN}x", "Bearer "])
def test_protected_routes_need_the_token(auth_client: TestClient, method: str, path: str,
                                         header: str | None) -> None:
    headers = {"authorization": header} if header is not None else {}
    r = auth_client.request(method, path, headers=headers)
    body = problem(r, 401)
    assert r.headers["www-authenticate"] == "Bearer"
    assert body["code"] == "unauthorized"


def test_right_token_is_admitted(auth_client: TestClient) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert auth_client.get("/v1/status", headers=headers).status_code == 200
    assert auth_client.get("/metrics", headers=headers).status_code == 200
    r = auth_client.post("/v1/lookup", headers=headers,
                         json={"model_name": "m", "token_ids": [1, 2, 3]})
    assert r.status_code == 200
    assert [r.status_code for r in lookups(auth_client, list(headers.items()))] == [200, 200]
    # without an admin token, the API token is the admin's for clearing
    assert auth_client.delete("/v1/chunks", headers=headers).status_code == 200


def test_probes_stay_open(auth_client: TestClient) -> None:
    assert auth_client.get("/healthz").status_code == 200
    assert auth_client.get("/readyz").status_code == 503  # open, but no data plane here


def test_without_a_token_everything_is_open(client: TestClient) -> None:
    assert client.get("/v1/status").status_code == 200
    assert client.get("/metrics").status_code == 200


# -- strict parsing: one header, ``Bearer <token>`` exactly --------------------------------------

@pytest.fixture
def admin_client(shm_prefix: str, cache: Cache) -> Iterator[TestClient]:
    with serving(shm_prefix, api_token=TOKEN, admin_token=ADMIN) as client:
        yield client


@pytest.fixture
def admin_only_client(shm_prefix: str, cache: Cache) -> Iterator[TestClient]:
    with serving(shm_prefix, admin_token=ADMIN) as client:
        yield client


def malformed(token: str) -> dict[str, list[tuple[str, str]]]:
    """Headers that carry ``token`` but not as exactly one ``Authorization: Bearer <token>``."""
    right = ("authorization", f"Bearer {token}")
    return {
        "two right headers": [right, right],
        "right then wrong": [right, ("authorization", "Bearer wrong-token")],
        "wrong then right": [("authorization", "Bearer wrong-token"), right],
        "right then empty": [right, ("authorization", "")],
        "two spaces": [("authorization", f"Bearer  {token}")],
        "trailing space": [("authorization", f"Bearer {token} ")],
        "trailing tab": [("authorization", f"Bearer {token}\t")],
        "leading space": [("authorization", f" Bearer {token}")],
        "tab for space": [("authorization", f"Bearer\t{token}")],
        "lower-case scheme": [("authorization", f"bearer {token}")],
        "upper-case scheme": [("authorization", f"BEARER {token}")],
        "two tokens": [("authorization", f"Bearer {token}, Bearer {token}")],
    }


def lookups(client: TestClient, headers: list[tuple[str, str]]) -> list[httpx.Response]:
    """A JSON and a binary lookup the fast path would serve, were the caller admitted."""
    return [client.post("/v1/lookup", headers=headers,
                        json={"model_name": "m", "token_ids": [1, 2, 3]}),
            client.post("/v1/lookup", headers=[*headers, ("content-type", OCTET_STREAM)],
                        params={"model_name": "m"}, content=b"\x01\x00\x00\x00" * 3)]


@pytest.mark.parametrize("form", list(malformed(TOKEN)))
@pytest.mark.parametrize("who", ["api", "admin"])
def test_malformed_authorization_is_401_everywhere(admin_client: TestClient, form: str,
                                                   who: str) -> None:
    """Not even the right token gets in unless it comes alone and spelled exactly."""
    headers = malformed(TOKEN if who == "api" else ADMIN)[form]
    responses = [admin_client.request(m, p, headers=headers) for m, p in PROTECTED]
    for r in responses + lookups(admin_client, headers):
        assert problem(r, 401)["code"] == "unauthorized", r.request.url


def test_two_headers_are_named_in_the_answer(auth_client: TestClient) -> None:
    r = auth_client.get("/v1/status", headers=malformed(TOKEN)["two right headers"])
    assert "one Authorization header" in problem(r, 401)["detail"]


# -- the admin token -----------------------------------------------------------------------------

def test_the_admin_token_is_admitted_wherever_the_api_token_is(admin_client: TestClient) -> None:
    for method, path in PROTECTED:
        r = admin_client.request(method, path, headers=bearer(ADMIN))
        assert r.status_code != 401, (method, path, r.text)
    admitted = lookups(admin_client, list(bearer(ADMIN).items()))
    assert [r.status_code for r in admitted] == [200, 200]


def stored_chunks(client: TestClient, token: str) -> int:
    return int(client.get("/v1/status", headers=bearer(token)).json()["storage"]["num_chunks"])


def test_clearing_needs_the_admin_token_when_one_is_set(admin_client: TestClient,
                                                        cache: Cache) -> None:
    cache.put(Namespace("model-a", 1), np.arange(2 * CHUNK, dtype=np.uint32))
    body = problem(admin_client.delete("/v1/chunks", headers=bearer(TOKEN)), 403)
    assert body["code"] == "admin_required"
    assert problem(admin_client.delete("/v1/chunks"), 401)["code"] == "unauthorized"
    for headers in malformed(ADMIN).values():
        problem(admin_client.delete("/v1/chunks", headers=headers), 401)
    assert stored_chunks(admin_client, TOKEN) == 2  # refused calls changed nothing
    r = admin_client.delete("/v1/chunks", headers=bearer(ADMIN))
    assert r.status_code == 200 and r.json()["chunks_removed"] == 2
    assert stored_chunks(admin_client, TOKEN) == 0


def test_admin_token_alone_guards_only_the_admin_operations(admin_only_client: TestClient,
                                                            cache: Cache) -> None:
    """With no API token the API is open, but clearing still needs the admin token."""
    cache.put(Namespace("model-a", 1), np.arange(CHUNK, dtype=np.uint32))
    assert admin_only_client.get("/v1/status").status_code == 200
    for headers in [{}, bearer("wrong-token"), *malformed(ADMIN).values()]:
        problem(admin_only_client.delete("/v1/chunks", headers=headers), 401)
    assert stored_chunks(admin_only_client, ADMIN) == 1
    assert admin_only_client.delete("/v1/chunks", headers=bearer(ADMIN)).status_code == 200


def test_openapi_keeps_the_bearer_scheme() -> None:
    doc = schema(TOKEN)
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    clear = doc["paths"]["/v1/chunks"]["delete"]
    assert clear["security"] == [{"bearer": []}] and {"401", "403"} <= set(clear["responses"])
