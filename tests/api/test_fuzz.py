"""Schema fuzzing: what schemathesis found, each pinned by a test, and the bounded fuzz run of CI.

The findings (issue 9, item 4): a body that is not valid JSON answered 400, a status the schema
does not list; a 405 named one route's methods in ``Allow`` where the path serves several; the
schema of a service without a token declared bearer auth on every route; an ``X-Instance-Token``
the schema admits (up to 64 characters) failed in the data plane's decoder.

The fuzz run starts the whole service (``kvblend serve``: supervisor, data plane, API) on the
test's prefix, open and with tokens, and runs schemathesis against its live ``/openapi.json``
with every check: no 5xx, no response off the schema, no error line in the service's log.
Generation is derandomized, so CI runs the same requests every time. The long run of
docs/fuzzing.md is ``python -m tests.api.fuzzing``, outside CI.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvblend.api.app import create_app
from kvblend.dataplane.messages import TOKEN_HEX
from tests.api.apps import ADMIN, bearer, serving
from tests.api.conftest import TOKEN, Cache, make_settings, problem
from tests.api.fuzzing import engine, fuzz, fuzz_service, logged_errors
from tests.dataplane.conftest import CHUNK, create_store, start_dataplane
from tests.harness import poll

COMMITTED = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")
INVALID_JSON = [
    b"\xff\xfe{",                 # not UTF-8
    b'{"model_name": ',          # truncated
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
]
CI_EXAMPLES = 200   # per operation and phase: about a minute a run on 2 cores
CI_TIMEOUT = 600.0  # a hang guard only


def concrete(path: str) -> str:
    """A request path for a schema path: every parameter set to 1."""
    return path.replace("{instance_id}", "1")


@pytest.fixture
def live_client(shm_prefix: str) -> Iterator[TestClient]:
    """The real app through its lifespan, with a real data plane on the test's prefix."""
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix)
    try:
        with serving(shm_prefix, chunk_size=CHUNK, fingerprint_capacity=4096,
                     dataplane_socket=dp.address) as client:
            poll(lambda: client.get("/readyz").status_code == 200, 30.0, "/readyz")
            yield client
    finally:
        assert dp.stop() == 0


# -- malformed JSON: 422 problem+json, the status every body route documents ---------------------

@pytest.mark.parametrize("body", INVALID_JSON, ids=["not-utf8", "truncated", "too-deep"])
@pytest.mark.parametrize("path", ["/v1/instances", "/v1/lookup"])
def test_a_body_that_is_not_json_is_a_422(client: TestClient, path: str, body: bytes) -> None:
    got = problem(client.post(path, content=body, headers={"content-type": "application/json"}),
                  422)
    assert got["errors"] and got["errors"][0]["loc"][:1] in ([], ["body"])


def test_every_body_route_documents_422_and_no_route_400() -> None:
    schema = create_app(make_settings("kvbt_schema_only")).openapi()
    for path, item in schema["paths"].items():
        for method, op in item.items():
            assert "400" not in op["responses"], f"{method} {path}"
            if "requestBody" in op:
                assert "422" in op["responses"], f"{method} {path}"


# -- 405: Allow names every method the path serves -----------------------------------------------

def test_options_on_an_instance_allows_get_and_delete(client: TestClient) -> None:
    response = client.options("/v1/instances/1")
    problem(response, 405)
    assert sorted(response.headers["allow"].split(", ")) == ["DELETE", "GET", "HEAD"]


def test_every_405_allows_exactly_the_documented_methods(client: TestClient) -> None:
    """The documented methods, and HEAD wherever GET is (the description says so)."""
    for path, item in client.get("/openapi.json").json()["paths"].items():
        served = {m.upper() for m in item} | ({"HEAD"} if "get" in item else set())
        for method in sorted(set(METHODS) - served):
            response = client.request(method, concrete(path))
            assert response.status_code == 405, (method, path)
            assert set(response.headers["allow"].split(", ")) == served, (method, path)


