"""Registrations over HTTP cannot keep engines out (docs/security.md, issue 32 item 2).

Every HTTP registration travels over an API worker's data-plane connection, which once counted
them all against one connection's share: one token-less local caller registering a buffer again
and again filled it, and new engines got 429 until the leases ran out. Now each caller has its own
share, the HTTP path as a whole leaves a reserve that only engines on the socket take, and a
caller cannot register a buffer another caller's live instance holds. A real data-plane process
and the real app through its lifespan throughout.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from fastapi.testclient import TestClient

from kvblend.api.app import create_app
from kvblend.dataplane.channel import Channel
from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.control import DirectControl
from kvblend.dataplane.errors import TooMany
from kvblend.dataplane.instances import memory_names
from kvblend.dataplane.registration import CudaIpcBuffer, Registration, ShmBuffer
from kvblend.shm.names import Names
from kvblend.shm.segment import Segment
from tests.api.apps import ADMIN, bearer
from tests.api.conftest import TOKEN, make_settings, problem
from tests.dataplane.conftest import CHUNK, DataPlaneProc, create_store, start_dataplane
from tests.dataplane.test_trust import NOBODY, as_user
from tests.harness import Services, poll

pytestmark = pytest.mark.slow

L, T, D = 2, 64, 8
MAX_INSTANCES, PER_CALLER = 8, 3  # the HTTP path may hold 6; 2 are the engines' reserve
HTTP_SHARE = MAX_INSTANCES - MAX_INSTANCES // 4


@dataclass
class Live:
    dp: DataPlaneProc

    def app(self, peer: str = "testclient", **overrides: object) -> TestClient:
        """A client of an API worker (its own data-plane connection), calling from ``peer``."""
        settings = make_settings(self.dp.prefix, chunk_size=CHUNK, fingerprint_capacity=4096,
                                 dataplane_socket=self.dp.address, **overrides)
        return TestClient(create_app(settings), client=(peer, 50000))

    def buffer(self) -> str:
        """A new engine buffer under the service's prefix (this test's uid owns it)."""
        name = Names(self.dp.prefix).kvbuf(os.urandom(16).hex())
        Segment(name, 2 * L * T * D * 2, create=True).close()
        return name


LIMITS = {"max_instances": MAX_INSTANCES, "max_instances_per_client": PER_CALLER,
          "instance_lease_s": 600.0}  # no lease runs out within a test


@pytest.fixture
def live(shm_prefix: str) -> Iterator[Live]:
    create_store(shm_prefix)
    dp = start_dataplane(shm_prefix, **LIMITS)
    yield Live(dp)  # the prefix's fixture removes the buffers made here
    if dp.proc.poll() is None:
        assert dp.stop() == 0


def body(name: str) -> dict:
    return {"model_name": "m", "num_layers": L, "num_tokens": T, "hidden_dim": D,
            "buffer": {"type": "shm", "name": name}}


def from_peer(worker: TestClient, peer: str) -> TestClient:
    """A client of the same API worker as ``worker`` (whose lifespan runs), calling from
    ``peer``: its registrations travel over the same data-plane connection."""
    return TestClient(worker.app, client=(peer, 50000))


def ready(client: TestClient) -> TestClient:
    poll(lambda: client.get("/readyz").status_code == 200, 30.0, "/readyz 200")
    return client


def register_until_refused(client: TestClient, name: str, headers: dict | None = None,
                           tries: int = MAX_INSTANCES + 4) -> tuple[int, dict]:
    """Register ``name`` again and again as one caller: how many went through, and the
    problem that stopped them."""
    for n in range(tries):
        got = client.post("/v1/instances", json=body(name), headers=headers)
        if got.status_code != 201:
            return n, problem(got, got.status_code)
    raise AssertionError(f"{tries} registrations of one caller all went through")


def test_one_caller_registering_again_and_again_keeps_nobody_out(live: Live) -> None:
    with live.app() as attacker, BlendClient(dataplane_address=live.dp.address) as engine:
        ready(attacker)
        other = from_peer(attacker, "192.0.2.7")
        # the reproduction: no token (the loopback default), one buffer, registered until refused
        n, refusal = register_until_refused(attacker, live.buffer())
        assert n == PER_CALLER and refusal["status"] == 429 and refusal["code"] == "too_many"
        assert "per-client" in refusal["detail"]
        # an engine on the socket registers, and so does another HTTP caller of the same worker
        engine.register_kv_cache(engine.cpu_kv_buffer(L, T, D), model_name="m")
        assert other.post("/v1/instances", json=body(live.buffer())).status_code == 201
        assert len(attacker.get("/v1/instances").json()["instances"]) == PER_CALLER + 2


def test_http_callers_together_leave_the_engines_reserve(live: Live) -> None:
    with live.app(api_token=TOKEN, admin_token=ADMIN) as tokened, \
            live.app(peer="192.0.2.7") as third, \
            BlendClient(dataplane_address=live.dp.address) as engine:
        ready(tokened), ready(third)  # two API workers: the share is the data plane's count
        for headers in (bearer(TOKEN), bearer(ADMIN)):  # two callers: two tokens
            for _ in range(PER_CALLER):
                got = tokened.post("/v1/instances", json=body(live.buffer()), headers=headers)
                assert got.status_code == 201, got.text
        assert 2 * PER_CALLER == HTTP_SHARE
        refusal = problem(third.post("/v1/instances", json=body(live.buffer())), 429)
        assert refusal["code"] == "too_many" and "engines on its socket" in refusal["detail"]
        for _ in range(MAX_INSTANCES - HTTP_SHARE):  # the reserve: engines on the socket only
            engine.register_kv_cache(engine.cpu_kv_buffer(L, T, D), model_name="m")
        with pytest.raises(TooMany, match="max-instances"):
            engine.register_kv_cache(engine.cpu_kv_buffer(L, T, D), model_name="m")


def test_a_buffer_another_caller_holds_cannot_be_registered_over_http(live: Live) -> None:
    engines_buffer, callers_buffer = live.buffer(), live.buffer()
    with live.app(api_token=TOKEN, admin_token=ADMIN) as client, \
            Channel(live.dp.address) as channel:
        ready(client)
        # an engine on the socket holds one buffer, the API token's caller the other
        engine = DirectControl(channel, live.dp.prefix, CHUNK, 30.0)
        engine.register(Registration(model_name="m", num_layers=L, num_tokens=T, hidden_dim=D,
                                     buffer=ShmBuffer(name=engines_buffer)))
        got = client.post("/v1/instances", json=body(callers_buffer), headers=bearer(TOKEN))
        assert got.status_code == 201, got.text
        for name, headers in ((engines_buffer, bearer(TOKEN)), (engines_buffer, bearer(ADMIN)),
                              (callers_buffer, bearer(ADMIN))):
            refusal = problem(client.post("/v1/instances", json=body(name), headers=headers), 409)
            assert refusal["code"] == "buffer_in_use", refusal
        # its own buffer, a caller may register again (an engine restarting within its lease)
        got = client.post("/v1/instances", json=body(callers_buffer), headers=bearer(TOKEN))
        assert got.status_code == 201, got.text
        assert len(client.get("/v1/instances", headers=bearer(TOKEN)).json()["instances"]) == 3


def test_an_order_word_names_its_allocation_as_a_buffer_does() -> None:
    # a CUDA registration's order word is memory the data plane writes (when a lease runs out):
    # naming another caller's buffer or word by it collides as naming that buffer would
    def cuda(handle: bytes) -> CudaIpcBuffer:
        return CudaIpcBuffer(handle=handle, device_uuid="0")

    def reg(buffer: bytes, word: bytes | None = None) -> Registration:
        return Registration(model_name="m", num_layers=L, num_tokens=T, hidden_dim=D,
                            buffer=cuda(buffer), order_word=cuda(word) if word else None)

    a, b, c = b"a" * 64, b"b" * 64, b"c" * 64
    assert memory_names(reg(a, b)) == {("cuda_ipc", a), ("cuda_ipc", b)}
    assert memory_names(reg(c, a)) & memory_names(reg(a))  # a word over another's buffer
    assert memory_names(reg(c, b)) & memory_names(reg(a, b))  # over another's word
    assert not memory_names(reg(c)) & memory_names(reg(a, b))


def test_a_restarted_data_plane_still_knows_whose_instances_it_holds(live: Live) -> None:
    name = live.buffer()
    with live.app() as client:
        ready(client)
        for _ in range(PER_CALLER):
            assert client.post("/v1/instances", json=body(name)).status_code == 201
        assert live.dp.stop() == 0
        live.dp.proc = start_dataplane(live.dp.prefix, **LIMITS).proc  # re-opens them
        poll(lambda: len(client.get("/v1/instances").json().get("instances", ())) == PER_CALLER,
             30.0, "the saved instances re-opened")
        assert problem(client.post("/v1/instances", json=body(name)), 429)["code"] == "too_many"
        other = from_peer(client, "192.0.2.7")
        assert problem(other.post("/v1/instances", json=body(name)), 409)["code"] == \
            "buffer_in_use"


def test_a_rotary_config_whose_frequencies_overflow_is_422(live: Live) -> None:
    rotary = {"head_dim": D, "scaling": "yarn", "factor": 4.0, "beta_slow": 5e-324}
    with live.app() as client:
        ready(client)
        got = client.post("/v1/instances", json={**body(live.buffer()), "rotary": rotary})
        assert "cannot be computed" in problem(got, 422)["detail"]  # a 500 (OverflowError) before


# -- a real served API: the caller is its loopback socket's uid, and only that ------------------


def new_buffer(prefix: str) -> str:
    """An engine's new buffer, not registered yet: its name is listed in /dev/shm to everyone."""
    name = Names(prefix).kvbuf(os.urandom(16).hex())
    Segment(name, 2 * L * T * D * 2, create=True).close()
    return name


