"""A breaker per node and the replay of failed write-behind, on real ``redis-server`` processes
(``tests/remote/conftest.py``): with one master of three killed or paused, writes and reads of keys
on the two live masters go on while the dead one's breaker is open; the writes that failed meanwhile
are held, one per chunk and bounded, and written once their node is back, from the slab as it is
then (a chunk evicted meanwhile is skipped)."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from kvblend.dataplane.remote import (TIER, Breaker, BreakerState, ChunkId, Fetched, Miss,
                                      RemoteTier, encode)
from kvblend.dataplane.writebehind import WriteBehind
from kvblend.shm.events import EventLog
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.store import ChunkKey, Store
from tests.harness import poll
from tests.remote.conftest import KEY, ClusterProcs, RedisProc

pytestmark = pytest.mark.slow

C, L, D = 16, 2, 32
DEADLINE = 30.0


@contextmanager
def paused(node: RedisProc) -> Iterator[None]:
    """``node`` stopped with SIGSTOP (its sockets stay open: calls time out) until the block ends."""
    assert node.running and node._proc is not None, f"{node!r} is not running"
    pid = node._proc.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


class Doc:
    """``n`` chunks of one document committed to ``store``, chunk i's KV all ``fill + i``."""

    def __init__(self, store: Store, name: str, n: int) -> None:
        self.store, self.ns = store, Namespace(name)
        self.cc = ChunkClass.of(self.ns.model_name, 1, KVLayout(L, n * C, D, DType.BFLOAT16), C)
        self.class_id = store.register_class(self.cc)
        self.tokens = np.arange(n * C, dtype=np.uint32) + 3
        self.rows = self.tokens.reshape(n, C)
        self.keys = [ChunkKey(self.ns.id, h) for h in chunk_hashes(self.ns, self.tokens, C)]
        self.ids = [ChunkId(self.ns.root, k.chunk_hash, 0, self.cc.dtype, L, C, D)
                    for k in self.keys]

    def commit(self, which: list[int], fill: int) -> None:
        for i in which:
            res = self.store.reserve(self.class_id, self.keys[i], self.rows[i])
            assert res is not None
            res.kv.view(np.uint16)[...] = np.uint16(fill + i)
            self.store.set_positions(np.array([res.slot]), np.array([i * C]), ORIGIN_STANDALONE)
            res.commit()

    def offer(self, wb: WriteBehind, which: list[int]) -> None:
        assert wb.offer(self.class_id, self.ns.root, [self.keys[i] for i in which],
                        self.rows[which]) == len(which)

    def fill_of(self, tier: RemoteTier, i: int) -> int | Miss:
        """The remote's copy of chunk i: its fill (checked uniform), or the miss."""
        got = tier.get(self.ids[i], self.rows[i])
        if not isinstance(got, Fetched):
            return got
        kv = np.frombuffer(got.kv, np.uint16)
        assert np.all(kv == kv[0]), "a chunk's KV is one fill"
        return int(kv[0])


def node_name(node: RedisProc) -> str:
    host, port = node.address
    return f"{host}:{port}"


def test_a_dead_master_stops_writes_to_its_own_keys_only(redis_cluster: ClusterProcs) -> None:
    ns = Namespace("breaker-per-node")
    tokens = np.arange(48 * C, dtype=np.uint32)
    ids = [ChunkId(ns.root, h, 0, DType.BFLOAT16, L, C, D) for h in chunk_hashes(ns, tokens, C)]
    rows = tokens.reshape(48, C)
    kv = [np.full((2, L, C, D), i, np.uint16) for i in range(48)]
    victim = redis_cluster.nodes[0]
    on_victim = [redis_cluster.node_for_key(cid.key) is victim for cid in ids]
    assert 0 < sum(on_victim) < 48
    with RemoteTier(redis_cluster.cluster_url, key=KEY, timeout_s=0.5,
                    breaker=Breaker(failures=2, cooldown_s=3600.0)) as tier:
        assert tier.get(ids[0], rows[0]) is Miss.ABSENT  # the slot map is read: nodes are known
        assert {tier.node_of(cid.key) for cid in ids} == {node_name(n) for n in redis_cluster.nodes}
        victim.kill()
        try:
            written = [tier.put(cid, encode(cid, rows[i], kv[i], 0, ORIGIN_STANDALONE, key=KEY))
                       for i, cid in enumerate(ids)]
            assert written == [not dead for dead in on_victim]  # every live master's key written
            for i, cid in enumerate(ids):
                got = tier.get(cid, rows[i])
                if on_victim[i]:
                    assert got is Miss.UNAVAILABLE
                else:
                    assert isinstance(got, Fetched) and bytes(got.kv) == kv[i].tobytes()
            states = {node: b.state for node, b in tier.breakers.items()}
            assert states.pop(node_name(victim)) is BreakerState.OPEN
            assert set(states.values()) == {BreakerState.CLOSED}  # the live masters' and TIER's
            assert tier.breakers[node_name(victim)].opened == 1
        finally:
            victim.restart()
            redis_cluster.wait_ok()