# -- bearer auth in the schema only where a token is configured ----------------------------------

def _security(schema: dict) -> dict[str, list]:
    return {op["operationId"]: op.get("security", []) for item in schema["paths"].values()
            for op in item.values()}


def test_an_open_service_declares_no_bearer_auth(client: TestClient) -> None:
    for schema in (client.get("/openapi.json").json(), json.loads(COMMITTED.read_text())):
        assert "securitySchemes" not in schema["components"]
        assert all("bearer" not in req for reqs in _security(schema).values() for req in reqs)


def test_a_token_service_declares_bearer_auth_on_every_guarded_route(auth_client: TestClient
                                                                       ) -> None:
    schema = auth_client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for op_id, security in _security(schema).items():
        open_route = op_id in ("healthz", "readyz")
        assert security == ([] if open_route else [{"bearer": []}]), op_id


def test_with_only_an_admin_token_only_clearing_needs_it(shm_prefix: str, cache: Cache) -> None:
    schema = create_app(make_settings(shm_prefix, admin_token=ADMIN)).openapi()
    security = _security(schema)
    assert security.pop("clearChunks") == [{"bearer": []}]
    assert security.pop("healthz") == security.pop("readyz") == []
    assert all(s == [{}, {"bearer": []}] for s in security.values()), security
    with serving(shm_prefix, admin_token=ADMIN) as client:  # and the service agrees
        problem(client.delete("/v1/chunks"), 401)
        assert client.delete("/v1/chunks", headers=bearer(ADMIN)).status_code == 200
        assert client.get("/v1/status").status_code == 200


# -- X-Instance-Token: the schema admits what the data plane decodes -----------------------------

def test_an_instance_token_longer_than_any_token_is_refused_at_the_edge(client: TestClient
                                                                         ) -> None:
    op = client.get("/openapi.json").json()["paths"]["/v1/instances/{instance_id}"]["delete"]
    header = next(p for p in op["parameters"] if p["name"] == "X-Instance-Token")
    assert header["schema"]["maxLength"] == TOKEN_HEX
    body = problem(client.delete("/v1/instances/1",
                                 headers={"X-Instance-Token": "a" * (TOKEN_HEX + 1)}), 422)
    assert body["errors"][0]["loc"] == ["header", "X-Instance-Token"]


# -- found by the long run -----------------------------------------------------------------------

@pytest.mark.slow
def test_a_cuda_offset_past_any_buffer_is_a_422(live_client: TestClient) -> None:
    body = {"model_name": "m", "num_layers": 2, "num_tokens": 64, "hidden_dim": 8,
            "buffer": {"type": "cuda_ipc", "handle": "A" * 86 + "==", "offset": 2**64,
                       "device_uuid": "GPU-1"}}
    problem(live_client.post("/v1/instances", json=body), 422)


# -- the fuzz run --------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.parametrize("tokens", [(None, None), (TOKEN, ADMIN)], ids=["open", "token"])
def test_schema_fuzzing_finds_nothing(shm_prefix: str, tmp_path: Path,
                                      tokens: tuple[str | None, str | None]) -> None:
    service = fuzz_service(shm_prefix, tmp_path / "serve.log", *tokens)
    try:
        with engine(service) as inst:
            run = fuzz(service, CI_EXAMPLES, tmp_path, CI_TIMEOUT)
            assert service.http.get(f"/v1/instances/{inst}").status_code == 200
    finally:
        stopped = service.stop()
    assert stopped == 0
    assert run.exit_code == 0 and not run.report["failures"] and not run.report["errors"], (
        run.output[-20_000:])
    operations = run.report["operations"]
    documented = sum(len(item) for item in json.loads(COMMITTED.read_text())["paths"].values())
    assert operations["tested"] == operations["total"] == documented
    assert run.server_errors == 0, run.summary()
    assert run.requests >= 2000, run.summary()  # the run did reach the service
    assert run.statuses[200] > 0 and run.statuses[422] > 0, run.summary()
    assert logged_errors(tmp_path / "serve.log") == []
