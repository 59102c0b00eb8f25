"""``RemoteTier.get_into`` on real ``redis-server`` processes (``tests/remote/conftest.py``): the KV
read straight into a caller's buffer, in one or several pieces at once, byte for byte on a server
and across a 3-master cluster; every value ``get`` refuses is refused with the same miss; a value
replaced while it is read, a piece that stalls or is cut mid-reply, a killed server or master, are
misses, never wrong bytes, and leave no connection out of step with its replies.

Faults between the tier and the server come from ``Relay``, a TCP relay that can hold back what the
server sends (from a given byte on) or cut every connection it carries."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import redis

from kvblend.dataplane.remote import (MAX_STREAMS, Breaker, ChunkId, Fetched, Miss, RemoteTier,
                                      decode, encode)
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.layout import DType
from tests.harness import HOST, poll
from tests.remote.conftest import KEY, ClusterProcs, RedisProc

pytestmark = pytest.mark.slow

C = 16
SMALL = (2, 32)    # (layers, hidden): 4 KiB of KV, always one piece
LARGE = (4, 4096)  # 1 MiB of KV: up to 16 pieces, several receives each; not a multiple of 3
DEADLINE = 30.0  # generous: the suite shares two cores with other work
STALL_S = 1.0  # the tier's timeout where a stalled reply must time out
STREAMS = (1, 3, 8)
Background = Callable[[Callable[[], object]], Callable[[], object]]


def chunks(n: int, layout: tuple[int, int] = LARGE, salt: str = ""
           ) -> list[tuple[ChunkId, np.ndarray, np.ndarray]]:
    layers, hidden = layout
    ns = Namespace("read-into-test", 1, salt)
    tokens = np.random.default_rng(n).integers(0, 50_000, n * C, dtype=np.uint32)
    out = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
        kv = rng.integers(0, 2**16, (2, layers, C, hidden), np.uint16)
        out.append((ChunkId(ns.root, h, 0, DType.BFLOAT16, layers, C, hidden),
                    tokens[i * C:(i + 1) * C], kv))
    return out


def buffer_for(cid: ChunkId) -> np.ndarray:
    """A destination that starts out holding none of the chunk's bytes."""
    return np.full(cid.kv_bytes, 0xA5, np.uint8)


def assert_fetched(got: Fetched | Miss, dest: np.ndarray, kv: np.ndarray, pos0: int) -> None:
    assert isinstance(got, Fetched), got
    assert dest.tobytes() == kv.tobytes() and (got.pos0, got.origin) == (pos0, ORIGIN_STANDALONE)
    assert np.shares_memory(np.frombuffer(got.kv, np.uint8), dest)  # no copy of the KV


def put_all(tier: RemoteTier, items: list[tuple[ChunkId, np.ndarray, np.ndarray]]) -> None:
    for i, (cid, tokens, kv) in enumerate(items):
        assert tier.put(cid, encode(cid, tokens, kv, 10 * i, ORIGIN_STANDALONE, key=KEY))


# ------------------------------------------------------------------------------ round trips


@pytest.mark.parametrize("layout", [SMALL, LARGE], ids=["4KiB", "1MiB"])
@pytest.mark.parametrize("streams", STREAMS)
def test_a_server_round_trip(redis_url: str, streams: int, layout: tuple[int, int]) -> None:
    items = chunks(3, layout)
    with RemoteTier(redis_url, key=KEY, timeout_s=DEADLINE) as tier:
        put_all(tier, items)
        for i, (cid, tokens, kv) in enumerate(items):
            dest = buffer_for(cid)
            assert_fetched(tier.get_into(cid, tokens, dest, streams), dest, kv, 10 * i)


@pytest.mark.parametrize("layout", [SMALL, LARGE], ids=["4KiB", "1MiB"])
@pytest.mark.parametrize("streams", STREAMS)
def test_a_cluster_round_trip(redis_cluster: ClusterProcs, streams: int,
                              layout: tuple[int, int]) -> None:
    items = chunks(12, layout)
    with RemoteTier(redis_cluster.cluster_url, key=KEY, timeout_s=DEADLINE) as tier:
        put_all(tier, items)
        for i, (cid, tokens, kv) in enumerate(items):
            dest = buffer_for(cid)
            assert_fetched(tier.get_into(cid, tokens, dest, streams), dest, kv, 10 * i)
    assert len({redis_cluster.node_for_key(cid.key).port for cid, _, _ in items}) == 3


