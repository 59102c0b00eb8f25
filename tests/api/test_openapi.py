"""The OpenAPI schema is a reviewed artifact: the committed file must equal the generated one."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec

from kvblend.api.openapi import render, schema
from kvblend.dataplane.messages import RegisterInstance

COMMITTED = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
METHODS = {"get", "post", "put", "patch", "delete"}


def test_committed_schema_matches_the_app() -> None:
    assert COMMITTED.read_text() == render(), (
        "openapi/openapi.json is stale: regenerate it with "
        "`python -m kvblend.api.openapi > openapi/openapi.json` and review the diff")


def test_every_operation_is_documented() -> None:
    doc = schema()
    seen = set()
    for path, item in doc["paths"].items():
        for method, op in item.items():
            if method not in METHODS:
                continue
            assert op.get("operationId"), f"{method} {path} has no operationId"
            assert op["operationId"] not in seen
            seen.add(op["operationId"])
            assert op.get("summary") and op.get("tags"), f"{method} {path}"
            codes = set(op["responses"])
            assert codes & {"200", "201", "204"}, f"{method} {path} documents no success"
            for code, resp in op["responses"].items():
                if code.startswith(("4", "5")) and code != "422":
                    content = resp["content"]["application/problem+json"]["schema"]
                    assert content == {"$ref": "#/components/schemas/Problem"}
            if path.startswith("/v1") or path == "/metrics":
                assert "401" in codes and op.get("security"), f"{method} {path} lacks auth docs"


def test_lookup_documents_both_body_types() -> None:
    op = schema()["paths"]["/v1/lookup"]["post"]
    content = op["requestBody"]["content"]
    assert content["application/json"]["schema"]["$ref"] == "#/components/schemas/LookupRequest"
    assert content["application/octet-stream"]["schema"]["format"] == "binary"
    components = schema()["components"]["schemas"]
    tokens = components["LookupRequest"]["properties"]["token_ids"]["items"]
    assert tokens["minimum"] == 0 and tokens["maximum"] == 2**32 - 1
    json.dumps(components)  # every schema serializes


def test_the_registration_body_is_the_data_planes_own_type() -> None:
    """One contract: the body of registerInstance is the type the data plane's frame carries,
    and its schema is that type's, as msgspec states it (no twin declared for the API)."""
    doc = schema()
    body = doc["paths"]["/v1/instances"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"]["$ref"] == "#/components/schemas/Registration"
    carried = msgspec.structs.fields(RegisterInstance)[0]
    assert carried.name == "registration"
    _, components = msgspec.json.schema_components([carried.type],
                                                   ref_template="#/components/schemas/{name}")
    assert {name: doc["components"]["schemas"].get(name) for name in components} == components
