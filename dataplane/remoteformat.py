"""The remote tier's value format: one value per chunk, checked on every read, so that a missing,
expired, truncated or corrupted value is a miss, never wrong bytes; and the record of a chunk that
discovery reads.

This module owns how a chunk and its record look in the remote store, and the checks of both. It
does not own talking to the store (``dataplane.remote``) or how a reply comes off the wire
(``dataplane.redis_wire``).

Key of a chunk: ``kvblend:1:<chunk hash, 32 hex>:<rank>``. The chunk hash is rooted in the
namespace (model, world size, cache salt: ``shm.hashing``), so tenants with different salts get
different keys on every host sharing the store, and the value repeats the root to check it.

Value of a chunk (little-endian)::

    offset    bytes   field
    0         8       MAGIC    b"kvblendC"
    8         2       FORMAT   2 (1: the digest was unkeyed; such a value is a FORMAT miss)
    10        2       DTYPE    ``shm.layout.DType`` code
    12        4       LAYERS   L
    16        4       CHUNK    C, tokens per chunk
    20        4       HIDDEN   D, elements per token and layer, for K and again for V
    24        4       RANK     the tensor-parallel shard
    28        4       ORIGIN   ``shm.header``: 1 pre-computed (ORIGIN_STANDALONE), 2 final
    32        8       POS0     the position of the chunk's first token when its KV was computed
    40        16      ROOT     the namespace root
    56        16      KEY      the chunk hash
    72        16      DIGEST   HMAC-SHA256 under the shared key of every other byte of the
                               value ([0, 72) and [88, end)), its first 16 bytes
    88        4 C     TOKENS   uint32 token ids
    ...               zero padding to KV_AT = round_up(88 + 4 C, 64)
    KV_AT     2 L C D itemsize   KV, [2, L, C, D] of DTYPE (the slab's canonical layout)

A read checks, in order: the length against the header's geometry, MAGIC and FORMAT, the key,
root, rank and layout the caller expects, the token ids the caller expects, then the digest. The
first failure names the miss (``Miss``); a value that passes every check is returned.

The digest is keyed (``RemoteKey``: a secret every host of a deployment shares, from
``KVBLEND_REMOTE_KEY``), so that a value written by anyone without the key, however well formed,
fails it (CORRUPT) and is never served: write access to the remote store is not enough to put
bytes into an engine. A value written under another key is the same miss.

Record of a chunk, for discovery: the first ``88 + 4 C`` bytes of its value (header and token ids,
no KV), added to a record stream (field ``v``) beside its expiry in Unix milliseconds (field
``x``) right after the value is written: ``kvblend:1:fp`` on a server, on a cluster the stream of
the master that holds the value (``dataplane.recordstreams``). A stream is capped (``XADD MAXLEN
~``), so it holds the newest records; a host that tails them learns which chunks exist and where
their KV was computed, without fetching any KV. A record is a claim, not a chunk: its value may
have expired or been evicted since, and the read that follows checks the value as above. A record carries no
digest of its own (the value's digest covers KV it does not hold): a forged one costs a reader a
miss, never wrong bytes.

With peer reads (``dataplane.peerread``) a record also says where the chunk's KV sits in its
holder's slab (``PeerAt``, field ``p``: ``<values>:<offset>:<holder>``, values 1 when the value
was also written, 0 when only the record was). The record's header keeps the value's digest, so
the KV read from the holder's slab is checked against it as a value's KV is (``kv_digest_ok``).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct
from dataclasses import dataclass
from enum import Enum
from typing import Any

import numpy as np

from kvblend.dataplane.settings import MIN_REMOTE_KEY as MIN_KEY_BYTES
from kvblend.shm.hashing import DIGEST_BYTES
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.layout import DType

MAGIC = b"kvblendC"
FORMAT = 2
_HEAD = struct.Struct("<8sHHIIIIIq16s16s16s")
HEADER_BYTES = _HEAD.size  # 88
_DIGEST_AT = 72
assert HEADER_BYTES == 88 and _DIGEST_AT + DIGEST_BYTES == HEADER_BYTES
KEY_PREFIX = "kvblend:1:"
STREAM = "kvblend:1:fp"  # a server's record stream; a cluster's are named after it
MAX_LAYERS, MAX_CHUNK, MAX_HIDDEN, MAX_RANK = 1 << 12, 1 << 16, 1 << 20, 1 << 10
ORIGINS = (ORIGIN_STANDALONE, ORIGIN_FINAL)


class RemoteKey:
    """The shared secret of the value digest (module docstring): HMAC-SHA256 under it.

    The key is not in the repr, so a logged tier or settings object does not show it.

    Args:
        secret: at least MIN_KEY_BYTES bytes (a ``str`` is taken as its UTF-8 bytes).

    Raises:
        ValueError: the secret is shorter than MIN_KEY_BYTES.
    """

    __slots__ = ("_secret",)

    def __init__(self, secret: bytes | str) -> None:
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(raw) < MIN_KEY_BYTES:
            raise ValueError(f"the remote key must have at least {MIN_KEY_BYTES} bytes, got "
                             f"{len(raw)} (make one with `openssl rand -hex 32`)")
        self._secret = raw

    def __repr__(self) -> str:
        return "RemoteKey(***)"

    def hasher(self) -> Any:
        """A fresh HMAC-SHA256 under the key (``update``, ``digest``)."""
        return hmac.new(self._secret, digestmod=hashlib.sha256)


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


def encode(chunk: ChunkId, tokens: np.ndarray, kv: Any, pos0: int, origin: int, *,
           key: RemoteKey) -> memoryview:
    """The value of ``chunk``: its header, ``tokens`` (``chunk_size`` ids) and ``kv`` (any buffer
    of ``kv_bytes`` bytes, ``[2, L, C, D]``), digested under ``key``, as a read-only view of the
    one buffer it was built in (redis-py sends a memoryview as it is: no copy of a value of
    megabytes).

    Raises:
        ValueError: the tokens or the KV do not fit the chunk's layout, the KV is not contiguous,
            or origin is not ORIGIN_STANDALONE or ORIGIN_FINAL.
    """
    kv_view = memoryview(kv)
    if not kv_view.c_contiguous:
        raise ValueError("the KV bytes must be one contiguous buffer")
    kv_view = kv_view.cast("B")
    if kv_view.nbytes != chunk.kv_bytes:
        raise ValueError(f"{kv_view.nbytes} KV bytes for a layout of {chunk.kv_bytes}")
    out = bytearray(chunk.value_bytes)
    out[:chunk.kv_at] = head_of(chunk, tokens, pos0, origin)
    out[chunk.kv_at:] = kv_view
    out[_DIGEST_AT:HEADER_BYTES] = _digest(out, key)
    return memoryview(out).toreadonly()


def head_of(chunk: ChunkId, tokens: np.ndarray, pos0: int, origin: int) -> bytearray:
    """The first ``kv_at`` bytes of ``chunk``'s value (header, tokens, padding) with a zero
    digest: what ``encode`` writes, and what a peer reader hashes before the KV it read.

    Raises:
        ValueError: the tokens do not fit the chunk, or origin is not one of ORIGINS.
    """
    tokens = np.ascontiguousarray(tokens, "<u4")
    if tokens.shape != (chunk.chunk_size,):
        raise ValueError(f"{tokens.shape} token ids for a chunk of {chunk.chunk_size}")
    if origin not in ORIGINS:
        raise ValueError(f"origin must be one of {ORIGINS}, got {origin}")
    out = bytearray(chunk.kv_at)
    _HEAD.pack_into(out, 0, MAGIC, FORMAT, int(chunk.dtype), chunk.num_layers, chunk.chunk_size,
                    chunk.hidden_dim, chunk.rank, origin, pos0, chunk.root, chunk.chunk_hash,
                    bytes(DIGEST_BYTES))
    out[HEADER_BYTES:HEADER_BYTES + tokens.nbytes] = tokens.tobytes()
    return out


def record_head(chunk: ChunkId, tokens: np.ndarray, kv: Any, pos0: int, origin: int, *,
                key: RemoteKey) -> bytes:
    """The record of ``chunk`` (header and tokens, ``88 + 4 C`` bytes) with the digest its value
    would carry, computed over ``kv`` where it lies (no copy): a record written without its
    value (peer reads with ``values`` off)."""
    head = head_of(chunk, tokens, pos0, origin)
    h = hash_head(head, key)
    h.update(memoryview(kv).cast("B"))
    head[_DIGEST_AT:HEADER_BYTES] = h.digest()[:DIGEST_BYTES]
    return bytes(head[:HEADER_BYTES + 4 * chunk.chunk_size])


def kv_digest_ok(chunk: ChunkId, tokens: np.ndarray, pos0: int, origin: int, kv: Any,
                 digest: bytes, *, key: RemoteKey) -> bool:
    """Whether ``kv`` (read from a holder's slab) is the KV whose value's digest is ``digest``:
    the value's head rebuilt from what the record said, then the KV, under ``key``."""
    if origin not in ORIGINS:
        return False
    h = hash_head(head_of(chunk, tokens, pos0, origin), key)
    h.update(memoryview(kv).cast("B"))
    return digest_matches(h.digest(), digest)


@dataclass(frozen=True)
class Fetched:
    """A chunk read back and checked: ``kv`` is a flat byte view of its KV, read-only over the
    value (``get``) or over the caller's buffer (``get_into``)."""

    kv: memoryview
    pos0: int
    origin: int


def decode(value: bytes | None, chunk: ChunkId, tokens: np.ndarray, *, key: RemoteKey
           ) -> Fetched | Miss:
    """``value`` checked against what the reader expects and its digest under ``key`` (module
    docstring); a ``Miss`` says which check failed."""
    if value is None:
        return Miss.ABSENT
    head = check_head(value, len(value), chunk, tokens)
    if isinstance(head, Miss):
        return head
    pos0, origin, digest = head
    if not digest_matches(_digest(value, key), digest) or origin not in ORIGINS:
        return Miss.CORRUPT
    return Fetched(memoryview(value)[chunk.kv_at:], pos0, origin)


def check_head(head: bytes, length: int, chunk: ChunkId, tokens: np.ndarray
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
        digest: the value's digest (what a peer read's KV is checked against).
        peer: where the KV sits in its holder's slab, or None (no peer reads).
    """

    chunk: ChunkId
    tokens: np.ndarray
    pos0: int
    origin: int
    expires_ms: int
    digest: bytes = bytes(DIGEST_BYTES)
    peer: PeerAt | None = None


#: a holder's name: the characters of ``dataplane.settings.PEER_HOST_PATTERN`` and ``/``
HOLDER_PATTERN = re.compile(rb"[A-Za-z0-9_.:/-]{1,320}")
MAX_OFFSET = 1 << 56


@dataclass(frozen=True)
class PeerAt:
    """Where a chunk's KV sits in its holder's slab (module docstring), from a record.

    Attributes:
        holder: the holder's name (its endpoint record's, ``dataplane.peerread``).
        offset: the KV's byte offset in the holder's registered slab.
        valued: whether the value was also written to the remote store.
    """

    holder: str
    offset: int
    valued: bool

    def pack(self) -> bytes:
        return f"{int(self.valued)}:{self.offset}:{self.holder}".encode()

    @classmethod
    def parse(cls, raw: bytes | None) -> "PeerAt | None":
        """A record's field ``p`` checked for form; None when absent or malformed."""
        parts = raw.split(b":", 2) if isinstance(raw, bytes) else []
        if (len(parts) != 3 or parts[0] not in (b"0", b"1") or not parts[1].isdigit()
                or len(parts[1]) > 17 or HOLDER_PATTERN.fullmatch(parts[2]) is None):
            return None
        offset = int(parts[1])
        return cls(parts[2].decode(), offset, parts[0] == b"1") if offset < MAX_OFFSET else None


