"""The remote tier's value format and its Redis/Valkey client: one value per chunk, checked on
every read, so that a missing, expired, truncated or corrupted value is a miss, never wrong bytes.

This module owns how a chunk looks in the remote store and how one is written and read back. It
does not own when chunks go there (write-behind), how hosts find them (discovery) or the local
slab they are promoted into.

Key of a chunk: ``kvblend:1:<chunk hash, 32 hex>:<rank>``. The chunk hash is rooted in the
namespace (model, world size, cache salt: ``shm.hashing``), so tenants with different salts get
different keys on every host sharing the store, and the value repeats the root to check it.

Value of a chunk (little-endian)::

    offset    bytes   field
    0         8       MAGIC    b"kvblendC"
    8         2       FORMAT   1
    10        2       DTYPE    ``shm.layout.DType`` code
    12        4       LAYERS   L
    16        4       CHUNK    C, tokens per chunk
    20        4       HIDDEN   D, elements per token and layer, for K and again for V
    24        4       RANK     the tensor-parallel shard
    28        4       ORIGIN   ``shm.header``: 1 pre-computed (ORIGIN_STANDALONE), 2 final
    32        8       POS0     the position of the chunk's first token when its KV was computed
    40        16      ROOT     the namespace root
    56        16      KEY      the chunk hash
    72        16      DIGEST   SHA-256 of every other byte of the value ([0, 72) and [88, end)),
                               its first 16 bytes
    88        4 C     TOKENS   uint32 token ids
    ...               zero padding to KV_AT = round_up(88 + 4 C, 64)
    KV_AT     2 L C D itemsize   KV, [2, L, C, D] of DTYPE (the slab's canonical layout)

A read checks, in order: the length against the header's geometry, MAGIC and FORMAT, the key,
root, rank and layout the caller expects, the token ids the caller expects, then the digest. The
first failure names the miss (``Miss``); a value that passes every check is returned.

Record of a chunk, for discovery: the first ``88 + 4 C`` bytes of its value (header and token ids,
no KV), added to the stream ``kvblend:1:fp`` (field ``v``) beside its expiry in Unix milliseconds
(field ``x``) right after the value is written. The stream is capped (``XADD MAXLEN ~``), so it
holds the newest records; a host that tails it learns which chunks exist and where their KV was
computed, without fetching any KV. A record is a claim, not a chunk: its value may have expired or
been evicted since, and the read that follows checks the value as above.

Two reads of a chunk. ``get``: one GET, the value as Python bytes, then ``decode``. ``get_into``,
into memory the caller owns (a slab slot), without a Python bytes object of the KV::

    1. GETRANGE key 0 KV_AT-1, STRLEN key, EXISTS key    one pipelined round trip: every check
                                                         but the digest, on the first KV_AT bytes
    2. GETRANGE key KV_AT+lo KV_AT+hi-1  per piece       ``streams`` contiguous pieces of the KV at
                                                         once, each on its own pooled connection
    3. SHA-256 of header, tokens, padding, then the pieces in order: the first as it comes in
       (the calling thread receives it), each other one once it is in

A piece's reply is parsed here, not by redis-py: ``$<n>\r\n``, then the n bytes received with
``recv_into`` straight into the caller's buffer, then ``\r\n``; an error line (MOVED, ASK,
WRONGTYPE, ...) fails the call. The value may be replaced between the steps or between pieces: a
piece shorter than asked is TRUNCATED, any other mix of two values fails the digest (CORRUPT), so a
mix is never returned. NOTE: a connection that failed mid-reply (timeout, reset, a reply not
understood) is closed before it goes back to its pool: the rest of that reply would otherwise be
read as the answer to the connection's next command. After a miss the caller's buffer holds
undefined bytes.

The client (``RemoteTier``) bounds every call by a timeout and goes through a circuit breaker:
after ``failures`` errors in a row it stops calling for ``cooldown_s`` (every call a miss at once),
then lets one call through; a success closes it. A remote that is down costs each caller one
timeout at most per cooldown, and serving goes on from the local tier. The timeout bounds each wait
for the server (connect, every receive), as redis-py's own reads do, not a whole transfer.
"""

