"""The remote tier's keyed digest on a real ``redis-server`` (``tests/remote/conftest.py``): a
well-formed value written straight into the server by someone without the key (an unkeyed digest,
another key, or format 1, whose digest was unkeyed) is a miss through every read, ``get``,
``get_into`` and a promotion into a real store, never KV; the value written under the key is a
hit, byte for byte."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import redis

from kvblend.dataplane.promote import Promoted, promote
from kvblend.dataplane.remote import ChunkId, Fetched, Miss, RemoteKey, RemoteTier, encode
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_STANDALONE
from kvblend.shm.layout import ChunkClass, DType, KVLayout
from kvblend.shm.store import ChunkKey, Store
from tests.remote.conftest import KEY

C, L, D = 16, 2, 32
DIGEST_AT, DIGEST_END = 72, 88  # the DIGEST field (dataplane.remoteformat's drawing)
OTHER_KEY = RemoteKey("not-the-deployment-key-0123456789")


def a_chunk() -> tuple[Namespace, ChunkId, np.ndarray, np.ndarray]:
    ns = Namespace("keyed-digest")
    tokens = np.arange(7, 7 + C, dtype=np.uint32)
    cid = ChunkId(ns.root, chunk_hashes(ns, tokens, C)[0], 0, DType.BFLOAT16, L, C, D)
    kv = np.random.default_rng(3).integers(0, 2**16, (2, L, C, D), dtype=np.uint16)
    return ns, cid, tokens, kv


def unkeyed(value: bytes, fmt: int | None = None) -> bytes:
    """``value`` with its format set to ``fmt`` and its digest made as anyone can: SHA-256 of
    every other byte, unkeyed (what format 1 carried)."""
    out = bytearray(value)
    if fmt is not None:
        struct.pack_into("<H", out, 8, fmt)
    h = hashlib.sha256(out[:DIGEST_AT])
    h.update(out[DIGEST_END:])
    out[DIGEST_AT:DIGEST_END] = h.digest()[:DIGEST_END - DIGEST_AT]
    return bytes(out)


def forgeries(cid: ChunkId, tokens: np.ndarray, kv: np.ndarray) -> dict[str, tuple[bytes, Miss]]:
    """Well-formed values of the chunk with the forger's KV, none under the deployment's key."""
    forged = kv ^ np.uint16(0xFFFF)
    value = bytes(encode(cid, tokens, forged, 0, ORIGIN_STANDALONE, key=KEY))
    return {"unkeyed digest": (unkeyed(value), Miss.CORRUPT),
            "another key": (bytes(encode(cid, tokens, forged, 0, ORIGIN_STANDALONE,
                                         key=OTHER_KEY)), Miss.CORRUPT),
            "format 1": (unkeyed(value, fmt=1), Miss.FORMAT)}


def test_a_value_written_without_the_key_is_a_miss_the_keyed_one_a_hit(
        redis_url: str, store: Store) -> None:
    ns, cid, tokens, kv = a_chunk()
    class_id = store.register_class(ChunkClass.of(
        ns.model_name, 1, KVLayout(L, C, D, DType.BFLOAT16), C))
    raw = redis.Redis.from_url(redis_url)
    dest = np.empty(cid.kv_bytes, np.uint8)
    with RemoteTier(redis_url, key=KEY) as tier:
        for name, (value, miss) in forgeries(cid, tokens, kv).items():
            raw.set(cid.key, value)
            assert tier.get(cid, tokens) is miss, name
            for streams in (1, 4):
                assert tier.get_into(cid, tokens, dest, streams) is miss, (name, streams)
            assert promote(store, tier, class_id, ns.id, cid, tokens) is miss, name
            assert not store.contains_key(ChunkKey(ns.id, cid.chunk_hash)), name
        assert tier.put(cid, encode(cid, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY))
        got = tier.get(cid, tokens)
        assert isinstance(got, Fetched) and bytes(got.kv) == kv.tobytes()
        got = tier.get_into(cid, tokens, dest, 4)
        assert isinstance(got, Fetched) and dest.tobytes() == kv.tobytes()
        assert promote(store, tier, class_id, ns.id, cid, tokens) is Promoted.PROMOTED
    with RemoteTier(redis_url, key=OTHER_KEY) as other:  # a host with another key: a miss too
        assert other.get(cid, tokens) is Miss.CORRUPT


def test_the_key_is_checked_and_never_shown() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes"):
        RemoteKey("too-short")
    assert "0123456789" not in repr(OTHER_KEY)