def parse_record(head: bytes, expires: bytes | str, peer: bytes | None = None) -> Record | None:
    """A stream record's fields checked for form (sizes, magic, format, bounds); None when any
    check fails. The digest covers the KV too, so it is checked when the value is read. ``peer``
    (field ``p``) that does not parse is dropped: the record stands without it."""
    if len(head) < HEADER_BYTES:
        return None
    (magic, fmt, dtype, layers, size, hidden, rank, origin, pos0, root, key,
     digest) = _HEAD.unpack_from(head, 0)
    try:
        expires_ms = int(expires)
        kind = DType(dtype)
    except ValueError:
        return None
    if (magic != MAGIC or fmt != FORMAT or origin not in ORIGINS or pos0 < 0
            or not (0 < layers <= MAX_LAYERS and 0 < size <= MAX_CHUNK
                    and 0 < hidden <= MAX_HIDDEN and rank < MAX_RANK)
            or len(head) != HEADER_BYTES + 4 * size):
        return None
    chunk = ChunkId(root, key, rank, kind, layers, size, hidden)
    tokens = np.frombuffer(head, "<u4", size, HEADER_BYTES)
    return Record(chunk, tokens, pos0, origin, expires_ms, digest, PeerAt.parse(peer))


def _digest(value: bytes | bytearray, key: RemoteKey) -> bytes:
    """HMAC-SHA256 rather than keyed BLAKE2b: CPUs hash SHA-256 in hardware, and HMAC adds two
    blocks per value; 1.81 GB/s against 0.95 on the 2-core VM (32 MiB, ``benchmarks/
    remote_digest.py``), and a fetch checks every byte it reads. Keyed, it catches a forger with
    write access to the remote as well as corruption and truncation."""
    return hash_head(value, key).digest()[:DIGEST_BYTES]


def digest_matches(got: bytes, want: bytes) -> bool:
    """Whether a digest computed (its first DIGEST_BYTES) equals the one a value carries, in
    constant time (a forger learns nothing from how long a check took)."""
    return hmac.compare_digest(got[:DIGEST_BYTES], want)


def hash_head(head: bytes | bytearray, key: RemoteKey) -> Any:
    """HMAC-SHA256 under ``key`` begun over the first bytes of a value, less the digest field; a
    reader of the KV apart goes on with ``update``."""
    h = key.hasher()
    view = memoryview(head)
    h.update(view[:_DIGEST_AT])
    h.update(view[HEADER_BYTES:])
    return h


__all__ = ["ChunkId", "Fetched", "Miss", "Record", "RemoteKey", "PeerAt", "encode", "decode",
           "head_of", "record_head", "kv_digest_ok", "check_head",
           "hash_head", "digest_matches", "parse_record", "MIN_KEY_BYTES", "MAGIC", "FORMAT",
           "HEADER_BYTES", "KEY_PREFIX", "STREAM", "ORIGINS", "MAX_LAYERS", "MAX_CHUNK",
           "MAX_HIDDEN", "MAX_RANK"]
