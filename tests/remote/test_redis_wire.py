"""``dataplane.redis_wire``'s two readers on real ``redis-server`` processes
(``tests/remote/conftest.py``): the direct one (the installed redis-py is one it knows) and the one a
redis-py outside KNOWN_REDIS_PY gets (``direct_reads`` of such a version) read the same bytes of a
value, the same short range at its end and nothing of a missing key, on a server and across a
cluster; an error reply fails either, and the next read on the same client is right again."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.cluster import ClusterNode, RedisCluster

from kvblend.dataplane.redis_wire import KNOWN_REDIS_PY, BadReply, direct_reads, range_reader
from tests.remote.conftest import ClusterProcs

SIZE = 300_000  # several receives for the direct reader, not a multiple of any range below
RANGES = [(0, SIZE), (1234, 1 << 16), (SIZE - 10, 10), (7, 1)]
KEYS = [f"wire:{i}" for i in range(6)]  # spread over the cluster's three masters
OUTSIDE = ".".join(map(str, KNOWN_REDIS_PY[1]))  # the first version the direct reader does not know
DIRECT = {"direct": direct_reads(redis.__version__), "public": direct_reads(OUTSIDE)}


@pytest.fixture(params=["server", "cluster"])
def client(request: pytest.FixtureRequest) -> Iterator[tuple[Any, bool]]:
    """A client of an empty server or cluster, and whether it is a cluster client."""
    if request.param == "server":
        c: Any = redis.Redis.from_url(request.getfixturevalue("redis_url"), protocol=2)
    else:
        cluster: ClusterProcs = request.getfixturevalue("redis_cluster")
        c = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in cluster.seeds], protocol=2)
        for key in KEYS:
            c.delete(key)
    try:
        yield c, request.param == "cluster"
    finally:
        c.close()


def read(client: tuple[Any, bool], how: str, key: str, start: int, size: int
         ) -> tuple[int, bytes, bytes]:
    """``range_reader``'s read of ``size`` bytes at ``start``: the count, the buffer, and the
    spans it was given as they came in, joined."""
    dest, spans = bytearray(size), bytearray()
    got = range_reader(*client, key, DIRECT[how])(start, memoryview(dest), spans.extend)
    return got, bytes(dest), bytes(spans)


def test_the_installed_redis_py_reads_direct_and_another_does_not() -> None:
    assert DIRECT == {"direct": True, "public": False}


@pytest.mark.parametrize("how", DIRECT)
def test_both_readers_read_the_same_bytes(client: tuple[Any, bool], how: str) -> None:
    values = {key: os.urandom(SIZE) for key in KEYS}
    for key, value in values.items():
        client[0].set(key, value)
    for key, value in values.items():
        for start, size in RANGES:
            got, dest, spans = read(client, how, key, start, size)
            assert (got, dest, spans) == (size, value[start:start + size], dest)


@pytest.mark.parametrize("how", DIRECT)
def test_a_range_past_the_end_is_short_and_a_missing_key_empty(client: tuple[Any, bool],
                                                                how: str) -> None:
    value = os.urandom(SIZE)
    client[0].set(KEYS[0], value)
    got, dest, spans = read(client, how, KEYS[0], SIZE - 1000, 4096)
    assert (got, dest[:got], spans) == (1000, value[-1000:], value[-1000:])
    assert read(client, how, KEYS[1], 0, 4096)[0] == 0


@pytest.mark.parametrize("how", DIRECT)
def test_an_error_reply_fails_the_read_and_the_next_one_is_right(client: tuple[Any, bool],
                                                                 how: str) -> None:
    client[0].rpush(KEYS[0], b"not a string")
    client[0].set(KEYS[1], b"0123456789")
    with pytest.raises(BadReply if how == "direct" else redis.ResponseError, match="WRONGTYPE"):
        read(client, how, KEYS[0], 0, 16)
    assert read(client, how, KEYS[1], 2, 5)[:2] == (5, b"23456")
