"""Two hosts share documents through one real Redis: two ``kvblend serve`` (two prefixes standing
for two hosts) on the same remote, a standalone server and a 3-master cluster. What host A stores,
host B finds by lookup (``location="remote"``), prefetches and retrieves byte for byte; a value
that expired, was corrupted, or sat on a killed master is a failed chunk on B, never wrong bytes;
a remote stopped and restarted mid-run stops nothing, and discovery resumes."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvblend.dataplane.client import BlendClient
from kvblend.dataplane.messages import ChunkFailure
from kvblend.dataplane.remote import STREAM
from tests.harness import Service, free_port, poll, remove_prefix, unique_prefix
from tests.remote.conftest import KEY_TEXT, ClusterProcs, RedisProc

pytestmark = pytest.mark.slow

C, L, D = 256, 2, 64
MODEL = "two-hosts"
DEADLINE = 60.0
SENTINEL = -12345  # what B's buffer holds where nothing was retrieved


class Host:
    """One ``kvblend serve --remote`` and a client with a CPU buffer registered on it."""

    def __init__(self, remote: str, *flags: str) -> None:
        self.prefix = unique_prefix("kvbh")
        self.service = Service(self.prefix, "--remote", remote, *flags,
                               env={"KVBLEND_REMOTE_KEY": KEY_TEXT})
        self.client = BlendClient(self.service.url)
        self.kv = self.client.cpu_kv_buffer(num_layers=L, num_tokens=16 * C, hidden_dim=D,
                                            dtype=torch.bfloat16)
        self.inst = self.client.register_kv_cache(self.kv, model_name=MODEL)

    def counter(self, name: str) -> float:
        return self.service.metrics().get(f"kvblend_{name}_total", 0.0)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            self.service.stop()
            remove_prefix(self.prefix)


@pytest.fixture
def hosts() -> Iterator[list[Host]]:
    """The test's hosts, stopped afterwards pass or fail."""
    made: list[Host] = []
    yield made
    for h in made:
        h.close()


def fill(host: Host, seed: int) -> torch.Tensor:
    """Random bits in the host's whole buffer (int16 view of bf16); returns a copy."""
    g = torch.Generator().manual_seed(seed)
    host.kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tuple(host.kv.shape),
                                                  generator=g, dtype=torch.int16))
    return host.kv.view(torch.int16).clone()


def doc(seed: int, chunks: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, chunks * C, dtype=np.uint32)


def remote_matches(host: Host, prompt: np.ndarray, want: int) -> list:
    """B's lookup, polled until ``want`` matches are found (discovery is asynchronous)."""
    found: list = []

    def enough() -> bool:
        found[:] = host.client.lookup(prompt, model_name=MODEL).matches
        return len(found) >= want

    poll(enough, DEADLINE, f"{want} chunks stored on A to be found on B")
    return found


def sentinel(host: Host) -> None:
    host.kv.view(torch.int16).fill_(SENTINEL)


def share_and_retrieve(a: Host, b: Host) -> None:
    """A stores a 3-chunk document; B finds it remote, prefetches, retrieves it exactly."""
    stored = fill(a, 1)
    document = doc(1, 3)
    assert a.client.store_pre_computed(a.inst, document, offset=C).wait(timeout=60).ok
    prompt = np.concatenate([doc(2, 1), document, doc(3, 1)])  # the document at C in B's prompt
    matches = remote_matches(b, prompt, 3)
    assert [m.location for m in matches] == ["remote"] * 3
    assert [(m.cur_st, m.old_st, m.origin) for m in matches] == [
        (C * (i + 1), C * i, "pre_computed") for i in range(3)]
    remote = b.service.status()["remote"]
    assert remote["known_chunks"] >= 3 and "@" not in remote["url"]
    assert b.service.metrics()["kvblend_remote_known_chunks"] == remote["known_chunks"]
    assert b.client.prefetch(b.inst, prompt, matches) == 3
    sentinel(b)
    got = b.client.retrieve(b.inst, prompt, matches, offset=0).wait(timeout=60)
    assert got.ok and got.copied == 3, got
    # A's chunks sat at [C, 4C) of its buffer; B's prompt has them at [C, 4C) too
    assert torch.equal(b.kv.view(torch.int16)[:, :, C:4 * C], stored[:, :, C:4 * C])
    assert (b.kv.view(torch.int16)[:, :, 4 * C:] == SENTINEL).all()
    assert b.counter("remote_promoted_chunks") == 3
    after = b.client.lookup(prompt, model_name=MODEL).matches
    assert [m.location for m in after] == ["local"] * 3  # promoted: B holds them now


