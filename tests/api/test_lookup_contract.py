"""The lookup contract has one home: the namespace's bounds in ``shm.hashing``, one parse for the
route and the fast path. Checked on the schema, the wire struct, and live requests at each bound."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from fastapi.testclient import TestClient

from kvblend.api.lookup import LookupBody, OCTET_STREAM
from kvblend.api.openapi import schema
from kvblend.shm.hashing import CACHE_SALT_BYTES, MAX_WORLD_SIZE, MODEL_NAME_BYTES
from tests.api.conftest import problem

BOUNDS = {"model_name": ("maxLength", MODEL_NAME_BYTES), "world_size": ("maximum", MAX_WORLD_SIZE),
          "cache_salt": ("maxLength", CACHE_SALT_BYTES)}


def test_the_schema_and_the_wire_struct_carry_the_namespace_bounds() -> None:
    doc = schema()
    body = doc["components"]["schemas"]["LookupRequest"]["properties"]
    params = {p["name"]: p["schema"] for p in doc["paths"]["/v1/lookup"]["post"]["parameters"]}
    wire = {f.name: f.type for f in msgspec.inspect.type_info(LookupBody).fields}
    for field, (key, bound) in BOUNDS.items():
        assert body[field][key] == bound
        query = params[field].get("anyOf", [params[field]])[0]
        assert query[key] == bound
        meta = wire[field]
        assert bound in (getattr(meta, "max_length", None), getattr(meta, "le", None))


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_each_bound_is_accepted_and_one_past_it_refused(client: TestClient, binary: bool) -> None:
    tokens = np.arange(16, dtype=np.uint32)

    def ask(**fields: object) -> object:
        fields = {"model_name": "m", **fields}
        if binary:
            return client.post("/v1/lookup", params=fields, content=tokens.tobytes(),
                               headers={"content-type": OCTET_STREAM})
        return client.post("/v1/lookup", json={**fields, "token_ids": tokens.tolist()})

    for field, at in (("model_name", "m" * MODEL_NAME_BYTES), ("world_size", MAX_WORLD_SIZE),
                      ("cache_salt", "s" * CACHE_SALT_BYTES)):
        assert ask(**{field: at}).status_code == 200  # type: ignore[attr-defined]
        past = at + 1 if isinstance(at, int) else at + at[0]
        problem(ask(**{field: past}), 422)
