"""The remote tier on real ``redis-server`` processes (``tests/remote/conftest.py``): chunks written
and read back byte for byte on a server and across a 3-master cluster; an expired, corrupted or
truncated value, a killed server or master, are misses, never wrong bytes; the breaker stops
calling a dead remote and lets it back in. Write-behind copies committed chunks out of a real
store without ever blocking it."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import redis

from kvblend.dataplane import remote
from kvblend.dataplane.remote import Breaker, ChunkId, Fetched, Miss, RemoteTier, encode
from kvblend.dataplane.promote import Promoted, promote
from kvblend.dataplane.writebehind import WriteBehind
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.store import ChunkKey, Store, StoreConfig
from tests.harness import remove_prefix
from tests.harness import poll
from tests.remote.conftest import KEY, ClusterProcs, RedisProc

C, L, D = 16, 2, 32
DEADLINE = 30.0


def chunks(n: int, salt: str = "") -> list[tuple[ChunkId, np.ndarray, np.ndarray]]:
    ns = Namespace("remote-test", 1, salt)
    tokens = np.random.default_rng(n).integers(0, 50_000, n * C, dtype=np.uint32)
    out = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        kv = np.random.default_rng(1000 + i).integers(0, 2**16, (2, L, C, D), dtype=np.uint16)
        out.append((ChunkId(ns.root, h, 0, DType.BFLOAT16, L, C, D), tokens[i * C:(i + 1) * C],
                    kv))
    return out


@pytest.mark.slow
def test_a_server_round_trip_and_what_is_a_miss(redis_url: str) -> None:
    (cid, tokens, kv), (other, other_tokens, _) = chunks(2)
    with RemoteTier(redis_url, key=KEY, ttl_s=3600) as tier:
        assert tier.put(cid, encode(cid, tokens, kv, 5, ORIGIN_STANDALONE, key=KEY))
        got = tier.get(cid, tokens)
        assert isinstance(got, Fetched) and bytes(got.kv) == kv.tobytes() and got.pos0 == 5
        assert tier.get(other, other_tokens) is Miss.ABSENT
        assert tier.get(cid, other_tokens) is Miss.OTHER_TOKENS
        raw = redis.Redis.from_url(redis_url)
        value = bytearray(raw.get(cid.key))
        assert 0 < raw.pttl(cid.key) <= 3600 * 1000
        value[-1] ^= 1
        raw.set(cid.key, bytes(value))
        assert tier.get(cid, tokens) is Miss.CORRUPT
        raw.set(cid.key, bytes(value[:-100]))
        assert tier.get(cid, tokens) is Miss.TRUNCATED
        raw.flushall()
        assert tier.get(cid, tokens) is Miss.ABSENT  # an emptied remote: misses, not errors
        raw.close()


@pytest.mark.slow
def test_an_expired_chunk_is_a_miss(redis_url: str) -> None:
    (cid, tokens, kv), = chunks(1)
    with RemoteTier(redis_url, key=KEY, ttl_s=0.05) as tier:
        assert tier.put(cid, encode(cid, tokens, kv, 0, ORIGIN_FINAL, key=KEY))
        poll(lambda: tier.get(cid, tokens) is Miss.ABSENT, DEADLINE, "the TTL to run out")


@pytest.mark.slow
def test_a_dead_server_opens_the_breaker_and_a_restarted_one_closes_it(
        redis_server: RedisProc) -> None:
    (cid, tokens, kv), = chunks(1)
    now = [0.0]
    breaker = Breaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    with RemoteTier(redis_server.url, key=KEY, timeout_s=0.5, breaker=breaker) as tier:
        value = encode(cid, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY)
        assert tier.put(cid, value)
        redis_server.kill()
        assert tier.get(cid, tokens) is Miss.UNAVAILABLE
        assert not tier.put(cid, value)
        assert breaker.is_open and breaker.opened == 1
        calls = []
        tier._client_of("main").get = lambda *a: calls.append(a)  # an open breaker calls nothing
        assert tier.get(cid, tokens) is Miss.UNAVAILABLE and calls == []
        del tier._client_of("main").get
        redis_server.restart()
        now[0] = 5.0  # the cooldown is over: the next call probes, and the server is back
        assert tier.get(cid, tokens) is Miss.ABSENT  # no persistence: the restart emptied it
        assert not breaker.is_open
        assert tier.put(cid, value) and isinstance(tier.get(cid, tokens), Fetched)


@pytest.mark.slow
def test_a_cluster_error_of_redis_py_is_a_failure_not_a_raise(redis_url: str) -> None:
    """redis-py's cluster errors (a slot no node covers) are no RedisError: a call that raises
    one fails like any other remote failure, counted by the breaker, never raised."""
    from redis.exceptions import SlotNotCoveredError

    def uncovered() -> None:
        raise SlotNotCoveredError("no node covers the slot")

    breaker = Breaker(failures=1, cooldown_s=3600.0)
    with RemoteTier(redis_url, key=KEY, breaker=breaker) as tier:
        assert tier._call(uncovered, "k") is remote._FAILED  # not raised
        assert breaker.opened == 1
        assert tier._call(lambda: 1, "k") is remote._FAILED  # the breaker open: not called


def test_a_cluster_spreads_chunks_and_a_killed_master_gives_misses(
        redis_cluster: ClusterProcs) -> None:
    items = chunks(60)
    with RemoteTier(cluster_url(redis_cluster.seeds), key=KEY, timeout_s=0.5) as tier:
        for cid, tokens, kv in items:
            assert tier.put(cid, encode(cid, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY))
        for cid, tokens, kv in items:
            got = tier.get(cid, tokens)
            assert isinstance(got, Fetched) and bytes(got.kv) == kv.tobytes()
        holders = {tier._client_of("main").get_node_from_key(cid.key).port for cid, _, _ in items}
        assert len(holders) == 3  # the keys spread over every master
    victim = redis_cluster.nodes[0]
    victim.kill()
    try:
        alive = [(h, p) for h, p in redis_cluster.seeds if p != victim.port]
        with RemoteTier(cluster_url(alive), key=KEY, timeout_s=0.5,
                        breaker=Breaker(failures=10_000)) as tier:
            outcomes = [tier.get(cid, tokens) for cid, tokens, _ in items]
    finally:
        victim.restart()
        redis_cluster.wait_ok()
    for (cid, _, kv), got in zip(items, outcomes):
        if isinstance(got, Fetched):
            assert bytes(got.kv) == kv.tobytes()  # never wrong bytes
        else:
            assert got in (Miss.UNAVAILABLE, Miss.ABSENT)
    lost = [isinstance(g, Fetched) for g in outcomes].count(False)
    assert 0 < lost < len(items)  # the other masters still answer


def cluster_url(seeds: list[tuple[str, int]]) -> str:
    return "redis+cluster://" + ",".join(f"{h}:{p}" for h, p in seeds)


# ------------------------------------------------------------------------------- write-behind


def commit(store: Store, class_id: int, ns: Namespace, tokens: np.ndarray, pos0: int
           ) -> list[ChunkKey]:
    keys = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        key = ChunkKey(ns.id, h)
        res = store.reserve(class_id, key, tokens[i * C:(i + 1) * C])
        assert res is not None
        res.kv.view(np.uint16)[...] = np.uint16(i + 1)
        store.set_positions(np.array([res.slot]), np.array([pos0 + i * C]), ORIGIN_STANDALONE)
        res.commit()
        keys.append(key)
    return keys


@pytest.mark.slow
def test_write_behind_copies_committed_chunks(store: Store, redis_url: str) -> None:
    ns = Namespace("remote-wb")
    cc = ChunkClass.of(ns.model_name, 1, _layout(), C)
    class_id = store.register_class(cc)
    tokens = np.arange(4 * C, dtype=np.uint32)
    rows = tokens.reshape(4, C)
    keys = commit(store, class_id, ns, tokens, pos0=100)
    ids = [ChunkId(ns.root, k.chunk_hash, 0, cc.dtype, cc.num_layers, C, cc.hidden_dim)
           for k in keys]
    with RemoteTier(redis_url, key=KEY) as tier:
        wb = WriteBehind(store, tier)
        assert wb.offer(class_id, ns.root, keys[:3], rows[:3]) == 3
        assert wb.flush(timeout=DEADLINE) and wb.counts["written"] == 3
        for i in range(3):
            got = tier.get(ids[i], rows[i])
            assert isinstance(got, Fetched), got
            assert np.all(np.frombuffer(got.kv, np.uint16) == i + 1)  # the slot's own bytes
            assert (got.pos0, got.origin) == (100 + i * C, ORIGIN_STANDALONE)
        # gone before its turn, or not the tokens the store holds: skipped, never written
        store.clear()
        assert wb.offer(class_id, ns.root, keys[3:], rows[3:]) == 1
        assert wb.flush(timeout=DEADLINE)
        keys2 = commit(store, class_id, ns, tokens, pos0=0)
        assert wb.offer(class_id, ns.root, keys2[:1], rows[1:2]) == 1
        assert wb.flush(timeout=DEADLINE)
        wb.close(timeout=DEADLINE)
        assert tier.get(ids[3], rows[3]) is Miss.ABSENT
        assert wb.counts == {"written": 3, "dropped": 0, "skipped": 2, "failed": 0,
                             "replayed": 0, "replay_dropped": 0}


class BlockedTier:
    """A remote whose writes wait for ``release``: the queue fills behind it."""

    key = KEY

    def __init__(self) -> None:
        self.release, self.entered, self.puts = threading.Event(), threading.Event(), 0
        self.inside, self.most_inside = 0, 0
        self._lock = threading.Lock()

    def put(self, chunk: ChunkId, value: bytes, peer: object = None) -> bool:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.entered.set()
        self.release.wait(DEADLINE)
        with self._lock:
            self.inside -= 1
            self.puts += 1
        return True


def test_a_full_queue_drops_and_never_blocks_the_store(store: Store) -> None:
    ns = Namespace("remote-drop")
    class_id = store.register_class(ChunkClass.of(ns.model_name, 1, _layout(), C))
    tokens = np.arange(8 * C, dtype=np.uint32)
    keys = commit(store, class_id, ns, tokens, pos0=0)
    tier = BlockedTier()
    wb = WriteBehind(store, tier, capacity=2, writers=1)  # type: ignore[arg-type]
    rows = tokens.reshape(8, C)
    assert wb.offer(class_id, ns.root, keys[:1], rows[:1]) == 1
    assert tier.entered.wait(DEADLINE)  # the writer holds the first, blocked in the remote
    assert wb.offer(class_id, ns.root, keys[1:], rows[1:]) == 2  # returns at once
    assert wb.counts["dropped"] == 5
    tier.release.set()
    assert wb.flush(timeout=DEADLINE) and tier.puts == 3 and wb.counts["written"] == 3
    wb.close(timeout=DEADLINE)


def test_writers_write_at_once(store: Store) -> None:
    ns = Namespace("remote-writers")
    class_id = store.register_class(ChunkClass.of(ns.model_name, 1, _layout(), C))
    tokens = np.arange(3 * C, dtype=np.uint32)
    keys = commit(store, class_id, ns, tokens, pos0=0)
    tier = BlockedTier()
    wb = WriteBehind(store, tier, writers=3)  # type: ignore[arg-type]
    assert wb.offer(class_id, ns.root, keys, tokens.reshape(3, C)) == 3
    poll(lambda: tier.inside == 3, DEADLINE, "three writes in the remote at once")
    tier.release.set()
    assert wb.flush(timeout=DEADLINE) and tier.puts == 3 and tier.most_inside == 3
    wb.close(timeout=DEADLINE)


def _layout() -> KVLayout:
    return KVLayout(L, 4 * C, D, DType.BFLOAT16)


# ------------------------------------------------------------------------------- promotion


@pytest.mark.slow
def test_a_chunk_written_behind_on_one_host_is_promoted_on_another(
        shm_prefix: str, store: Store, redis_url: str) -> None:
    """Two stores stand for two hosts: host A writes behind, host B promotes the chunk into its
    own slab, byte for byte with its provenance; B then holds it like any stored chunk."""
    ns = Namespace("remote-promote")
    cc = ChunkClass.of(ns.model_name, 1, _layout(), C)
    tokens = np.arange(2 * C, dtype=np.uint32) + 7
    rows = tokens.reshape(2, C)
    class_a = store.register_class(cc)
    keys = commit(store, class_a, ns, tokens, pos0=40)
    ids = [ChunkId(ns.root, k.chunk_hash, 0, cc.dtype, cc.num_layers, C, cc.hidden_dim)
           for k in keys]
    host_b = Store.open(shm_prefix + "_b", StoreConfig(capacity_bytes=1 << 20,
                                                       page_bytes=1 << 18, min_slot_bytes=4096),
                        wipe=True)
    try:
        class_b = host_b.register_class(cc)
        with RemoteTier(redis_url, key=KEY) as tier:
            assert promote(host_b, tier, class_b, ns.id, ids[0], rows[0]) is Miss.ABSENT
            wb = WriteBehind(store, tier)
            assert wb.offer(class_a, ns.root, keys, rows) == 2 and wb.flush(timeout=DEADLINE)
            wb.close(timeout=DEADLINE)
            assert promote(host_b, tier, class_b, ns.id, ids[0], rows[1]) is Miss.OTHER_TOKENS
            assert not host_b.contains_key(keys[0])  # a miss reserved nothing
            for i in (0, 1):
                assert promote(host_b, tier, class_b, ns.id, ids[i], rows[i]) is Promoted.PROMOTED
            assert promote(host_b, tier, class_b, ns.id, ids[0], rows[0]) is Promoted.EXISTS
        with host_b.pinned(keys) as chunks:
            for i, got in enumerate(chunks):
                assert got is not None and np.all(got.kv.view(np.uint16) == i + 1)
                assert np.array_equal(got.token_ids, rows[i])
        pos, origin = host_b.provenance(ns.id, [k.chunk_hash for k in keys])
        assert pos.tolist() == [40, 40 + C] and origin.tolist() == [ORIGIN_STANDALONE] * 2
        other = ChunkClass.of(ns.model_name, 1, KVLayout(L, 4 * C, D, DType.FLOAT16), C)
        with pytest.raises(ValueError, match="not the layout"):
            promote(host_b, tier, host_b.register_class(other), ns.id, ids[0], rows[0])
    finally:
        host_b.close()
        remove_prefix(shm_prefix + "_b")