from __future__ import annotations

import hashlib
import struct
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from kvblend.dataplane.remoteurl import parse_url
from kvblend.shm.hashing import DIGEST_BYTES
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.layout import DType

MAGIC = b"kvblendC"
FORMAT = 1
_HEAD = struct.Struct("<8sHHIIIIIq16s16s16s")
HEADER_BYTES = _HEAD.size  # 88
_DIGEST_AT = 72
assert HEADER_BYTES == 88 and _DIGEST_AT + DIGEST_BYTES == HEADER_BYTES
KEY_PREFIX = "kvblend:1:"
STREAM = "kvblend:1:fp"  # the records of every chunk written (module docstring)
MAX_LAYERS, MAX_CHUNK, MAX_HIDDEN, MAX_RANK = 1 << 12, 1 << 16, 1 << 20, 1 << 10
_ORIGINS = (ORIGIN_STANDALONE, ORIGIN_FINAL)


class Miss(Enum):
    """Why a read gave no chunk."""

    ABSENT = "absent"            # no such key (never written, expired, evicted, flushed)
    UNAVAILABLE = "unavailable"  # the remote did not answer in time, or the breaker is open
    TRUNCATED = "truncated"      # shorter or longer than its header says
    FORMAT = "format"            # not a value of this format
    OTHER_CHUNK = "other_chunk"  # another key, root, rank or layout than asked for
    OTHER_TOKENS = "other_tokens"
    CORRUPT = "corrupt"          # the digest disagrees


