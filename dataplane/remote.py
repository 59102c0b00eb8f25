"""The remote tier's client: one Redis/Valkey deployment (a server or a cluster) holding chunks,
each written with its record and read back checked, every call bounded by a timeout and a breaker.

This module owns talking to the store: what a write and each read send, the pieces of a read into
a caller's buffer, and the circuit breaker. It does not own the value format and its checks
(``dataplane.remoteformat``, whose names it re-exports), how a range's reply comes off the wire
(``dataplane.redis_wire``), when chunks go there (write-behind), how hosts find them (discovery) or
the local slab they are promoted into.

Two reads of a chunk. ``get``: one GET, the value as Python bytes, then ``decode``. ``get_into``,
into memory the caller owns (a slab slot), without a Python bytes object of the KV::

    1. GETRANGE key 0 KV_AT-1, STRLEN key, EXISTS key    one pipelined round trip: every check
                                                         but the digest, on the first KV_AT bytes
    2. GETRANGE key KV_AT+lo KV_AT+hi-1  per piece       ``streams`` contiguous pieces of the KV at
                                                         once, each on its own pooled connection
    3. HMAC-SHA256 of header, tokens, padding, then the pieces in order: the first as it comes in
       (the calling thread receives it), each other one once it is in

Each piece's reply goes straight into the caller's buffer (``dataplane.redis_wire``; on a redis-py
it does not know, through redis-py's ``getrange`` and one more copy). The value may be replaced
between the steps or between pieces: a piece shorter than asked is TRUNCATED, any other mix of two
values fails the digest (CORRUPT), so a mix is never returned. After a miss the caller's buffer
holds undefined bytes.

The client (``RemoteTier``) bounds every call by a timeout and goes through a circuit breaker:
after ``failures`` errors in a row it stops calling for ``cooldown_s`` (every call a miss at once),
then lets one call through; a success closes it. A remote that is down costs each caller one
timeout at most per cooldown, and serving goes on from the local tier. The timeout bounds each wait
for the server (connect, every receive), as redis-py's own reads do, not a whole transfer.

One breaker per node: a call goes through the breaker of the node that serves its key, so a dead
master of a cluster stops calls to its own slots only, and keys on the live masters go on::

    standalone server            every call            -> breakers[TIER]
    cluster, slot map not read   every call            -> breakers[TIER]  (it reads the map)
    cluster, slot map known      a call on key k       -> breakers["host:port" serving k's slot]

The breakers of a tier share the settings of the one it was given (``Breaker.twin``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any

import numpy as np

from kvblend.dataplane.recordstreams import MasterStreams, OneStream, streams_of
from kvblend.dataplane.redis_wire import BadReply, ReadAt, direct_reads, range_reader
from kvblend.dataplane.remoteformat import (FORMAT, HEADER_BYTES, KEY_PREFIX, MAGIC, ORIGINS,
                                            STREAM, ChunkId, Fetched, Miss, PeerAt, Record,
                                            RemoteKey, check_head, decode, digest_matches, encode,
                                            hash_head, parse_record)
from kvblend.dataplane.remoteurl import RemoteURL


#: the breaker of calls whose node is not known: every call to a standalone server, and a
#: cluster's calls until its slot map is read
TIER = ""


class BreakerState(Enum):
    CLOSED = "closed"        # calls go
    OPEN = "open"            # calls are misses at once, until the cooldown is over
    HALF_OPEN = "half-open"  # open, the cooldown over: the next call probes


class Breaker:
    """A circuit breaker (module docstring): ``allow`` before a call, then ``record`` its outcome.

    Args:
        failures: errors in a row that open it.
        cooldown_s: how long it stays open before one call may try again.
        clock: the time source (``time.monotonic``).
    """

    def __init__(self, failures: int = 3, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or cooldown_s <= 0:
            raise ValueError("failures must be >= 1 and cooldown_s > 0")
        self._failures, self._cooldown, self._clock = failures, cooldown_s, clock
        self._lock = threading.Lock()
        self._errors = 0
        self._open_until = 0.0
        self._probing = False
        self.opened = 0  # times it opened, for metrics

    def twin(self) -> "Breaker":
        """A closed breaker with this one's settings (failures, cooldown, clock)."""
        return Breaker(self._failures, self._cooldown, self._clock)

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._errors >= self._failures

    @property
    def state(self) -> BreakerState:
        with self._lock:
            if self._errors < self._failures:
                return BreakerState.CLOSED
            if self._probing or self._clock() < self._open_until:
                return BreakerState.OPEN
            return BreakerState.HALF_OPEN

    def allow(self) -> bool:
        """Whether a call may go now: closed, or open with its cooldown over and no other call
        trying (that one call is the probe)."""
        with self._lock:
            if self._errors < self._failures:
                return True
            if self._probing or self._clock() < self._open_until:
                return False
            self._probing = True
            return True

    def record(self, ok: bool) -> None:
        with self._lock:
            self._probing = False
            if ok:
                self._errors = 0
                return
            self._errors += 1
            if self._errors >= self._failures:
                if self._errors == self._failures:
                    self.opened += 1
                self._open_until = self._clock() + self._cooldown


