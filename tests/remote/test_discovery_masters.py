"""Discovery over every master: on a real 3-master cluster each master keeps its own record stream,
beside the values it holds, and a second host tails them all, so one master killed with SIGKILL
costs only its own records: the records written to the live masters are found meanwhile, and its
stream is read again once it is back. A standalone server keeps its one stream."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from kvblend.dataplane.discovery import Discovery
from kvblend.dataplane.remote import STREAM, ChunkId, RemoteTier, encode
from kvblend.shm.fingerprint import FingerprintIndex
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.layout import DType
from kvblend.shm.remotes import RemoteChunks, wall_ms
from kvblend.shm.store import Store, StoreConfig
from tests.harness import poll
from tests.remote.conftest import KEY, ClusterProcs, RedisProc

pytestmark = pytest.mark.slow

C, L, D = 16, 2, 32
DEADLINE = 30.0


def chunks(n: int, seed: int) -> list[tuple[ChunkId, bytes]]:
    """``n`` chunks of one document, each with its encoded value."""
    ns = Namespace("discovery-masters", 1, str(seed))
    tokens = np.random.default_rng(seed).integers(0, 50_000, n * C, dtype=np.uint32)
    out = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        cid = ChunkId(ns.root, h, 0, DType.BFLOAT16, L, C, D)
        kv = np.full((2, L, C, D), i, np.uint16)
        out.append((cid, encode(cid, tokens[i * C:(i + 1) * C], kv, i * C, ORIGIN_STANDALONE, key=KEY)))
    return out


class Reader:
    """A second host: its own store, fingerprints and remote-known table, and a Discovery on its
    own client of the tier."""

    def __init__(self, prefix: str, url: str) -> None:
        self.store = Store.open(prefix, StoreConfig(capacity_bytes=1 << 20, page_bytes=1 << 18,
                                                    min_slot_bytes=4096), wipe=True)
        self.fps = FingerprintIndex.open(prefix, C, 1 << 12, wipe=True)
        self.remotes = RemoteChunks.open(prefix, 1 << 12, wipe=True)
        self.tier = RemoteTier(url, key=KEY, timeout_s=0.5, block_s=0.2)
        self.discovery = Discovery(self.tier, self.store, self.fps, self.remotes, retry_s=0.05,
                                   refresh_s=0.2).start()

    def knows(self, items: list[tuple[ChunkId, bytes]]) -> np.ndarray:
        return self.remotes.knows([cid.chunk_hash for cid, _ in items], wall_ms())

    def wait_for(self, items: list[tuple[ChunkId, bytes]], what: str) -> None:
        poll(lambda: bool(self.knows(items).all()), DEADLINE, what)

    def close(self) -> None:
        self.discovery.close(DEADLINE)
        self.tier.close()
        self.remotes.close()
        self.fps.close()
        self.store.close()


@pytest.fixture
def reader_at(shm_prefix: str) -> Iterator:
    made: list[Reader] = []

    def make(url: str) -> Reader:
        made.append(Reader(shm_prefix, url))
        return made[-1]

    yield make
    for r in made:
        r.close()


def streams_on(node: RedisProc) -> dict[str, int]:
    """The record streams a master holds, with their lengths."""
    with node.client() as raw:
        return {k.decode(): raw.xlen(k) for k in raw.keys(f"{STREAM}*")}


def test_each_master_keeps_the_records_of_its_own_values(redis_cluster: ClusterProcs) -> None:
    redis_cluster.wait_ok()
    items = chunks(30, seed=1)
    with RemoteTier(redis_cluster.cluster_url, key=KEY, timeout_s=0.5) as tier:
        assert all(tier.put(cid, value) for cid, value in items)
        named = tier.record_streams()
    assert named is not None and len(named) == 3
    for node in redis_cluster.nodes:
        held = sum(redis_cluster.node_for_key(cid.key) is node for cid, _ in items)
        streams = streams_on(node)
        assert held > 0 and list(streams.values()) == [held], (node, streams)
        assert set(streams) < set(named)  # one of the streams every reader tails


def test_a_second_host_finds_the_records_of_the_live_masters_while_one_is_dead(
        redis_cluster: ClusterProcs, reader_at) -> None:
    redis_cluster.wait_ok()
    url = redis_cluster.cluster_url
    before, during = chunks(12, seed=2), chunks(36, seed=3)
    victim = redis_cluster.nodes[1]
    writer = RemoteTier(url, key=KEY, timeout_s=0.5)
    try:
        assert all(writer.put(cid, value) for cid, value in before)
        victim.kill()
        dead = [redis_cluster.node_for_key(cid.key) is victim for cid, _ in during]
        written = [writer.put(cid, value) for cid, value in during]
        assert written == [not d for d in dead] and 0 < sum(dead) < len(during)
        # a host that starts while the master is dead finds every record of the live ones
        reader = reader_at(url)
        live = [item for item in before + during
                if redis_cluster.node_for_key(item[0].key) is not victim]
        reader.wait_for(live, "the live masters' records found on a second host")
        assert len(reader.discovery.streams) == 3
        assert not reader.knows([item for item, d in zip(during, dead) if d]).any()
        # and findable by its tokens: Discovery enters a batch's records in the remote-known
        # table before their fingerprints, so the entry may follow the poll above by a moment
        poll(lambda: reader.fps.contains(live[0][0].chunk_hash), DEADLINE,
             "a live master's record findable by its tokens")
        # the master comes back (empty: no persistence): what is written to it is found too
        victim.restart()
        redis_cluster.wait_ok()
        # its node's breaker lets writes through again once its cooldown is over
        poll(lambda: all([writer.put(cid, value) for cid, value in during]), 60,
             "writes to the restarted master")
        reader.wait_for(during, "the restarted master's records found")
    finally:
        writer.close()
        if not victim.running:
            victim.restart()
            redis_cluster.wait_ok()


def test_a_server_keeps_one_stream(redis_server: RedisProc, redis_url: str, reader_at) -> None:
    items = chunks(4, seed=4)
    with RemoteTier(redis_url, key=KEY) as tier:
        assert tier.record_streams() == [STREAM]
        assert all(tier.put(cid, value) for cid, value in items)
    assert streams_on(redis_server) == {STREAM: 4}
    reader = reader_at(redis_url)
    reader.wait_for(items, "the server's records found")
    assert reader.discovery.streams == [STREAM]
