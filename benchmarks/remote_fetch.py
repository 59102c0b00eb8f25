"""The remote tier's read path against a plain redis-py GET, side by side in one run.

    python benchmarks/remote_fetch.py [--rounds 5] [--chunks 16]

Starts its own redis-server processes on loopback (a standalone one and a 3-master cluster, as
``tests/remote`` does), writes ``--chunks`` encoded chunks of 2 MiB and of 32 MiB of KV, then reads
them all back:

- *plain GET*: one redis-py client, one GET after another, the bytes only;
- *get, N threads*: ``RemoteTier.get`` (GET, then every check of ``decode``: header, tokens,
  HMAC-SHA256 over the whole value) from N threads sharing the tier's connection pool;
- *get_into, N streams*: ``RemoteTier.get_into``, one chunk after another, each read in N pieces at
  once into one preallocated numpy buffer (and checked as ``get`` does);
- *get_into, 8 chunks at once*: 8 threads, each ``get_into`` with one stream into a preallocated
  buffer of its chunk.

Each round reads every row once, in turn. Prints GB/s of KV (median over rounds) and each row's
speed-up over the plain GET of the same server (median over rounds of the ratio within a round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblend.dataplane.remote import ChunkId, Fetched, RemoteTier, encode  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402
from kvblend.shm.header import ORIGIN_STANDALONE  # noqa: E402
from kvblend.shm.layout import DType  # noqa: E402
from tests.remote.conftest import KEY, ClusterProcs, started  # noqa: E402

C = 256
SIZES = {"2 MiB": (8, 256), "32 MiB": (32, 1024)}  # KV bytes of a chunk -> (layers, hidden), bf16
STREAMS = (1, 4, 8)  # threads of the get rows, streams of the get_into rows
AT_ONCE = 8  # chunks read at once, one stream each, in the last row
Item = tuple[ChunkId, np.ndarray, memoryview]  # a chunk, its token ids, its value
Row = tuple[str, Callable[[], None], Callable[[], None]]  # label, read every chunk, clean up


def chunks(n: int, layers: int, hidden: int) -> list[Item]:
    ns = Namespace("bench-remote")
    tokens = np.random.default_rng(n).integers(0, 50_000, n * C, dtype=np.uint32)
    kv = np.random.default_rng(1).integers(0, 2**16, (2, layers, C, hidden), dtype=np.uint16)
    out = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        cid = ChunkId(ns.root, h, 0, DType.BFLOAT16, layers, C, hidden)
        row = tokens[i * C:(i + 1) * C]
        out.append((cid, row, encode(cid, row, kv, i * C, ORIGIN_STANDALONE, key=KEY)))
    return out


def timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(name: str, url: str, plain: redis.Redis | redis.RedisCluster, args: argparse.Namespace
        ) -> None:
    for size, (layers, hidden) in SIZES.items():
        items = chunks(args.chunks, layers, hidden)
        kv_bytes = sum(c.kv_bytes for c, _, _ in items)
        with RemoteTier(url, key=KEY, timeout_s=30) as tier:
            for cid, _, value in items:
                assert tier.put(cid, value)

            def plain_get() -> None:
                for cid, _, _ in items:
                    assert plain.get(cid.key) is not None

            rows: list[Row] = [("plain GET", plain_get, lambda: None), *readers(tier, items)]
            # every row once per round: a load that comes and goes on the machine weighs on
            # every row alike, and each ratio is taken within a round
            times = [[timed(fetch) for _, fetch, _ in rows] for _ in range(args.rounds)]
            for _, _, done in rows:
                done()
        for i, (label, _, _) in enumerate(rows):
            rate = kv_bytes / statistics.median(t[i] for t in times) / 1e9
            show(name, size, label, rate, statistics.median(t[0] / t[i] for t in times))


def show(name: str, size: str, label: str, rate: float, ratio: float) -> None:
    print(f"{name:<12} {size:>7}  {label:<27} {rate:6.2f} GB/s  {ratio:5.2f}x", flush=True)


def readers(tier: RemoteTier, items: list[Item]) -> Iterator[Row]:
    """The rows after the plain GET."""
    for threads in STREAMS:
        pool = ThreadPoolExecutor(threads)

        def get(pool: ThreadPoolExecutor = pool) -> None:
            got = list(pool.map(lambda item: tier.get(item[0], item[1]), items))
            assert all(isinstance(g, Fetched) for g in got)

        yield f"get, {threads} thread{'s' if threads > 1 else ''}", get, pool.shutdown
    dest = prefaulted(items[0][0].kv_bytes)
    for streams in STREAMS:
        def into(streams: int = streams) -> None:
            for cid, tokens, _ in items:
                assert isinstance(tier.get_into(cid, tokens, dest, streams), Fetched)

        yield f"get_into, {streams} stream{'s' if streams > 1 else ''}", into, lambda: None
    pool = ThreadPoolExecutor(AT_ONCE)
    dests = [prefaulted(cid.kv_bytes) for cid, _, _ in items]

    def at_once() -> None:
        got = list(pool.map(lambda item, dest: tier.get_into(item[0], item[1], dest), items, dests))
        assert all(isinstance(g, Fetched) for g in got)

    yield f"get_into, {AT_ONCE} chunks at once", at_once, pool.shutdown


def prefaulted(size: int) -> np.ndarray:
    """A buffer whose pages are mapped already, as a slab's are."""
    dest = np.empty(size, np.uint8)
    dest.fill(0)
    return dest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--chunks", type=int, default=16)
    args = p.parse_args()
    server = started()
    cluster = ClusterProcs()
    try:
        run("standalone", f"redis://127.0.0.1:{server.port}", server.client(), args)
        seeds = ",".join(f"{h}:{port}" for h, port in cluster.seeds)
        plain = redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, port)
                                                  for h, port in cluster.seeds])
        run("3 masters", f"redis+cluster://{seeds}", plain, args)
    finally:
        server.close()
        cluster.close()


if __name__ == "__main__":
    main()