MAX_STREAMS = 64  # connections (and threads) one get_into may hold at once
#: a smaller piece costs more in its round trip than it gains by going in parallel
MIN_PIECE_BYTES = 1 << 16


def _split(size: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of ``parts`` contiguous pieces of ``size`` bytes, fewer where a piece would
    fall under MIN_PIECE_BYTES."""
    parts = max(1, min(parts, size // MIN_PIECE_BYTES))
    return [(size * i // parts, size * (i + 1) // parts) for i in range(parts)]


def _byte_view(dest: np.ndarray, size: int) -> memoryview:
    if not (isinstance(dest, np.ndarray) and dest.dtype == np.uint8 and dest.nbytes == size
            and dest.flags.c_contiguous and dest.flags.writeable):
        raise ValueError(f"dest must be a writable C-contiguous uint8 array of {size} bytes")
    return memoryview(dest).cast("B")


class RemoteTier:
    """One Redis/Valkey deployment (a server or a cluster) holding chunks.

    Args:
        url: where (``dataplane.remoteurl.RemoteURL``; a string is parsed into one).
        username, password: credentials (from the environment), or None.
        timeout_s: the bound of every call (connect and read).
        ttl_s: how long a written chunk lives (the server may evict it sooner under its own
            ``maxmemory-policy``).
        breaker: the circuit breaker of calls whose node is not known (``TIER``: a standalone
            server's only one), a default one when None; each node of a cluster gets a twin of
            it (module docstring).
        stream_len: about how many records each record stream keeps (``XADD MAXLEN ~``).
        block_s: the longest a ``records`` call waits for a record (its connection's timeout is
            this plus ``timeout_s``).
        key: the shared key of the value digest (``remoteformat.RemoteKey``): values are
            written under it (``encode(..., key=tier.key)``) and a read checks it.
    """

    def __init__(self, url: RemoteURL | str, username: str | None = None,
                 password: str | None = None, timeout_s: float = 0.5, ttl_s: float = 86400.0,
                 breaker: Breaker | None = None, stream_len: int = 1 << 17,
                 block_s: float = 1.0, *, key: RemoteKey) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.exceptions import RedisClusterException
        from redis.retry import Retry

        where = RemoteURL.parse(url) if isinstance(url, str) else url
        cluster, tls, nodes, db = where.cluster, where.tls, where.nodes, where.db
        if timeout_s <= 0 or ttl_s <= 0:
            raise ValueError("timeout_s and ttl_s must be > 0")
        if stream_len < 1 or block_s <= 0:
            raise ValueError("stream_len must be >= 1 and block_s > 0")
        self.ttl_ms = int(ttl_s * 1000)
        self.key = key
        self.stream_len, self.block_s = stream_len, block_s
        self.breaker = breaker or Breaker()
        self._breakers = {TIER: self.breaker}
        self._breakers_lock = threading.Lock()
        # no retries of our own: a call takes one timeout at most, and the breaker decides
        # when to try again (the cluster client keeps one retry, to follow a moved slot)
        common = dict(username=username, password=password, socket_timeout=timeout_s,
                      socket_connect_timeout=timeout_s, ssl=tls, protocol=2,
                      retry=Retry(NoBackoff(), 1 if cluster else 0))
        # redis-py's cluster errors (a slot no node covers, a cluster it cannot map) are not
        # RedisErrors: the tier only adds hits, so they are failures like any other
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, RedisClusterException,
                                                         OSError, BadReply)
        self._slot_errors: tuple[type[BaseException], ...] = (RedisClusterException, KeyError)
        self._cluster = cluster
        # ranges off the socket where this redis-py is one dataplane.redis_wire knows (else it
        # logs that reads go through redis-py's public GETRANGE)
        self._direct = direct_reads(redis.__version__)

        def client(timeout: float) -> Any:
            kw = dict(common, socket_timeout=timeout)
            if cluster:
                return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in nodes],
                                    require_full_coverage=False, **kw)
            host, port = nodes[0]
            return redis.Redis(host=host, port=port, db=db, **kw)

        # made on first use, inside a call: a cluster client asks a seed node for the slot map
        # when it is made, and a remote that is down at start-up must only cost misses.
        # A blocked XREAD holds its connection for up to block_s: the tail has a client of its own
        self._make = {"main": lambda: client(timeout_s), "tail": lambda: client(timeout_s + block_s)}
        self._clients: dict[str, Any] = {}
        self._streams: dict[str, OneStream | MasterStreams] = {}  # each client's record streams
        self._made = threading.Lock()
        # get_into's pieces beyond the first (the caller reads that one): made on first use,
        # remade larger when more streams are asked for, shut down by close()
        self._workers: ThreadPoolExecutor | None = None
        self._worker_count = 0

    def _client_of(self, which: str) -> Any:
        with self._made:
            if which not in self._clients:
                self._clients[which] = self._make[which]()
                self._streams[which] = streams_of(self._clients[which], self._cluster)
            return self._clients[which]

    def node_of(self, key: str) -> str:
        """The node that serves ``key`` (``"host:port"``), or ``TIER`` where that is not known:
        a standalone server, or a cluster whose slot map was not read yet (or leaves the slot
        uncovered). Never calls the server."""
        if not self._cluster:
            return TIER
        client = self._clients.get("main")  # no lock: _made is held while a client is made
        if client is None:
            return TIER
        try:
            return str(client.get_node_from_key(key).name)
        except self._slot_errors:
            return TIER

    def breaker_of(self, node: str) -> Breaker:
        """The breaker of ``node`` (``node_of``), made closed on first use."""
        with self._breakers_lock:
            if node not in self._breakers:
                self._breakers[node] = self.breaker.twin()
            return self._breakers[node]

    @property
    def breakers(self) -> dict[str, Breaker]:
        """Every node's breaker so far, by node (``TIER`` among them)."""
        with self._breakers_lock:
            return dict(self._breakers)

    def put(self, chunk: ChunkId, value: bytes | memoryview, publish: bool = True,
            peer: PeerAt | None = None) -> bool:
        """Write one encoded chunk with the tier's TTL and, with ``publish``, add its record to
        the stream of the master that serves its key (one round trip: both go in one pipeline,
        to one server; ``dataplane.recordstreams``); False when the remote failed or
        the breaker is open (nothing raised: the remote tier only adds hits). With ``peer``
        the record says where the KV sits in this host's slab, and where ``peer.valued`` is
        false ``value`` is only the record's head (``record_head``): no value is written."""
        expires_ms = int(time.time() * 1000) + self.ttl_ms
        valued = peer is None or peer.valued
        fields = {"v": value[:HEADER_BYTES + 4 * chunk.chunk_size], "x": str(expires_ms),
                  **({} if peer is None else {"p": peer.pack()})}

        def write() -> Any:
            pipe = self._client_of("main").pipeline(transaction=False)
            if valued:
                pipe.set(chunk.key, value, px=self.ttl_ms)
            if publish or not valued:
                pipe.xadd(self._streams["main"].of(chunk.key), fields, maxlen=self.stream_len,
                          approximate=True)
            return pipe.execute()

        done = self._call(write, chunk.key)
        return done is not _FAILED and (done[0] is True or not valued)

    def run(self, key: str, call: Callable[[Any], Any]) -> Any:
        """``call(client)`` through the breaker of ``key``'s node (a small record of another
        module's: a peer's endpoint); its result, or None where it failed."""
        got = self._call(lambda: call(self._client_of("main")), key)
        return None if got is _FAILED else got

    def record_streams(self) -> list[str] | None:
        """The record streams to tail now: one on a server, one per master of a cluster
        (``dataplane.recordstreams``), from the slot map the tail's client holds; None when
        that client could not be made (no seed answered). Not a call the breaker counts."""
        try:
            self._client_of("tail")  # made on first use, with its streams
            return self._streams["tail"].all()
        except self._errors:
            return None

    def records(self, after: str, count: int, stream: str = STREAM
                ) -> list[tuple[str, Record | None]] | None:
        """The records of ``stream`` after id ``after`` (``"0"``: from the oldest it keeps), at
        most ``count``, waiting up to the tier's ``block_s`` for the first; each with its id, None
        where it does not parse. None when the remote failed or the breaker of the stream's node
        is open (a dead master's stream stops only its own reader)."""
        got = self._call(lambda: self._client_of("tail").xread({stream: after}, count=count,
                                                   block=max(1, int(self.block_s * 1000))),
                         stream)
        if got is _FAILED:
            return None
        out = []
        for _, entries in got or []:  # RESP2: [[stream, [(id, {field: value}), ...]]]
            for rid, fields in entries:
                head, expires = fields.get(b"v"), fields.get(b"x")
                out.append((rid.decode(), None if head is None or expires is None
                            else parse_record(head, expires, fields.get(b"p"))))
        return out

    def get(self, chunk: ChunkId, tokens: np.ndarray) -> Fetched | Miss:
        """Read one chunk and check it (``decode``)."""
        value = self._call(lambda: self._client_of("main").get(chunk.key), chunk.key)
        if value is _FAILED:
            return Miss.UNAVAILABLE
        return decode(value, chunk, tokens, key=self.key)

    def get_into(self, chunk: ChunkId, tokens: np.ndarray, dest: np.ndarray, streams: int = 1
                 ) -> Fetched | Miss:
        """Read one chunk with its KV straight into ``dest`` and check it as ``get`` does (module
        docstring: the read path).

        Args:
            chunk: the chunk to read.
            tokens: its ``chunk_size`` token ids.
            dest: a writable C-contiguous uint8 array of ``chunk.kv_bytes`` bytes (a slab slot's
                KV viewed as bytes); written to even on a miss, which leaves it undefined.
            streams: the KV is read in this many contiguous pieces at once, each on its own
                connection to the server that holds the key (fewer pieces where one would be
                under MIN_PIECE_BYTES).

        Returns:
            ``Fetched`` whose ``kv`` is a flat byte view of ``dest``, or the ``Miss`` of the first
            check that failed (UNAVAILABLE: an error, a timeout, or the breaker open).

        Raises:
            ValueError: ``dest`` is not such an array, or ``streams`` is not in
                ``[1, MAX_STREAMS]``.
        """
        view = _byte_view(dest, chunk.kv_bytes)
        if not 1 <= streams <= MAX_STREAMS:
            raise ValueError(f"streams must be in [1, {MAX_STREAMS}], got {streams}")
        got = self._call(lambda: self._read_into(chunk, tokens, view, streams), chunk.key)
        return Miss.UNAVAILABLE if got is _FAILED else got

    def _read_into(self, chunk: ChunkId, tokens: np.ndarray, dest: memoryview, streams: int
                   ) -> Fetched | Miss:
        pipe = self._client_of("main").pipeline(transaction=False)
        pipe.getrange(chunk.key, 0, chunk.kv_at - 1).strlen(chunk.key).exists(chunk.key)
        value_head, length, exists = pipe.execute()
        if not exists:
            return Miss.ABSENT
        head = check_head(value_head, length, chunk, tokens)
        if isinstance(head, Miss):
            return head
        pos0, origin, digest = head
        h = hash_head(value_head, self.key)
        if not self._read_kv(chunk, dest, streams, h):
            return Miss.TRUNCATED
        if not digest_matches(h.digest(), digest) or origin not in ORIGINS:
            return Miss.CORRUPT
        return Fetched(dest, pos0, origin)

    def _read_kv(self, chunk: ChunkId, dest: memoryview, streams: int, h: Any) -> bool:
        """The KV of ``chunk`` into ``dest`` in ``streams`` pieces at once, hashed into ``h`` in
        order: the first piece as it comes in (this thread receives it), the others once they are
        in. False when a piece was short (the value was replaced since its head was read).
        Returns or raises only once every piece is done with ``dest``."""
        read: ReadAt = range_reader(self._client_of("main"), self._cluster, chunk.key,
                                   self._direct)
        pieces = _split(dest.nbytes, streams)

        def piece(lo: int, hi: int, seen: Any = None) -> Callable[[], int]:
            return lambda: read(chunk.kv_at + lo, dest[lo:hi], seen)

        waits = [piece(*pieces[0], h.update)] + [f.result for f in self._submit(
            [piece(lo, hi) for lo, hi in pieces[1:]])]
        whole, error = True, None
        for i, ((lo, hi), wait) in enumerate(zip(pieces, waits)):
            try:
                got = wait()
                whole = whole and got == hi - lo
            except Exception as e:  # noqa: BLE001 - raised below, once every piece is done
                error = error or e
            if i and whole and error is None:
                h.update(dest[lo:hi])
        if error is not None:
            raise error
        return whole

    def _submit(self, calls: list[Callable[[], int]]) -> list[Future[int]]:
        if not calls:
            return []
        with self._made:  # submitted under the lock: a pool being replaced takes no new work
            if self._worker_count < len(calls):
                old, self._worker_count = self._workers, len(calls)
                self._workers = ThreadPoolExecutor(len(calls), "kvblend-remote")
                if old is not None:
                    old.shutdown(wait=False)
            assert self._workers is not None
            return [self._workers.submit(call) for call in calls]

    def _call(self, call: Callable[[], Any], key: str) -> Any:
        """``call``'s result, or _FAILED where it raised or the breaker of ``key``'s node is
        open."""
        breaker = self.breaker_of(self.node_of(key))
        if not breaker.allow():
            return _FAILED
        try:
            result = call()
        except self._errors:
            breaker.record(False)
            return _FAILED
        breaker.record(True)
        return result

    def close(self) -> None:
        with self._made:
            clients, self._clients = list(self._clients.values()), {}
            workers, self._workers, self._worker_count = self._workers, None, 0
        if workers is not None:
            workers.shutdown()
        for c in clients:
            c.close()

    def __enter__(self) -> "RemoteTier":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_FAILED = object()

__all__ = ["ChunkId", "Fetched", "Miss", "Breaker", "BreakerState", "TIER", "RemoteTier", "Record",
           "RemoteKey", "encode", "decode", "parse_record", "MAGIC", "FORMAT", "HEADER_BYTES",
           "KEY_PREFIX", "STREAM", "MAX_STREAMS", "MIN_PIECE_BYTES"]
