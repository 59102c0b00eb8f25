"""Bearer-token auth: every /v1 route and /metrics, never the probes."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import TOKEN, problem

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
    assert body["code"] == "Unauthorized"


def test_right_token_is_admitted(auth_client: TestClient) -> None:
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert auth_client.get("/v1/status", headers=headers).status_code == 200
    assert auth_client.get("/metrics", headers=headers).status_code == 200
    r = auth_client.post("/v1/lookup", headers=headers,
                         json={"model_name": "m", "token_ids": [1, 2, 3]})
    assert r.status_code == 200


def test_probes_stay_open(auth_client: TestClient) -> None:
    assert auth_client.get("/healthz").status_code == 200
    assert auth_client.get("/readyz").status_code == 503  # open, but no data plane here


def test_without_a_token_everything_is_open(client: TestClient) -> None:
    assert client.get("/v1/status").status_code == 200
    assert client.get("/metrics").status_code == 200