def test_writes_that_failed_on_a_paused_master_are_replayed_from_the_slab(
        redis_cluster: ClusterProcs, store: Store) -> None:
    doc = Doc(store, "breaker-replay", 24)
    doc.commit(list(range(24)), fill=100)
    victim = redis_cluster.nodes[1]
    dead = [i for i, cid in enumerate(doc.ids) if redis_cluster.node_for_key(cid.key) is victim]
    assert 0 < len(dead) < 24
    with RemoteTier(redis_cluster.cluster_url, key=KEY, timeout_s=0.3,
                    breaker=Breaker(failures=2, cooldown_s=0.3)) as tier:
        assert doc.fill_of(tier, 0) is Miss.ABSENT  # the slot map is read: nodes are known
        wb = WriteBehind(store, tier, writers=2, retry_s=0.05)
        with paused(victim):
            doc.offer(wb, list(range(24)))
            assert wb.flush(timeout=DEADLINE)
            assert wb.counts["written"] == 24 - len(dead)  # the live masters' at once
            poll(lambda: wb.held == len(dead), DEADLINE, "every paused master's write held")
            # meanwhile the slab changes: half of the held chunks are stored again with other
            # bytes, the rest are evicted
            store.clear()
            again, evicted = dead[::2], dead[1::2]
            doc.commit(again, fill=200)
            for i in set(range(24)) - set(dead):
                assert doc.fill_of(tier, i) == 100 + i
        poll(lambda: wb.held == 0, DEADLINE, "the held writes replayed once the master is back")
        assert wb.flush(timeout=DEADLINE)
        # a write that timed out may still land when the master resumes: the replay comes after
        for i in again:
            poll(lambda: doc.fill_of(tier, i) == 200 + i, DEADLINE, f"chunk {i} as the slab is now")
        for i in evicted:
            assert doc.fill_of(tier, i) in (Miss.ABSENT, 100 + i)  # never replayed
        assert wb.counts["skipped"] == len(evicted)
        assert wb.counts["replayed"] >= len(dead) and wb.counts["replay_dropped"] == 0
        wb.close(timeout=DEADLINE)


def test_held_writes_are_one_per_chunk_and_bounded_oldest_dropped(
        redis_server: RedisProc, store: Store, shm_prefix: str) -> None:
    doc = Doc(store, "breaker-bound", 10)
    doc.commit(list(range(10)), fill=0)
    now = [0.0]  # the breaker's clock: it probes only when the test says so
    breaker = Breaker(failures=1, cooldown_s=5.0, clock=lambda: now[0])
    if not redis_server.running:
        redis_server.start()
    with RemoteTier(redis_server.url, key=KEY, timeout_s=0.5, breaker=breaker) as tier:
        assert doc.fill_of(tier, 0) is Miss.ABSENT
        events = EventLog.create(shm_prefix)
        wb = WriteBehind(store, tier, events=events, writers=1, replay_chunks=5, retry_s=0.05)
        redis_server.kill()
        try:
            doc.offer(wb, list(range(8)))
            assert wb.flush(timeout=DEADLINE)
            assert breaker.state is BreakerState.OPEN and tier.node_of(doc.ids[0].key) == TIER
            assert wb.held == 5 and wb.counts["replay_dropped"] == 3  # 0, 1, 2 dropped
            doc.offer(wb, [3, 4])  # held already: they move to the newest end, no second entry
            assert wb.flush(timeout=DEADLINE)
            assert wb.held == 5 and wb.counts["replay_dropped"] == 3
            doc.offer(wb, [8])  # drops the oldest now: 5
            assert wb.flush(timeout=DEADLINE)
            assert wb.held == 5 and wb.counts["replay_dropped"] == 4
            assert wb.counts["failed"] == 11 and wb.counts["replayed"] == 0
        finally:
            redis_server.start()
        now[0] = 5.0  # the cooldown is over: the replay probes with one write, then sends all
        poll(lambda: wb.held == 0, DEADLINE, "the held writes replayed")
        assert wb.flush(timeout=DEADLINE)
        assert {i for i in range(10) if doc.fill_of(tier, i) == i} == {3, 4, 6, 7, 8}
        assert wb.counts["replayed"] == 5 and wb.counts["written"] == 5
        wb.close(timeout=DEADLINE)
        counters = events.counters()  # what /metrics exports
        assert counters["remote_replayed_writes"] == 5
        assert counters["remote_replay_dropped_writes"] == 4
        events.close()


def test_held_writes_are_bounded_in_bytes(redis_server: RedisProc, store: Store) -> None:
    doc = Doc(store, "breaker-bytes", 4)
    doc.commit(list(range(4)), fill=0)
    breaker = Breaker(failures=1, cooldown_s=3600.0)
    if not redis_server.running:
        redis_server.start()
    with RemoteTier(redis_server.url, key=KEY, timeout_s=0.5, breaker=breaker) as tier:
        wb = WriteBehind(store, tier, writers=1, replay_bytes=2 * doc.ids[0].value_bytes + 1)
        redis_server.kill()
        try:
            doc.offer(wb, list(range(4)))
            assert wb.flush(timeout=DEADLINE)
            assert wb.held == 2 and wb.counts["replay_dropped"] == 2
        finally:
            wb.close(timeout=DEADLINE)
            redis_server.start()
