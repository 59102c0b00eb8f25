"""Peer reads of the holder's slab against a Redis GET with a warm allocator, side by side.

    python benchmarks/remote_peer.py [--rounds 5] [--mib 2 8 32]

Needs the ``peer`` extra (Mooncake's transfer engine). Starts its own ``redis-server`` on loopback
(as ``tests/remote`` does) and, per chunk size, a holder host in a process of its own
(``tests.remote.peer_holder``: a store, its slab registered with the transfer engine, its chunks'
records written without values). This process is the reader host: the same chunks are also
written as values to Redis, then every round reads every chunk once per row:

- *GET, warm allocator*: one redis-py client, one GET after another, the bytes only. glibc is told
  never to use mmap for a block and never to trim its heap (``mallopt``), and a round is read
  before timing, so a GET's reply lands in memory touched before, not in fresh pages;
- *get_into + check*: ``RemoteTier.get_into`` (one stream) into a prefaulted buffer, every check;
- *peer read, bytes only*: the transfer engine's one-sided read (TCP) into a buffer of the reader's
  registered slab, no check;
- *peer read + check*: ``Peer.read_into``: the same read and the HMAC of the KV against the
  record's digest (what a promotion does before it commits).

Prints GB/s of KV (median over rounds) and each row's ratio to the GET of the same round (median).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import redis

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvblend.dataplane.peerread import Endpoint, Engine, Peer, endpoint_key  # noqa: E402
from kvblend.dataplane.peerread import unavailable  # noqa: E402
from kvblend.dataplane.remote import Fetched, RemoteTier, encode  # noqa: E402
from kvblend.shm.header import ORIGIN_STANDALONE  # noqa: E402
from tests.harness import remove_prefix, unique_prefix  # noqa: E402
from tests.remote.conftest import KEY, started  # noqa: E402
from tests.remote.peer_setup import C, HOST, POS0, Document, document, open_store  # noqa: E402

SEED = 7
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters


def warm_allocator() -> None:
    """Every block from the heap, and the heap never given back: a freed reply's memory is
    reused by the next one (glibc only; elsewhere the GET row runs as it is)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        print("not glibc: the GET row runs with the allocator as it is")
        return
    assert libc.mallopt(M_MMAP_MAX, 0) == 1 and libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def layout(mib: int) -> tuple[int, int]:
    """(layers, hidden) of a bf16 chunk of C tokens with ``mib`` MiB of KV."""
    layers = 32
    return layers, (mib << 20) // (2 * layers * C * 2)


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def rows(doc: Document, reader: Peer, plain: redis.Redis, tier: RemoteTier, dest: np.ndarray,
         engine: Engine) -> list[tuple[str, Callable[[], None]]]:
    places = [reader.place(cid) for cid in doc.ids]
    assert all(p is not None for p in places), "the holder's records were not all found"
    endpoint = msgspec.json.decode(plain.get(endpoint_key(places[0].at.holder)), type=Endpoint)

    def get() -> None:
        for cid in doc.ids:
            assert plain.get(cid.key) is not None

    def get_into() -> None:
        for cid, tokens in zip(doc.ids, doc.rows):
            assert isinstance(tier.get_into(cid, tokens, dest), Fetched)

    def peer_bytes() -> None:
        for cid, place in zip(doc.ids, places):
            assert engine.read(endpoint.session, int(dest.ctypes.data),
                               endpoint.base + place.at.offset, cid.kv_bytes)

    def peer_checked() -> None:
        for cid, tokens, place in zip(doc.ids, doc.rows, places):
            assert isinstance(reader.read_into(cid, tokens, dest, place), Fetched)

    return [("GET, warm allocator", get), ("get_into + check", get_into),
            ("peer read, bytes only", peer_bytes), ("peer read + check", peer_checked)]


def run(mib: int, chunks: int, url: str, rounds: int) -> None:
    layers, hidden = layout(mib)
    doc = document(chunks, SEED, layers, hidden)
    kv_bytes = doc.ids[0].kv_bytes
    holder_prefix, reader_prefix = unique_prefix("kvbpeerbA"), unique_prefix("kvbpeerbB")
    with subprocess.Popen([sys.executable, "-m", "tests.remote.peer_holder", holder_prefix, url,
                           str(chunks), str(SEED), str(layers), str(hidden)], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            store = open_store(reader_prefix, -(-(kv_bytes + 8192) // 4096) * 4096)
            tier = RemoteTier(url, key=KEY, timeout_s=30)
            reader = Peer(tier, store, f"{HOST}/{reader_prefix}", Engine(HOST))
            bare = Engine(HOST)  # the bytes-only row's: the same transport, nothing else
            for i, (cid, tokens) in enumerate(zip(doc.ids, doc.rows)):
                assert tier.put(cid, encode(cid, tokens, doc.kvs[i], POS0 + i * C,
                                            ORIGIN_STANDALONE, key=KEY), publish=False)
            reader.learn([r for _, r in tier.records("0", 10 * chunks) or [] if r is not None])
            dest = store.slab[:kv_bytes]  # registered, as a reserved slot is
            with redis.Redis.from_url(url) as plain:
                table = rows(doc, reader, plain, tier, dest, bare)
                for _, fn in table:  # warm-up: the allocator's heap, the connections
                    fn()
                times = [[timed(fn) for _, fn in table] for _ in range(rounds)]
            reader.close()
            tier.close()
            store.close()
        finally:
            holder.kill()
            remove_prefix(holder_prefix)
            remove_prefix(reader_prefix)
    for i, (label, _) in enumerate(table):
        rate = chunks * kv_bytes / statistics.median(t[i] for t in times) / 1e9
        ratio = statistics.median(t[0] / t[i] for t in times)
        print(f"{mib:>3} MiB x {chunks:<3} {label:<24} {rate:6.2f} GB/s  {ratio:5.2f}x",
              flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--total-mib", type=int, default=128, help="KV read per row and round")
    args = p.parse_args()
    reason = unavailable()
    if reason is not None:
        sys.exit(f"remote_peer: {reason}")
    warm_allocator()
    server = started()
    try:
        for mib in args.mib:
            with server.client() as raw:
                raw.flushall()
            run(mib, max(1, args.total_mib // mib), server.url, args.rounds)
    finally:
        server.close()


if __name__ == "__main__":
    main()