def test_a_document_stored_on_one_host_is_found_and_retrieved_on_another(
        hosts: list[Host], redis_server: RedisProc, redis_url: str) -> None:
    with redis_server.client() as raw:  # hostile records first: counted and skipped
        raw.xadd(STREAM, {"v": b"not a record", "x": b"1"})
        raw.xadd(STREAM, {"other": b"fields"})
    hosts += [Host(redis_url), Host(redis_url)]
    share_and_retrieve(*hosts)
    assert hosts[1].counter("remote_malformed_records") == 2


def test_a_remote_down_at_start_up_stops_nothing(hosts: list[Host]) -> None:
    closed = free_port()
    for url in (f"redis://127.0.0.1:{closed}", f"redis+cluster://127.0.0.1:{closed}"):
        host = Host(url)
        hosts.append(host)
        fill(host, 3)
        document = doc(3, 2)
        assert host.client.store_pre_computed(host.inst, document).wait(timeout=60).ok
        assert [m.location for m in host.client.lookup(document, model_name=MODEL).matches] == [
            "local", "local"]
        poll(lambda: host.counter("remote_failed_writes") == 2, DEADLINE,
             "the failed writes counted")


def test_two_hosts_share_through_a_cluster_and_a_killed_master_gives_misses(
        hosts: list[Host], redis_cluster: ClusterProcs) -> None:
    redis_cluster.wait_ok()
    hosts += [Host(redis_cluster.cluster_url), Host(redis_cluster.cluster_url)]
    a, b = hosts
    share_and_retrieve(a, b)
    # a longer document, spread over the 3 masters; B finds all of it, then a master dies
    stored = fill(a, 7)
    document = doc(7, 12)
    assert a.client.store_final(a.inst, document, offset=0).wait(timeout=60).ok
    matches = remote_matches(b, document, 12)
    victim = redis_cluster.node_for_key(b"kvblend:1:" + matches[0].chunk_hash.hex().encode()
                                        + b":0")
    victim.kill()
    try:
        sentinel(b)
        got = b.client.retrieve(b.inst, document, matches, offset=0).wait(timeout=60)
        assert 0 < got.copied < 12, got  # the killed master's chunks fail, the others come
        assert set(got.reasons.values()) == {ChunkFailure.MISSING}
        view = b.kv.view(torch.int16)
        for j, m in enumerate(matches):
            part = view[:, :, m.cur_st:m.cur_ed]
            if j in got.failed:
                assert (part == SENTINEL).all()  # nothing written for a miss
            else:
                assert torch.equal(part, stored[:, :, m.cur_st:m.cur_ed])
    finally:
        victim.restart()
        redis_cluster.wait_ok()


def test_expired_corrupted_and_a_restarted_remote_are_misses_never_wrong_bytes(
        hosts: list[Host], redis_server: RedisProc, redis_url: str) -> None:
    hosts += [Host(redis_url), Host(redis_url)]
    a, b = hosts
    stored = fill(a, 11)
    document = doc(11, 3)
    assert a.client.store_pre_computed(a.inst, document, offset=0).wait(timeout=60).ok
    matches = remote_matches(b, document, 3)
    key = [f"kvblend:1:{m.chunk_hash.hex()}:0" for m in matches]
    with redis_server.client() as raw:
        raw.pexpire(key[0], 1)  # expired (the server drops it on the next access)
        value = bytearray(raw.get(key[1]))
        value[-7] ^= 0x10  # one flipped bit of KV
        raw.set(key[1], bytes(value))
    sentinel(b)
    got = b.client.retrieve(b.inst, document, matches, offset=0).wait(timeout=60)
    assert got.failed == [0, 1] and got.copied == 1, got
    view = b.kv.view(torch.int16)
    assert (view[:, :, :2 * C] == SENTINEL).all()
    assert torch.equal(view[:, :, 2 * C:3 * C], stored[:, :, 2 * C:3 * C])
    assert b.counter("remote_fetch_misses") == 2
    # a value found gone or corrupt is forgotten: B's lookups stop offering it
    assert [m.cur_st for m in b.client.lookup(document, model_name=MODEL).matches] == [2 * C]

    # the remote stops: both hosts go on serving from their own stores
    redis_server.kill()
    other = doc(12, 2)
    assert a.client.store_pre_computed(a.inst, other, offset=0).wait(timeout=60).ok
    assert len(a.client.lookup(other, model_name=MODEL).matches) == 2
    local = b.client.lookup(document, model_name=MODEL).matches
    assert [(m.cur_st, m.location) for m in local] == [(2 * C, "local")]  # B's promoted chunk
    # ...and restarts empty: A's next stores reach B again
    redis_server.restart()
    seeds = iter(range(20, 10_000))
    late: list[np.ndarray] = []

    def found_on_b() -> bool:  # new documents until the breakers let writes through again
        late.append(doc(next(seeds), 1))
        assert a.client.store_pre_computed(a.inst, late[-1], offset=0).wait(timeout=60).ok
        return any(b.client.lookup(d, model_name=MODEL).matches for d in late)

    poll(found_on_b, DEADLINE, "discovery to resume after the remote restarted")
