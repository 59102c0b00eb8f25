"""The real-server fixtures do what they say: a standalone server that expires, dies and comes back empty,
and a 3-master cluster whose masters can be killed and restarted one at a time."""

from __future__ import annotations

import pytest
import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

from tests.harness import poll
from tests.remote.conftest import ClusterProcs, RedisProc

pytestmark = pytest.mark.slow

KEYS = [f"kvb:{i}" for i in range(100)]


def plain(url: str) -> redis.Redis:
    # no retries: a server that is down is reported at once, not after a backoff
    return redis.Redis.from_url(url, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0))


def cluster_client(cluster: ClusterProcs) -> RedisCluster:
    return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in cluster.seeds],
                        retry=Retry(NoBackoff(), 1), socket_connect_timeout=2)


@pytest.mark.parametrize("run", ["first", "second"])
def test_each_test_starts_on_an_empty_server(redis_url: str, run: str) -> None:
    with plain(redis_url) as r:
        assert r.dbsize() == 0, "redis_url did not FLUSHALL: a key from the other run is still there"
        r.set("left-behind", run)


def test_set_get(redis_url: str) -> None:
    with plain(redis_url) as r:
        assert r.set("chunk", b"\x00\xffkv")
        assert r.get("chunk") == b"\x00\xffkv"
        assert r.get("absent") is None


def test_expired_key_is_a_miss(redis_url: str) -> None:
    with plain(redis_url) as r:
        r.set("chunk", b"kv")
        assert r.pexpire("chunk", 5)
        assert 0 <= r.pttl("chunk") <= 5
        poll(lambda: r.get("chunk") is None, 10, "a key with a 5 ms TTL reads as a miss")
        assert r.exists("chunk") == 0
        assert r.pttl("chunk") == -2  # no such key


def test_kill_then_restart_on_the_same_port_comes_back_empty(redis_server: RedisProc, redis_url: str) -> None:
    port = redis_server.port
    with plain(redis_url) as r:
        r.set("chunk", b"kv")
        redis_server.kill()
        assert not redis_server.running
        with pytest.raises(redis.ConnectionError):
            r.get("chunk")

        redis_server.restart()
        assert redis_server.port == port and redis_server.url == redis_url
        assert r.ping()
        assert r.get("chunk") is None, "data survived a restart: persistence is on"

        r.set("chunk", b"kv")
        redis_server.stop()  # SIGTERM: a clean shutdown, still nothing saved
        with pytest.raises(redis.ConnectionError):
            r.get("chunk")
        redis_server.restart()
        assert r.get("chunk") is None


def test_cluster_keys_spread_over_every_master(redis_cluster: ClusterProcs) -> None:
    with cluster_client(redis_cluster) as rc:
        for key in KEYS:
            rc.set(key, key)
        assert [rc.get(key) for key in KEYS] == [key.encode() for key in KEYS]

    counts = []
    for node in redis_cluster.nodes:
        with node.client() as direct:
            counts.append(direct.dbsize())
            mine = [key for key in KEYS if redis_cluster.node_for_key(key) is node]
            assert [direct.get(key) for key in mine] == [key.encode() for key in mine]
    assert sum(counts) == len(KEYS)
    assert all(count > 0 for count in counts), f"keys per master: {counts}"


def test_cluster_killed_master_fails_only_its_slots_and_rejoins(redis_cluster: ClusterProcs) -> None:
    victim = redis_cluster.nodes[1]
    lost = [key for key in KEYS if redis_cluster.node_for_key(key) is victim]
    kept = [key for key in KEYS if key not in lost]
    assert lost and kept
    with victim.client() as direct:
        node_id = direct.execute_command("CLUSTER", "MYID")

    with cluster_client(redis_cluster) as rc:
        for key in KEYS:
            rc.set(key, key)
        try:
            victim.kill()
            # once the others have flagged it FAIL (the state a longer outage settles in), not just before
            redis_cluster.wait_failed(victim)
            for key in lost:
                with pytest.raises(redis.ConnectionError):
                    rc.get(key)
            assert [rc.get(key) for key in kept] == [key.encode() for key in kept]
        finally:
            if not victim.running:
                victim.restart()
        redis_cluster.wait_ok()

        with victim.client() as direct:
            assert direct.execute_command("CLUSTER", "MYID") == node_id, "rejoined as a new node"
        assert [rc.get(key) for key in lost] == [None] * len(lost), "a restarted master kept its data"
        assert [rc.get(key) for key in kept] == [key.encode() for key in kept]
        rc.set(lost[0], "again")
        assert rc.get(lost[0]) == b"again"