def test_a_slab_slot_shaped_destination(redis_url: str) -> None:
    (cid, tokens, kv), = chunks(1)
    slot = np.zeros((2, cid.num_layers, C, cid.hidden_dim), np.uint16)  # a slot's KV, bf16 bits
    with RemoteTier(redis_url, key=KEY, timeout_s=DEADLINE) as tier:
        put_all(tier, [(cid, tokens, kv)])
        got = tier.get_into(cid, tokens, slot.view(np.uint8), streams=4)
    assert isinstance(got, Fetched) and np.array_equal(slot, kv)


def test_what_get_into_refuses_to_fill(redis_url: str) -> None:
    (cid, tokens, _), = chunks(1, SMALL)
    ok = buffer_for(cid)
    read_only = buffer_for(cid)
    read_only.flags.writeable = False
    with RemoteTier(redis_url, key=KEY, timeout_s=DEADLINE) as tier:
        for dest in (ok[:-1], np.zeros(cid.kv_bytes * 2, np.uint8)[::2], read_only,
                     ok.view(np.uint16), memoryview(ok)):
            with pytest.raises(ValueError, match="dest"):
                tier.get_into(cid, tokens, dest)  # type: ignore[arg-type]
        for streams in (0, MAX_STREAMS + 1):
            with pytest.raises(ValueError, match="streams"):
                tier.get_into(cid, tokens, ok, streams)


# ------------------------------------------------------------------------------- misses


