"""``/v1/instances`` request validation, and its answer while no data plane runs.

Registration against a running data plane is covered end to end in ``tests/test_e2e.py``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import problem

BODY = {"model_name": "m", "world_size": 1, "worker_id": 0, "num_layers": 2, "num_tokens": 64,
        "hidden_dim": 8, "dtype": "float16", "shm_name": "kvbt_kvbuf_" + "ab" * 16}


def test_register_without_a_data_plane_is_503(client: TestClient) -> None:
    body = problem(client.post("/v1/instances", json=BODY), 503)
    assert body["code"] == "DataPlaneUnavailable"
    problem(client.get("/v1/instances"), 503)
    problem(client.get("/v1/instances/3"), 503)
    problem(client.delete("/v1/instances/3", headers={"X-Instance-Token": "0" * 32}), 503)


@pytest.mark.parametrize("change", [
    {"shm_name": None},                                              # no buffer
    {"cuda_ipc": {"handle": "A" * 86 + "==", "offset": 0, "device_uuid": "GPU-1"}},  # two buffers
    {"dtype": "int8"}, {"num_layers": 0}, {"world_size": 0}, {"model_name": ""},
    {"worker_id": -1}, {"unknown_field": 1}, {"owner_pid": 9},
    # names that are not an engine buffer: the cache's own segments, anyone else's, paths
    {"shm_name": "kvbt_meta"}, {"shm_name": "kvbt_fp"}, {"shm_name": "kvblend_slab"},
    {"shm_name": "kvbt_kvbuf_../../etc/passwd"}, {"shm_name": "kvbt_kvbuf_" + "AB" * 16},
    # integers past int64 (they raised OverflowError, a 500, before)
    {"num_tokens": 2**64}, {"worker_id": 2**64}, {"hidden_dim": 2**70},
    {"world_size": 2**64}, {"model_name": "\u0000"}, {"model_name": "a\nb"},
    {"model_name": "é" * 61},  # 61 characters, 122 bytes
])
def test_bad_registrations_are_422(client: TestClient, change: dict) -> None:
    problem(client.post("/v1/instances", json={**BODY, **change}), 422)


def test_bad_cuda_handle_is_422(client: TestClient) -> None:
    body = {**BODY, "shm_name": None,
            "cuda_ipc": {"handle": "zz", "offset": 0, "device_uuid": "GPU-1"}}
    problem(client.post("/v1/instances", json=body), 422)


def test_bad_instance_id_is_422(client: TestClient) -> None:
    problem(client.get("/v1/instances/abc"), 422)
    token = {"X-Instance-Token": "0" * 32}
    problem(client.delete("/v1/instances/-4", headers=token), 422)
    problem(client.delete(f"/v1/instances/{2**64}", headers=token), 422)


def test_unregister_needs_the_instance_token(client: TestClient) -> None:
    body = problem(client.delete("/v1/instances/3"), 422)
    assert body["errors"][0]["loc"] == ["header", "X-Instance-Token"]
