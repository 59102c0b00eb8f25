"""``/v1/instances`` request validation, and its answer while no data plane runs.

Registration against a running data plane is covered end to end in ``tests/test_e2e.py``.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec.inspect as mi
import pytest
from fastapi.testclient import TestClient

from kvblend.dataplane import messages
from kvblend.dataplane.registration import Registration

from tests.api.conftest import problem

BODY = {"model_name": "m", "world_size": 1, "worker_id": 0, "num_layers": 2, "num_tokens": 64,
        "hidden_dim": 8, "dtype": "float16",
        "buffer": {"type": "shm", "name": "kvbt_kvbuf_" + "ab" * 16}}
CUDA = {"type": "cuda_ipc", "handle": "A" * 86 + "==", "offset": 0, "device_uuid": "GPU-1"}


def test_register_without_a_data_plane_is_503(client: TestClient) -> None:
    body = problem(client.post("/v1/instances", json=BODY), 503)
    assert body["code"] == "dataplane_unavailable"
    problem(client.get("/v1/instances"), 503)
    problem(client.get("/v1/instances/3"), 503)
    problem(client.delete("/v1/instances/3", headers={"X-Instance-Token": "0" * 32}), 503)


@pytest.mark.parametrize("body", [
    {**BODY, "buffer": CUDA}, {**BODY, "buffer": {**CUDA, "offset": 2**53}},
    {**BODY, "dtype": "bfloat16", "worker_id": None, "rotary": {"head_dim": 8}},
    {k: v for k, v in BODY.items() if k not in ("world_size", "worker_id", "dtype")},
    {**BODY, "model_name": "é" * 60},  # 120 bytes
    {**BODY, "rotary": {"head_dim": 8, "scaling": "yarn", "factor": 4.0,
                        "original_max_position_embeddings": 1 << 24}},  # the largest
])
def test_good_registrations_reach_the_data_plane(client: TestClient, body: dict) -> None:
    problem(client.post("/v1/instances", json=body), 503)  # valid: only the data plane is missing


@pytest.mark.parametrize("change", [
    {"buffer": None}, {"buffer": {"type": "shm"}},                   # no buffer
    {"buffer": {"type": "disk", "name": BODY["buffer"]["name"]}},    # no such kind
    {"buffer": {**BODY["buffer"], **CUDA}},                          # two buffers in one
    {"dtype": "int8"}, {"num_layers": 0}, {"world_size": 0}, {"model_name": ""},
    {"worker_id": -1}, {"unknown_field": 1}, {"owner_pid": 9}, {"shm_name": BODY["buffer"]["name"]},
    {"rotary": {"head_dim": 1}}, {"rotary": {"head_dim": 8, "theta": 0}},
    # names that are not an engine buffer: the cache's own segments, anyone else's, paths
    *({"buffer": {"type": "shm", "name": name}} for name in (
        "kvbt_meta", "kvbt_fp", "kvblend_slab", "kvbt_kvbuf_../../etc/passwd",
        "kvbt_kvbuf_" + "AB" * 16)),
    # integers past int64 (they raised OverflowError, a 500, before)
    {"num_tokens": 2**64}, {"worker_id": 2**64}, {"hidden_dim": 2**70},
    {"world_size": 2**64}, {"rotary": {"head_dim": 8, "original_max_position_embeddings": 2**64}},
    {"rotary": {"head_dim": 8, "original_max_position_embeddings": (1 << 24) + 1}},
    {"model_name": "\u0000"}, {"model_name": "a\nb"},
    {"model_name": "é" * 61},  # 61 characters, 122 bytes
])
def test_bad_registrations_are_422(client: TestClient, change: dict) -> None:
    problem(client.post("/v1/instances", json={**BODY, **change}), 422)


@pytest.mark.parametrize("cuda", [{"handle": "zz"}, {"handle": "A" * 88}, {"offset": 2**53 + 1},
                                  {"offset": -1}, {"device_uuid": ""}, {"handle": None}])
def test_bad_cuda_buffers_are_422(client: TestClient, cuda: dict) -> None:
    problem(client.post("/v1/instances", json={**BODY, "buffer": {**CUDA, **cuda}}), 422)


def test_a_bad_field_is_named_where_it_is(client: TestClient) -> None:
    body = {**BODY, "buffer": {**CUDA, "offset": -1}}
    error = problem(client.post("/v1/instances", json=body), 422)["errors"][0]
    assert error["loc"] == ["buffer", "offset"] and error["type"] == "value_error"
    error = problem(client.post("/v1/instances", json={**BODY, "model_name": "a\nb"}),
                    422)["errors"][0]
    assert "model_name" in error["msg"]


def test_a_body_that_is_not_json_is_refused(client: TestClient) -> None:
    problem(client.post("/v1/instances", content=b"model_name=m",
                        headers={"content-type": "application/x-www-form-urlencoded"}), 422)


def test_bad_instance_id_is_422(client: TestClient) -> None:
    problem(client.get("/v1/instances/abc"), 422)
    token = {"X-Instance-Token": "0" * 32}
    problem(client.delete("/v1/instances/-4", headers=token), 422)
    problem(client.delete(f"/v1/instances/{2**64}", headers=token), 422)


def test_unregister_needs_the_instance_token(client: TestClient) -> None:
    body = problem(client.delete("/v1/instances/3"), 422)
    assert body["errors"][0]["loc"] == ["header", "X-Instance-Token"]


def _ints(t: object, seen: set[type]) -> Iterator[tuple[str, object]]:
    """Every integer type (with its path) reachable from the msgspec type ``t``."""
    if isinstance(t, mi.Metadata):
        yield from _ints(t.type, seen)
    elif isinstance(t, mi.IntType):
        yield "", t
    elif isinstance(t, (mi.StructType, mi.DataclassType)):
        if t.cls in seen:
            return
        seen.add(t.cls)
        for f in t.fields:
            yield from ((f"{t.cls.__name__}.{f.name}{p}", i) for p, i in _ints(f.type, seen))
    elif isinstance(t, mi.UnionType):
        for u in t.types:
            yield from _ints(u, seen)
    elif isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        yield from _ints(t.item_type, seen)
    elif isinstance(t, mi.TupleType):
        for u in t.item_types:
            yield from _ints(u, seen)
    elif isinstance(t, mi.DictType):
        yield from _ints(t.key_type, seen)
        yield from _ints(t.value_type, seen)


def test_every_integer_a_caller_sends_has_bounds_a_frame_carries() -> None:
    """The registration (HTTP body and socket payload) and every request frame: no integer can
    overflow the frame encoder (an ``OverflowError``, a 500) or go negative unasked."""
    unbounded, found = [], 0
    for cls in (Registration, messages.Request):
        for path, t in _ints(mi.type_info(cls), set()):
            found += 1
            hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else None)
            lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else None)
            if hi is None or lo is None or hi > 2**63 - 1 or lo < -(2**63):
                unbounded.append(path)
    assert found > 20 and unbounded == []
