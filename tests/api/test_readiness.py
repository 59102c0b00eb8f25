"""Readiness against a real data plane that hangs (SIGSTOP): the API notices within its monitor's
staleness bound and never holds a request for a whole call timeout. And against a real service
whose supervisor is killed: its API is never ready again from that moment (``api.drain``)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from kvblend.api.app import create_app
from tests.api.conftest import make_settings, problem
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane
from tests.faults import CHILD_EXIT_DEADLINE, processes_of
from tests.harness import Services, poll

pytestmark = pytest.mark.slow

GENEROUS = 5.0  # far above the 1 s bound, far below the 10-20 s a hung call used to take


@pytest.fixture
def live(shm_prefix: str) -> Iterator[tuple[TestClient, DataPlaneProc]]:
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix)
    settings = make_settings(shm_prefix, chunk_size=CHUNK, dataplane_socket=dp.address,
                             fingerprint_capacity=4096)
    with TestClient(create_app(settings)) as client:
        yield client, dp
    if dp.proc.poll() is None:
        os.kill(dp.proc.pid, signal.SIGCONT)
        assert dp.stop() == 0


def answered_within(client: TestClient, path: str, seconds: float) -> int:
    t0 = time.monotonic()
    status = client.get(path).status_code
    assert time.monotonic() - t0 < seconds, f"{path} held the request"
    return status


def test_a_hung_data_plane_is_not_ready_and_holds_no_request(
        live: tuple[TestClient, DataPlaneProc]) -> None:
    client, dp = live
    poll(lambda: client.get("/readyz").status_code == 200, 30.0, "/readyz 200")
    os.kill(dp.proc.pid, signal.SIGSTOP)
    poll(lambda: client.get("/readyz").status_code == 503, 30.0, "/readyz 503 (data plane hung)")
    for path in ("/readyz", "/v1/instances", "/v1/instances/1", "/v1/status", "/healthz"):
        assert answered_within(client, path, GENEROUS) in (200, 503)
    assert client.get("/v1/status").json()["dataplane"]["alive"] is False
    problem(client.get("/v1/instances"), 503)
    os.kill(dp.proc.pid, signal.SIGCONT)
    poll(lambda: client.get("/readyz").status_code == 200, 30.0, "/readyz 200 again")
    assert client.get("/v1/instances").json() == {"instances": []}


def readiness_until_refused(url: str, deadline_s: float) -> list[int]:
    """Every ``/readyz`` status the API answers, each on a new connection, until it refuses
    connections (bounded by ``deadline_s``); a connection it drops unanswered adds nothing."""
    seen: list[int] = []

    def refused() -> bool:
        try:
            seen.append(httpx.get(f"{url}/readyz", timeout=GENEROUS).status_code)
        except httpx.ConnectError:
            return True
        except httpx.TransportError:  # closed without an answer while it drains
            pass
        return False

    poll(refused, deadline_s, "the API to stop listening", every_s=0.0)
    return seen


def test_a_killed_supervisors_api_is_never_ready_again(services: Services) -> None:
    svc = services.start()
    svc.wait_ready()
    os.kill(svc.proc.pid, signal.SIGKILL)  # its children get SIGTERM (PR_SET_PDEATHSIG)
    seen = readiness_until_refused(svc.url, CHILD_EXIT_DEADLINE)
    assert set(seen) <= {503}, f"/readyz answered {seen} after the supervisor was killed"
    svc.proc.wait(CHILD_EXIT_DEADLINE)
    poll(lambda: not processes_of(services.prefix), CHILD_EXIT_DEADLINE, "its children to exit")