@dataclass(frozen=True)
class ChunkId:
    """What a reader expects of a chunk: its key and where it comes from.

    Attributes:
        root: the namespace root (``Namespace.root``, 16 bytes).
        chunk_hash: the chunk's key (16 bytes).
        rank: the tensor-parallel shard.
        dtype, num_layers, chunk_size, hidden_dim: the layout of its KV.
    """

    root: bytes
    chunk_hash: bytes
    rank: int
    dtype: DType
    num_layers: int
    chunk_size: int
    hidden_dim: int

    def __post_init__(self) -> None:
        if len(self.root) != DIGEST_BYTES or len(self.chunk_hash) != DIGEST_BYTES:
            raise ValueError("a namespace root and a chunk hash have 16 bytes each")
        if min(self.num_layers, self.chunk_size, self.hidden_dim) < 1 or self.rank < 0:
            raise ValueError("layers, chunk size and hidden dim must be >= 1, the rank >= 0")

    @property
    def key(self) -> str:
        """The chunk's key in the remote store."""
        return f"{KEY_PREFIX}{self.chunk_hash.hex()}:{self.rank}"

    @property
    def kv_at(self) -> int:
        """Offset of the KV bytes in the value."""
        return -(-(HEADER_BYTES + 4 * self.chunk_size) // 64) * 64

    @property
    def kv_bytes(self) -> int:
        return 2 * self.num_layers * self.chunk_size * self.hidden_dim * self.dtype.itemsize

    @property
    def value_bytes(self) -> int:
        return self.kv_at + self.kv_bytes


def encode(chunk: ChunkId, tokens: np.ndarray, kv: Any, pos0: int, origin: int) -> memoryview:
    """The value of ``chunk``: its header, ``tokens`` (``chunk_size`` ids) and ``kv`` (any buffer
    of ``kv_bytes`` bytes, ``[2, L, C, D]``), as a read-only view of the one buffer it was built
    in (redis-py sends a memoryview as it is: no copy of a value of megabytes).

    Raises:
        ValueError: the tokens or the KV do not fit the chunk's layout, the KV is not contiguous,
            or origin is not ORIGIN_STANDALONE or ORIGIN_FINAL.
    """
    tokens = np.ascontiguousarray(tokens, "<u4")
    kv_view = memoryview(kv)
    if not kv_view.c_contiguous:
        raise ValueError("the KV bytes must be one contiguous buffer")
    kv_view = kv_view.cast("B")
    if tokens.shape != (chunk.chunk_size,):
        raise ValueError(f"{tokens.shape} token ids for a chunk of {chunk.chunk_size}")
    if kv_view.nbytes != chunk.kv_bytes:
        raise ValueError(f"{kv_view.nbytes} KV bytes for a layout of {chunk.kv_bytes}")
    if origin not in _ORIGINS:
        raise ValueError(f"origin must be one of {_ORIGINS}, got {origin}")
    out = bytearray(chunk.value_bytes)
    _HEAD.pack_into(out, 0, MAGIC, FORMAT, int(chunk.dtype), chunk.num_layers, chunk.chunk_size,
                    chunk.hidden_dim, chunk.rank, origin, pos0, chunk.root, chunk.chunk_hash,
                    bytes(DIGEST_BYTES))
    out[HEADER_BYTES:HEADER_BYTES + tokens.nbytes] = tokens.tobytes()
    out[chunk.kv_at:] = kv_view
    out[_DIGEST_AT:HEADER_BYTES] = _digest(out)
    return memoryview(out).toreadonly()


@dataclass(frozen=True)
class Fetched:
    """A chunk read back and checked: ``kv`` is a flat byte view of its KV, read-only over the
    value (``get``) or over the caller's buffer (``get_into``)."""

    kv: memoryview
    pos0: int
    origin: int


def decode(value: bytes | None, chunk: ChunkId, tokens: np.ndarray) -> Fetched | Miss:
    """``value`` checked against what the reader expects (module docstring); a ``Miss`` says
    which check failed."""
    if value is None:
        return Miss.ABSENT
    head = _check_head(value, len(value), chunk, tokens)
    if isinstance(head, Miss):
        return head
    pos0, origin, digest = head
    if _digest(value) != digest or origin not in _ORIGINS:
        return Miss.CORRUPT
    return Fetched(memoryview(value)[chunk.kv_at:], pos0, origin)


def _check_head(head: bytes, length: int, chunk: ChunkId, tokens: np.ndarray
                ) -> tuple[int, int, bytes] | Miss:
    """Every check but the digest, on the first bytes of a value (at least through its token
    ids when its length is right) and its length: ``(pos0, origin, digest)`` or the miss."""
    if len(head) < HEADER_BYTES:
        return Miss.TRUNCATED
    (magic, fmt, dtype, layers, size, hidden, rank, origin, pos0, root, key,
     digest) = _HEAD.unpack_from(head, 0)
    if magic != MAGIC or fmt != FORMAT:
        return Miss.FORMAT
    if (root, key, rank, dtype, layers, size, hidden) != (
            chunk.root, chunk.chunk_hash, chunk.rank, int(chunk.dtype), chunk.num_layers,
            chunk.chunk_size, chunk.hidden_dim):
        return Miss.OTHER_CHUNK
    if length != chunk.value_bytes:
        return Miss.TRUNCATED
    want = np.ascontiguousarray(tokens, "<u4")
    if want.tobytes() != head[HEADER_BYTES:HEADER_BYTES + 4 * size]:
        return Miss.OTHER_TOKENS
    return pos0, origin, digest


@dataclass(frozen=True)
class Record:
    """A chunk another host wrote (module docstring): what discovery needs, no KV.

    Attributes:
        chunk: the chunk's key, root, rank and layout.
        tokens: its ``chunk_size`` token ids.
        pos0: the position of its first token when its KV was computed.
        origin: ``shm.header`` ORIGIN_STANDALONE or ORIGIN_FINAL.
        expires_ms: when its value expires, Unix milliseconds.
    """

    chunk: ChunkId
    tokens: np.ndarray
    pos0: int
    origin: int
    expires_ms: int


def parse_record(head: bytes, expires: bytes | str) -> Record | None:
    """A stream record's fields checked for form (sizes, magic, format, bounds); None when any
    check fails. The digest covers the KV too, so it is checked when the value is read."""
    if len(head) < HEADER_BYTES:
        return None
    (magic, fmt, dtype, layers, size, hidden, rank, origin, pos0, root, key,
     _) = _HEAD.unpack_from(head, 0)
    try:
        expires_ms = int(expires)
        kind = DType(dtype)
    except ValueError:
        return None
    if (magic != MAGIC or fmt != FORMAT or origin not in _ORIGINS or pos0 < 0
            or not (0 < layers <= MAX_LAYERS and 0 < size <= MAX_CHUNK
                    and 0 < hidden <= MAX_HIDDEN and rank < MAX_RANK)
            or len(head) != HEADER_BYTES + 4 * size):
        return None
    chunk = ChunkId(root, key, rank, kind, layers, size, hidden)
    tokens = np.frombuffer(head, "<u4", size, HEADER_BYTES)
    return Record(chunk, tokens, pos0, origin, expires_ms)


def _digest(value: bytes | bytearray) -> bytes:
    """SHA-256 rather than BLAKE2b: CPUs hash it in hardware, 1.65 GB/s against 0.63 on the
    2-core VM (32 MiB), and a fetch checks every byte it reads. Unkeyed, it catches corruption
    and truncation, not a forger with write access to the remote (that needs a shared key)."""
    return _hash(value).digest()[:DIGEST_BYTES]


def _hash(head: bytes | bytearray) -> Any:
    """SHA-256 begun over the first bytes of a value, less the digest field; a reader of the KV
    apart goes on with ``update``."""
    h = hashlib.sha256()
    view = memoryview(head)
    h.update(view[:_DIGEST_AT])
    h.update(view[HEADER_BYTES:])
    return h


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

    @property
    def is_open(self) -> bool:
        with self._lock:
            return self._errors >= self._failures

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


class _BadReply(Exception):
    """A piece's reply was not the bulk string asked for: an error line, bytes that are not RESP2,
    or the connection closed mid-reply."""


_LINE = 256  # bytes received for a reply's first line: ``$<n>\r\n`` fits with room to spare
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


def _buffered(conn: Any) -> bool:
    """Whether redis-py's parser of ``conn`` holds received bytes it has not parsed: the hiredis
    parser in its ``_reader``, the Python one (RESP2) in its ``_buffer``, a ``SocketBuffer``."""
    reader = getattr(conn._parser, "_reader", None)
    if reader is not None:
        return bool(reader.has_data())
    buffer = getattr(conn._parser, "_buffer", None)
    return buffer is not None and buffer.unread_bytes() > 0


def _getrange_into(pool: Any, key: str, start: int, dest: memoryview,
                   seen: Callable[[memoryview], object] | None = None) -> int:
    """``GETRANGE key start start+len(dest)-1`` on a connection of ``pool``, its reply received
    into ``dest`` (``seen`` given each span of it as it comes in): the bytes the value had there.
    A connection that fails is closed before it goes back (module docstring)."""
    conn = pool.get_connection()
    try:
        if _buffered(conn):  # the pool checks it too: a stray byte would shift every reply after
            raise _BadReply("a pooled connection holds bytes nobody read")
        conn.send_command("GETRANGE", key, start, start + len(dest) - 1)
        return _recv_bulk(conn._sock, dest, seen)
    except BaseException:
        conn.disconnect()
        raise
    finally:
        pool.release(conn)


def _recv_bulk(sock: Any, dest: memoryview, seen: Callable[[memoryview], object] | None) -> int:
    """One RESP2 bulk reply of at most ``len(dest)`` bytes, received into ``dest``: its length.

    Raises:
        _BadReply: an error line, another reply, a longer one, or the socket closed.
        OSError: a receive failed or timed out (the socket's timeout).
    """
    line, early = _recv_line(sock)
    if line[:1] == b"-":
        raise _BadReply(line[1:].decode(errors="replace"))
    if line[:1] != b"$" or not line[1:].isdigit() or int(line[1:]) > len(dest):
        raise _BadReply(f"{line[:32]!r} for a bulk string of at most {len(dest)} bytes")
    n = int(line[1:])
    k = min(early.nbytes, n)
    dest[:k] = early[:k]
    if seen is not None:
        seen(dest[:k])
    _recv_exact(sock, dest[k:n], seen)
    _recv_crlf(sock, early[k:])
    return n


def _recv_crlf(sock: Any, early: memoryview) -> None:
    """The CRLF that ends a bulk string, of which ``early`` holds the bytes received already."""
    if early.nbytes > 2:
        raise _BadReply("bytes after the reply")
    end = bytearray(2)
    end[:early.nbytes] = early
    _recv_exact(sock, memoryview(end)[early.nbytes:])
    if end != b"\r\n":
        raise _BadReply(f"{bytes(end)!r} after a bulk string")


def _recv_line(sock: Any) -> tuple[bytes, memoryview]:
    """A reply's first line, less its CRLF, and the bytes received after it. The socket holds
    one reply at most, so nothing received here belongs to another."""
    buf = bytearray(_LINE)
    filled = 0
    while (end := buf.find(b"\r\n", 0, filled)) < 0:
        if filled == _LINE:
            raise _BadReply(f"a reply line longer than {_LINE} bytes: {bytes(buf[:32])!r}")
        filled += _recv_some(sock, memoryview(buf)[filled:])
    return bytes(buf[:end]), memoryview(buf)[end + 2:filled]


def _recv_exact(sock: Any, view: memoryview,
                seen: Callable[[memoryview], object] | None = None) -> None:
    while view.nbytes:
        got = _recv_some(sock, view)
        if seen is not None:  # while this runs, the kernel buffers what the server sends next
            seen(view[:got])
        view = view[got:]


def _recv_some(sock: Any, view: memoryview) -> int:
    got = sock.recv_into(view)
    if got == 0:
        raise _BadReply("the server closed the connection mid-reply")
    return int(got)


class RemoteTier:
    """One Redis/Valkey deployment (a server or a cluster) holding chunks.

    Args:
        url: see ``dataplane.remoteurl.parse_url``.
        username, password: credentials (from the environment), or None.
        timeout_s: the bound of every call (connect and read).
        ttl_s: how long a written chunk lives (the server may evict it sooner under its own
            ``maxmemory-policy``).
        breaker: the circuit breaker (a default one when None).
        stream_len: about how many records the stream keeps (``XADD MAXLEN ~``).
        block_s: the longest a ``records`` call waits for a record (its connection's timeout is
            this plus ``timeout_s``).
    """

    def __init__(self, url: str, username: str | None = None, password: str | None = None,
                 timeout_s: float = 0.5, ttl_s: float = 86400.0,
                 breaker: Breaker | None = None, stream_len: int = 1 << 17,
                 block_s: float = 1.0) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        cluster, tls, nodes, db = parse_url(url)
        if timeout_s <= 0 or ttl_s <= 0:
            raise ValueError("timeout_s and ttl_s must be > 0")
        if stream_len < 1 or block_s <= 0:
            raise ValueError("stream_len must be >= 1 and block_s > 0")
        self.ttl_ms = int(ttl_s * 1000)
        self.stream_len, self.block_s = stream_len, block_s
        self.breaker = breaker or Breaker()
        # no retries of our own: a call takes one timeout at most, and the breaker decides
        # when to try again (the cluster client keeps one retry, to follow a moved slot)
        common = dict(username=username, password=password, socket_timeout=timeout_s,
                      socket_connect_timeout=timeout_s, ssl=tls, protocol=2,
                      retry=Retry(NoBackoff(), 1 if cluster else 0))
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError, _BadReply)
        self._cluster = cluster

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
        self._made = threading.Lock()
        # get_into's pieces beyond the first (the caller reads that one): made on first use,
        # remade larger when more streams are asked for, shut down by close()
        self._workers: ThreadPoolExecutor | None = None
        self._worker_count = 0

    def _client_of(self, which: str) -> Any:
        with self._made:
            if which not in self._clients:
                self._clients[which] = self._make[which]()
            return self._clients[which]

    def put(self, chunk: ChunkId, value: bytes | memoryview, publish: bool = True) -> bool:
        """Write one encoded chunk with the tier's TTL and, with ``publish``, add its record to
        the stream (one round trip: both go in one pipeline); False when the remote failed or
        the breaker is open (nothing raised: the remote tier only adds hits)."""
        expires_ms = int(time.time() * 1000) + self.ttl_ms

        def write() -> Any:
            pipe = self._client_of("main").pipeline(transaction=False)
            pipe.set(chunk.key, value, px=self.ttl_ms)
            if publish:
                pipe.xadd(STREAM, {"v": value[:HEADER_BYTES + 4 * chunk.chunk_size],
                                   "x": str(expires_ms)},
                          maxlen=self.stream_len, approximate=True)
            return pipe.execute()

        done = self._call(write)
        return done is not _FAILED and done[0] is True

    def records(self, after: str, count: int) -> list[tuple[str, Record | None]] | None:
        """The stream's records after id ``after`` (``"0"``: from the oldest it keeps), at most
        ``count``, waiting up to the tier's ``block_s`` for the first; each with its id, None where it does
        not parse. None when the remote failed or the breaker is open."""
        got = self._call(lambda: self._client_of("tail").xread({STREAM: after}, count=count,
                                                   block=max(1, int(self.block_s * 1000))))
        if got is _FAILED:
            return None
        out = []
        for _, entries in got or []:  # RESP2: [[stream, [(id, {field: value}), ...]]]
            for rid, fields in entries:
                head, expires = fields.get(b"v"), fields.get(b"x")
                out.append((rid.decode(), None if head is None or expires is None
                            else parse_record(head, expires)))
        return out

    def get(self, chunk: ChunkId, tokens: np.ndarray) -> Fetched | Miss:
        """Read one chunk and check it (``decode``)."""
        value = self._call(lambda: self._client_of("main").get(chunk.key))
        if value is _FAILED:
            return Miss.UNAVAILABLE
        return decode(value, chunk, tokens)

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
        got = self._call(lambda: self._read_into(chunk, tokens, view, streams))
        return Miss.UNAVAILABLE if got is _FAILED else got

    def _read_into(self, chunk: ChunkId, tokens: np.ndarray, dest: memoryview, streams: int
                   ) -> Fetched | Miss:
        pipe = self._client_of("main").pipeline(transaction=False)
        pipe.getrange(chunk.key, 0, chunk.kv_at - 1).strlen(chunk.key).exists(chunk.key)
        value_head, length, exists = pipe.execute()
        if not exists:
            return Miss.ABSENT
        head = _check_head(value_head, length, chunk, tokens)
        if isinstance(head, Miss):
            return head
        pos0, origin, digest = head
        h = _hash(value_head)
        if not self._read_kv(chunk, dest, streams, h):
            return Miss.TRUNCATED
        if h.digest()[:DIGEST_BYTES] != digest or origin not in _ORIGINS:
            return Miss.CORRUPT
        return Fetched(dest, pos0, origin)

    def _read_kv(self, chunk: ChunkId, dest: memoryview, streams: int, h: Any) -> bool:
        """The KV of ``chunk`` into ``dest`` in ``streams`` pieces at once, hashed into ``h`` in
        order: the first piece as it comes in (this thread receives it), the others once they are
        in. False when a piece was short (the value was replaced since its head was read).
        Returns or raises only once every piece is done with ``dest``."""
        pool = self._pool_of(chunk.key)
        pieces = _split(dest.nbytes, streams)

        def piece(lo: int, hi: int, seen: Any = None) -> Callable[[], int]:
            return lambda: _getrange_into(pool, chunk.key, chunk.kv_at + lo, dest[lo:hi], seen)

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

    def _pool_of(self, key: str) -> Any:
        """The connection pool of the server that holds ``key`` (in a cluster: its slot's master,
        as the slot map the client holds says)."""
        client = self._client_of("main")
        if not self._cluster:
            return client.connection_pool
        return client.get_redis_connection(client.get_node_from_key(key)).connection_pool

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

    def _call(self, call: Callable[[], Any]) -> Any:
        if not self.breaker.allow():
            return _FAILED
        try:
            result = call()
        except self._errors:
            self.breaker.record(False)
            return _FAILED
        self.breaker.record(True)
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

__all__ = ["ChunkId", "Fetched", "Miss", "Breaker", "RemoteTier", "Record", "encode", "decode",
           "parse_record", "MAGIC", "FORMAT", "HEADER_BYTES", "KEY_PREFIX", "STREAM",
           "MAX_STREAMS", "MIN_PIECE_BYTES"]