def stored_values(items: list[tuple[ChunkId, np.ndarray, np.ndarray]]) -> dict[str, bytes]:
    """Values other than the first chunk's own, by name, to be stored under its key."""
    (cid, tokens, kv), (other, other_tokens, other_kv) = items[:2]
    value = bytes(encode(cid, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY))
    corrupt_kv, corrupt_head, bad_magic = bytearray(value), bytearray(value), bytearray(value)
    corrupt_kv[cid.kv_at + cid.kv_bytes // 2] ^= 1
    corrupt_head[40] ^= 1  # the root: a value of another namespace
    bad_magic[0] ^= 1
    return {"corrupt KV byte": bytes(corrupt_kv), "truncated": value[:-100],
            "longer": value + b"\0" * 64, "header only": value[:88], "empty": b"",
            "other root": bytes(corrupt_head), "not ours": bytes(bad_magic),
            "other chunk": encode(other, other_tokens, other_kv, 0, ORIGIN_FINAL, key=KEY)}


@pytest.mark.parametrize("streams", [1, 5])
def test_misses_are_the_misses_of_get(redis_url: str, streams: int) -> None:
    items = chunks(2)
    (cid, tokens, kv), (_, other_tokens, _) = items
    raw = redis.Redis.from_url(redis_url)
    with RemoteTier(redis_url, key=KEY, timeout_s=DEADLINE) as tier:
        dest = buffer_for(cid)
        assert tier.get_into(cid, tokens, dest, streams) is Miss.ABSENT
        put_all(tier, items[:1])
        assert tier.get_into(cid, other_tokens, dest, streams) is Miss.OTHER_TOKENS
        seen = {}
        for name, value in stored_values(items).items():
            raw.set(cid.key, value)
            seen[name] = tier.get_into(cid, tokens, buffer_for(cid), streams)
            assert seen[name] is decode(value, cid, tokens, key=KEY) is tier.get(cid, tokens), name
        assert tier.breaker.opened == 0 and not tier.breaker.is_open  # misses, not failures
    raw.close()
    assert seen["corrupt KV byte"] is Miss.CORRUPT and seen["other chunk"] is Miss.OTHER_CHUNK
    assert seen["truncated"] is seen["longer"] is seen["empty"] is Miss.TRUNCATED


# ------------------------------------------------------------------ faults between the pieces


class Relay:
    """A TCP relay to ``upstream``. ``hold(after)`` lets ``after`` more bytes from the server
    through, then holds the rest until ``release()``; ``cut()`` shuts every relayed connection.
    ``from_clients`` counts bytes relayed to the server, ``held`` bytes from it not yet passed on.
    """

    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server((HOST, 0))
        self.url = f"redis://{HOST}:{self._listener.getsockname()[1]}/0"
        self._cond = threading.Condition()
        self._budget: int | None = None
        self._closed = False
        self.from_clients = self.held = 0
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def hold(self, after: int = 0) -> None:
        with self._cond:
            self._budget = after

    def release(self) -> None:
        with self._cond:
            self._budget = None
            self._cond.notify_all()

    def cut(self) -> None:
        with self._cond:
            socks = list(self._socks)
        for s in socks:
            _shut(s)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # the listener was shut by close()
                return
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            with self._cond:
                self._socks += [client, server]
                pumps = [threading.Thread(target=self._pump, args=pair, daemon=True)
                         for pair in ((client, server, False), (server, client, True))]
                self._threads += pumps
            for t in pumps:
                t.start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_server: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                view = memoryview(data)
                while view:
                    n = self._passable(len(view)) if from_server else len(view)
                    dst.sendall(view[:n])
                    view = view[n:]
                    with self._cond:
                        self.from_clients += 0 if from_server else n
        except OSError:
            pass
        finally:
            _shut(src)
            _shut(dst)

    def _passable(self, n: int) -> int:
        with self._cond:
            self.held += n
            self._cond.wait_for(lambda: self._closed or self._budget != 0)
            if self._closed:
                raise OSError("relay closed")
            n = n if self._budget is None else min(n, self._budget)
            self._budget = None if self._budget is None else self._budget - n
            self.held -= n
            return n

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        _shut(self._listener)
        self.cut()
        for t in self._threads:
            t.join(DEADLINE)
        for s in [self._listener, *self._socks]:
            s.close()


def _shut(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


@pytest.fixture
def relay(redis_server: RedisProc, redis_url: str) -> Iterator[Relay]:
    r = Relay(redis_server.address)
    try:
        yield r
    finally:
        r.close()


@pytest.fixture
def background() -> Iterator[Background]:
    """Runs a call on another thread: returns a function that waits for its result."""
    with ThreadPoolExecutor(1) as pool:
        yield lambda call: pool.submit(call).result


OLD = "the value read before"  # what a read may still return: every byte it read is the old value's


def replacements(cid: ChunkId
                 ) -> dict[str, tuple[Callable[[redis.Redis], object], set[Miss | str]]]:
    """Ways to change a chunk's value while it is read, with what each read may end in."""
    shorter, = chunks(1, (3, 4096), salt="shorter")
    longer, = chunks(1, (5, 4096), salt="longer")
    twin = (cid, shorter[1], np.zeros((2, cid.num_layers, C, cid.hidden_dim), np.uint16))

    def put(item: tuple[ChunkId, np.ndarray, np.ndarray]) -> Callable[[redis.Redis], object]:
        return lambda raw: raw.set(cid.key, encode(*item, 0, ORIGIN_STANDALONE, key=KEY))

    return {"shorter": (put(shorter), {Miss.TRUNCATED}), "longer": (put(longer), {Miss.CORRUPT}),
            "same length": (put(twin), {Miss.CORRUPT}),
            "deleted": (lambda raw: raw.delete(cid.key), {Miss.TRUNCATED}),
            "a list": (lambda raw: (raw.delete(cid.key), raw.rpush(cid.key, b"x")),
                       {Miss.UNAVAILABLE}),
            # the bytes the pieces read are the old value's, every one: the digest passes
            "grown at the end": (lambda raw: raw.append(cid.key, b"\0" * 64), {OLD})}


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("change", ["shorter", "longer", "same length", "deleted", "a list",
                                    "grown at the end"])
def test_a_value_replaced_while_it_is_read_is_never_a_mix(
        relay: Relay, redis_url: str, background: Background,
        change: str, streams: int) -> None:
    (cid, tokens, kv), = chunks(1)
    value = bytes(encode(cid, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY))
    raw = redis.Redis.from_url(redis_url)
    with RemoteTier(relay.url, key=KEY, timeout_s=DEADLINE, breaker=Breaker(failures=100)) as tier:
        assert tier.put(cid, value)
        assert isinstance(tier.get_into(cid, tokens, buffer_for(cid), streams), Fetched)  # warm
        relay.hold()  # the head's reply waits here: no piece is asked for before it is in
        dest = buffer_for(cid)
        result = background(lambda: tier.get_into(cid, tokens, dest, streams))
        poll(lambda: relay.held > 0, DEADLINE, "the head's reply at the relay")
        apply, outcomes = replacements(cid)[change]
        apply(raw)
        relay.release()
        got = result()
        assert (got if isinstance(got, Miss) else OLD if dest.tobytes() == kv.tobytes()
                else "a mix") in outcomes
        assert tier.put(cid, value)  # the same tier reads on, in step with every reply
        dest = buffer_for(cid)
        assert_fetched(tier.get_into(cid, tokens, dest, streams), dest, kv, 0)
        assert isinstance(tier.get(cid, tokens), Fetched)
    raw.close()


@pytest.mark.parametrize("fault", ["stall", "cut"])
def test_a_piece_that_fails_mid_reply_leaves_no_stale_connection(
        relay: Relay, background: Background, fault: str) -> None:
    (cid, tokens, kv), = chunks(1)
    now = [0.0]
    breaker = Breaker(failures=1, cooldown_s=1.0, clock=lambda: now[0])
    with RemoteTier(relay.url, key=KEY, timeout_s=STALL_S, breaker=breaker) as tier:
        put_all(tier, [(cid, tokens, kv)])
        assert isinstance(tier.get(cid, tokens), Fetched)  # warm: one pooled connection
        relay.hold(after=cid.value_bytes // 2)  # past the head, half-way through the piece
        result = background(lambda: tier.get_into(cid, tokens, buffer_for(cid), streams=1))
        if fault == "cut":
            poll(lambda: relay.held > 0, DEADLINE, "the piece's reply held at the relay")
            relay.cut()
        assert result() is Miss.UNAVAILABLE  # a receive timed out, or the reply ended early
        assert breaker.is_open and breaker.opened == 1
        now[0] = 1.0  # cooldown over: the next call probes
        # a GET sent now on a connection still owed the rest of that reply would read it back
        sent = relay.from_clients
        got = background(lambda: tier.get(cid, tokens))
        poll(lambda: relay.from_clients > sent, DEADLINE, "the GET at the relay")
        relay.release()
        fetched = got()
        assert isinstance(fetched, Fetched) and bytes(fetched.kv) == kv.tobytes()
        dest = buffer_for(cid)
        assert_fetched(tier.get_into(cid, tokens, dest, streams=3), dest, kv, 0)


# ------------------------------------------------------------------------------- dead remotes


def test_a_killed_server_is_unavailable_and_a_restarted_one_reads_again(
        redis_server: RedisProc) -> None:
    items = chunks(2)
    now = [0.0]
    breaker = Breaker(failures=2, cooldown_s=5.0, clock=lambda: now[0])
    with RemoteTier(redis_server.url, key=KEY, timeout_s=DEADLINE, breaker=breaker) as tier:
        put_all(tier, items)
        for cid, tokens, _ in items:  # leaves several connections in the pool
            assert isinstance(tier.get_into(cid, tokens, buffer_for(cid), streams=8), Fetched)
        redis_server.kill()
        for cid, tokens, _ in items:
            assert tier.get_into(cid, tokens, buffer_for(cid), streams=8) is Miss.UNAVAILABLE
        assert breaker.is_open and breaker.opened == 1
        redis_server.restart()
        now[0] = 5.0
        cid, tokens, kv = items[0]
        assert tier.get_into(cid, tokens, buffer_for(cid), streams=8) is Miss.ABSENT  # emptied
        assert not breaker.is_open
        put_all(tier, items)
        for i, (cid, tokens, kv) in enumerate(items):
            dest = buffer_for(cid)
            assert_fetched(tier.get_into(cid, tokens, dest, streams=8), dest, kv, 10 * i)


def test_a_killed_master_is_unavailable_for_its_keys_only(redis_cluster: ClusterProcs) -> None:
    items = chunks(12)
    victim = redis_cluster.node_for_key(items[0][0].key)
    mine = [victim is redis_cluster.node_for_key(cid.key) for cid, _, _ in items]
    assert 0 < sum(mine) < len(items)
    with RemoteTier(redis_cluster.cluster_url, key=KEY, timeout_s=DEADLINE,
                    breaker=Breaker(failures=10_000)) as tier:
        put_all(tier, items)
        victim.kill()
        try:
            for i, ((cid, tokens, kv), on_victim) in enumerate(zip(items, mine)):
                dest = buffer_for(cid)
                got = tier.get_into(cid, tokens, dest, streams=4)
                if on_victim:
                    assert got is Miss.UNAVAILABLE
                else:
                    assert_fetched(got, dest, kv, 10 * i)
        finally:
            victim.restart()
            redis_cluster.wait_ok()
        put_all(tier, items)
        for i, (cid, tokens, kv) in enumerate(items):
            dest = buffer_for(cid)
            assert_fetched(tier.get_into(cid, tokens, dest, streams=4), dest, kv, 10 * i)


@pytest.mark.parametrize("where", ["server", "cluster"])
def test_get_and_get_into_interleave(request: pytest.FixtureRequest, where: str) -> None:
    url = (request.getfixturevalue("redis_url") if where == "server"
           else request.getfixturevalue("redis_cluster").cluster_url)
    items = chunks(4) + chunks(2, SMALL, salt="small")
    with RemoteTier(url, key=KEY, timeout_s=DEADLINE) as tier:
        put_all(tier, items)
        for i in range(50):
            cid, tokens, kv = items[i % len(items)]
            dest = buffer_for(cid)
            assert_fetched(tier.get_into(cid, tokens, dest, 1 + i % 8), dest, kv,
                           10 * (i % len(items)))
            got = tier.get(cid, tokens)
            assert isinstance(got, Fetched) and bytes(got.kv) == kv.tobytes()
