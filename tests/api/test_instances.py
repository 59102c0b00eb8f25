"""``/v1/instances`` request validation, and its answer while no data plane runs.

Registration against a running data plane is covered end to end in ``tests/test_e2e.py``.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.api.conftest import problem

BODY = {"model_name": "m", "world_size": 1, "worker_id": 0, "num_layers": 2, "num_tokens": 64,
        "hidden_dim": 8, "dtype": "float16", "shm_name": "kvbt_buffer"}


def test_register_without_a_data_plane_is_503(client: TestClient) -> None:
    body = problem(client.post("/v1/instances", json=BODY), 503)
    assert body["code"] == "DataPlaneUnavailable"
    problem(client.get("/v1/instances"), 503)
    problem(client.get("/v1/instances/3"), 503)
    problem(client.delete("/v1/instances/3"), 503)


@pytest.mark.parametrize("change", [
    {"shm_name": None},                                              # no buffer
    {"cuda_ipc": {"handle": "A" * 86 + "==", "offset": 0, "device_uuid": "GPU-1"}},  # two buffers
    {"dtype": "int8"}, {"num_layers": 0}, {"world_size": 0}, {"model_name": ""},
    {"worker_id": -1}, {"unknown_field": 1},
])
def test_bad_registrations_are_422(client: TestClient, change: dict) -> None:
    problem(client.post("/v1/instances", json={**BODY, **change}), 422)


def test_bad_cuda_handle_is_422(client: TestClient) -> None:
    body = {**BODY, "shm_name": None,
            "cuda_ipc": {"handle": "zz", "offset": 0, "device_uuid": "GPU-1"}}
    problem(client.post("/v1/instances", json=body), 422)


def test_bad_instance_id_is_422(client: TestClient) -> None:
    problem(client.get("/v1/instances/abc"), 422)
    problem(client.delete("/v1/instances/-4"), 422)
