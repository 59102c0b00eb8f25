"""``kvblend serve --remote`` on a real redis-server: every chunk a store commits is written
behind, byte for byte, with the credentials taken from the environment (never on a command line);
a remote that dies fails no store, and writing resumes once it is back."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import numpy as np
import pytest
import redis
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.remote import ChunkId, Fetched, RemoteTier
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.layout import DType
from tests.harness import Service, Services, poll
from tests.remote.conftest import KEY, KEY_TEXT, RedisProc

pytestmark = pytest.mark.slow

C, L, D = 256, 2, 64
MODEL = "remote-serve"
PASSWORD = "remote-" + uuid.uuid4().hex
DEADLINE = 60.0


@pytest.fixture
def service(redis_server: RedisProc, redis_url: str, services: Services) -> Iterator[Service]:
    with redis_server.client() as admin:
        admin.config_set("requirepass", PASSWORD)
    svc = services.start("--remote", redis_url.removesuffix("/0"),
                         env={"KVBLEND_REMOTE_PASSWORD": PASSWORD,
                              "KVBLEND_REMOTE_KEY": KEY_TEXT})
    try:
        yield svc
    finally:
        svc.stop()  # before the password goes
        if redis_server.running:
            with redis_server.client(password=PASSWORD) as admin:
                admin.config_set("requirepass", "")


def remote_keys(redis_server: RedisProc) -> list[bytes]:
    try:
        with redis_server.client(password=PASSWORD) as r:
            return list(r.scan_iter("kvblend:1:*:*"))  # chunks, not the record stream
    except redis.RedisError:
        return []


def test_stores_are_written_behind_and_survive_a_dead_remote(
        service: Service, redis_server: RedisProc) -> None:
    ns = Namespace(MODEL)
    with BlendClient(service.url) as client:
        kv = client.cpu_kv_buffer(num_layers=L, num_tokens=8 * C, hidden_dim=D,
                                  dtype=torch.bfloat16)
        inst = client.register_kv_cache(kv, model_name=MODEL)
        kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tuple(kv.shape),
                                                 dtype=torch.int16))
        doc = np.random.default_rng(1).integers(0, 50_000, 3 * C, dtype=np.uint32)
        assert client.store_pre_computed(inst, doc, offset=C).wait(timeout=60).ok
        poll(lambda: len(remote_keys(redis_server)) == 3, DEADLINE, "3 chunks written")
        with RemoteTier(redis_server.url.removesuffix("/0"), key=KEY, password=PASSWORD) as tier:
            for i, h in enumerate(chunk_hashes(ns, doc, C)):
                cid = ChunkId(ns.root, h, 0, DType.BFLOAT16, L, C, D)
                got = tier.get(cid, doc[i * C:(i + 1) * C])
                assert isinstance(got, Fetched), got
                want = kv[:, :, C * (i + 1):C * (i + 2)].contiguous().view(torch.int16).numpy()
                assert bytes(got.kv) == want.tobytes() and got.pos0 == i * C
        assert service.metrics()["kvblend_remote_written_chunks_total"] == 3
        dataplane = service.status()["dataplane"]["pid"]
        with open(f"/proc/{dataplane}/cmdline", "rb") as f:
            assert PASSWORD.encode() not in f.read()  # the credential stayed off command lines

        redis_server.kill()
        doc2 = np.random.default_rng(2).integers(0, 50_000, 2 * C, dtype=np.uint32)
        assert client.store_pre_computed(inst, doc2).wait(timeout=60).ok  # the host goes on
        poll(lambda: service.metrics()["kvblend_remote_failed_writes_total"] >= 1,
             DEADLINE, "a failed remote write counted")
        redis_server.restart()
        with redis_server.client() as admin:
            admin.config_set("requirepass", PASSWORD)
        seeds = iter(range(3, 10_000))

        def resumed() -> bool:  # new chunks each time, until the breaker lets a write through
            doc = np.random.default_rng(next(seeds)).integers(0, 50_000, 2 * C, dtype=np.uint32)
            assert client.store_final(inst, doc, offset=C).wait(timeout=60).ok
            return len(remote_keys(redis_server)) >= 1

        poll(resumed, DEADLINE, "writing behind to resume after the restart")
        client.unregister(inst)
