"""``dataplane.remote`` without a server: the value format round-trips byte for byte, and every
way a value can be wrong is a miss that says why, never KV bytes; the breaker; ``--remote`` URLs."""

from __future__ import annotations

import numpy as np
import pytest

from kvblend.dataplane.remote import (HEADER_BYTES, Breaker, ChunkId, Fetched, Miss, RemoteKey,
                                      decode, encode)
from kvblend.dataplane.remoteurl import RemoteURL
from kvblend.shm.hashing import Namespace, chunk_hashes
from kvblend.shm.header import ORIGIN_FINAL, ORIGIN_STANDALONE
from kvblend.shm.layout import DType

C, L, D = 16, 3, 8
KEY = RemoteKey("remote-format-test-key")


def chunk(salt: str = "", rank: int = 0) -> tuple[ChunkId, np.ndarray, np.ndarray]:
    ns = Namespace("remote-model", 2, salt)
    tokens = np.arange(100, 100 + C, dtype=np.uint32)
    cid = ChunkId(ns.root, chunk_hashes(ns, tokens, C)[0], rank, DType.BFLOAT16, L, C, D)
    kv = np.random.default_rng(rank).integers(0, 2**16, (2, L, C, D), dtype=np.uint16)
    return cid, tokens, kv


def test_round_trip_is_byte_exact() -> None:
    cid, tokens, kv = chunk()
    value = encode(cid, tokens, kv, pos0=7, origin=ORIGIN_FINAL, key=KEY)
    assert len(value) == cid.value_bytes and cid.kv_at % 64 == 0 and cid.kv_at >= HEADER_BYTES
    got = decode(value, cid, tokens, key=KEY)
    assert isinstance(got, Fetched) and (got.pos0, got.origin) == (7, ORIGIN_FINAL)
    assert bytes(got.kv) == kv.tobytes()
    assert cid.key == f"kvblend:1:{cid.chunk_hash.hex()}:0"


def test_tenants_and_ranks_get_other_keys() -> None:
    a, b, r1 = chunk(), chunk("tenant-b"), chunk(rank=1)
    assert len({a[0].key, b[0].key, r1[0].key}) == 3


@pytest.mark.parametrize("how,miss", [
    ("absent", Miss.ABSENT),
    ("short header", Miss.TRUNCATED),
    ("truncated", Miss.TRUNCATED),
    ("longer", Miss.TRUNCATED),
    ("magic", Miss.FORMAT),
    ("format", Miss.FORMAT),
    ("other root", Miss.OTHER_CHUNK),
    ("other rank", Miss.OTHER_CHUNK),
    ("other layout", Miss.OTHER_CHUNK),
    ("other tokens", Miss.OTHER_TOKENS),
    ("kv bit", Miss.CORRUPT),
    ("pos0", Miss.CORRUPT),
    ("token in value", Miss.OTHER_TOKENS),
])
def test_a_wrong_value_is_a_miss(how: str, miss: Miss) -> None:
    cid, tokens, kv = chunk()
    value = bytearray(encode(cid, tokens, kv, pos0=0, origin=ORIGIN_STANDALONE, key=KEY))
    expect, want = cid, tokens
    if how == "absent":
        assert decode(None, cid, tokens, key=KEY) is miss
        return
    if how == "short header":
        value = value[:40]
    elif how == "truncated":
        value = value[:-1]
    elif how == "longer":
        value += b"\0"
    elif how == "magic":
        value[0] ^= 1
    elif how == "format":
        value[8] = 1  # format 1: its digest was unkeyed
    elif how == "other root":
        expect = chunk("other salt")[0]
        expect = ChunkId(expect.root, cid.chunk_hash, 0, cid.dtype, L, C, D)
    elif how == "other rank":
        expect = ChunkId(cid.root, cid.chunk_hash, 1, cid.dtype, L, C, D)
    elif how == "other layout":
        expect = ChunkId(cid.root, cid.chunk_hash, 0, DType.FLOAT16, L, C, D)
    elif how == "other tokens":
        want = tokens + 1
    elif how == "kv bit":
        value[-5] ^= 0x10
    elif how == "pos0":
        value[32] ^= 1
    elif how == "token in value":
        value[HEADER_BYTES] ^= 1
    assert decode(bytes(value), expect, want, key=KEY) is miss


def test_a_value_under_another_key_is_corrupt() -> None:
    cid, tokens, kv = chunk()
    value = encode(cid, tokens, kv, pos0=0, origin=ORIGIN_STANDALONE, key=KEY)
    assert isinstance(decode(value, cid, tokens, key=KEY), Fetched)
    assert decode(value, cid, tokens, key=RemoteKey("another-key-0123456")) is Miss.CORRUPT


def test_encode_refuses_what_does_not_fit() -> None:
    cid, tokens, kv = chunk()
    with pytest.raises(ValueError, match="token ids"):
        encode(cid, tokens[:-1], kv, 0, ORIGIN_STANDALONE, key=KEY)
    with pytest.raises(ValueError, match="KV bytes"):
        encode(cid, tokens, np.ascontiguousarray(kv[:, :, :-1]), 0, ORIGIN_STANDALONE, key=KEY)
    with pytest.raises(ValueError, match="contiguous"):
        encode(cid, tokens, kv[:, :, ::-1], 0, ORIGIN_STANDALONE, key=KEY)
    with pytest.raises(ValueError, match="origin"):
        encode(cid, tokens, kv, 0, 0, key=KEY)  # ORIGIN_UNKNOWN: the store recorded none


def test_the_breaker_opens_after_failures_and_probes_once_after_cooldown() -> None:
    now = [0.0]
    b = Breaker(failures=2, cooldown_s=10.0, clock=lambda: now[0])
    assert b.allow()
    b.record(False)
    assert b.allow() and not b.is_open
    b.record(False)
    assert b.is_open and not b.allow() and b.opened == 1
    now[0] = 9.9
    assert not b.allow()
    now[0] = 10.0
    assert b.allow() and not b.allow()  # one probe at a time
    b.record(False)  # the probe failed: open for another cooldown
    assert not b.allow() and b.opened == 1
    now[0] = 20.0
    assert b.allow()
    b.record(True)
    assert not b.is_open and b.allow() and b.allow()


@pytest.mark.parametrize("url,parsed", [
    ("redis://127.0.0.1:6379/2", (False, False, [("127.0.0.1", 6379)], 2)),
    ("rediss://cache.internal:6380", (False, True, [("cache.internal", 6380)], 0)),
    ("redis://cache.internal", (False, False, [("cache.internal", 6379)], 0)),
    ("redis+cluster://a:7000,b:7001", (True, False, [("a", 7000), ("b", 7001)], 0)),
    ("rediss+cluster://[::1]:7000", (True, True, [("::1", 7000)], 0)),
])
def test_remote_urls(url: str, parsed: tuple) -> None:
    got = RemoteURL.parse(url)
    assert (got.cluster, got.tls, list(got.nodes), got.db) == parsed
    assert RemoteURL.parse(str(got)) == got  # str() gives it back as a URL


@pytest.mark.parametrize("url,error", [
    ("http://a:1", "starts with"),
    ("redis://user:secret@a:6379", "no credentials"),
    ("redis://a:1,b:2", "cluster mode"),
    ("redis+cluster://a:7000/1", "database"),
    ("redis://a:notaport", "host:port"),
    ("redis://a:0", "host:port"),
])
def test_bad_remote_urls(url: str, error: str) -> None:
    with pytest.raises(ValueError, match=error):
        RemoteURL.parse(url)