@pytest.mark.skipif(os.geteuid() != 0, reason="a second local user needs root (setuid)")
def test_another_local_user_cannot_register_an_engines_new_buffer_first(
        services: Services) -> None:
    svc = services.start()
    name, url = new_buffer(svc.prefix), f"{svc.url}/v1/instances"
    # the reproduction: another uid, no token (the loopback default), registers the engine's new
    # buffer first; the engine's own registration then got 409 buffer_in_use
    got = as_user(NOBODY, lambda: str(httpx.post(url, json=body(name), timeout=30.0)
                                      .status_code).encode())
    assert got == b"422"
    assert svc.http.post("/v1/instances", json=body(name)).status_code == 201, "the engine's"


def test_a_forwarded_for_header_makes_no_new_caller(services: Services) -> None:
    svc = services.start("--max-instances-per-client", str(PER_CALLER))
    name = new_buffer(svc.prefix)
    for _ in range(PER_CALLER):
        assert svc.http.post("/v1/instances", json=body(name)).status_code == 201
    # a made-up X-Forwarded-For named another caller: a fresh share (here 409, the buffer
    # another caller's), as many as there are addresses
    for forwarded in ("192.0.2.7", "127.0.0.2"):
        got = svc.http.post("/v1/instances", json=body(name),
                            headers={"X-Forwarded-For": forwarded})
        assert problem(got, 429)["code"] == "too_many"
