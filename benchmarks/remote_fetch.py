"""The remote tier's read path against a plain redis-py GET, side by side in one run.

    python benchmarks/remote_fetch.py [--rounds 5] [--chunks 16]

Starts its own redis-server processes on loopback (a standalone one and a 3-master cluster, as
``tests/remote`` does), writes ``--chunks`` encoded chunks of 2 MiB and of 32 MiB of KV, then reads
them all back:

- *plain GET*: one redis-py client, one GET after another, the bytes only;
- *kvblend fetch, N streams*: ``RemoteTier.get`` (GET, then every check of ``decode``: header,
  tokens, SHA-256 over the whole value) from N threads sharing the tier's connection pool.

Prints GB/s of KV (medians over rounds) and each row's ratio to the plain GET of the same server.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataplane.remote import ChunkId, Fetched, RemoteTier, encode  # noqa: E402
from shm.hashing import Namespace, chunk_hashes  # noqa: E402
from shm.header import ORIGIN_STANDALONE  # noqa: E402
from shm.layout import DType  # noqa: E402
from tests.remote.conftest import ClusterProcs, started  # noqa: E402

C = 256
SIZES = {"2 MiB": (8, 256), "32 MiB": (32, 1024)}  # KV bytes of a chunk -> (layers, hidden), bf16
STREAMS = (1, 4, 8)


def chunks(n: int, layers: int, hidden: int) -> list[tuple[ChunkId, np.ndarray, bytes]]:
    ns = Namespace("bench-remote")
    tokens = np.random.default_rng(n).integers(0, 50_000, n * C, dtype=np.uint32)
    kv = np.random.default_rng(1).integers(0, 2**16, (2, layers, C, hidden), dtype=np.uint16)
    out = []
    for i, h in enumerate(chunk_hashes(ns, tokens, C)):
        cid = ChunkId(ns.root, h, 0, DType.BFLOAT16, layers, C, hidden)
        row = tokens[i * C:(i + 1) * C]
        out.append((cid, row, encode(cid, row, kv, i * C, ORIGIN_STANDALONE)))
    return out


def timed(fn, rounds: int) -> float:  # type: ignore[no-untyped-def]
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(name: str, url: str, plain: redis.Redis | redis.RedisCluster, args: argparse.Namespace
        ) -> None:
    for size, (layers, hidden) in SIZES.items():
        items = chunks(args.chunks, layers, hidden)
        kv_bytes = sum(c.kv_bytes for c, _, _ in items)
        with RemoteTier(url, timeout_s=30) as tier:
            for cid, _, value in items:
                assert tier.put(cid, value)

            def plain_get() -> None:
                for cid, _, _ in items:
                    assert plain.get(cid.key) is not None

            base = kv_bytes / timed(plain_get, args.rounds) / 1e9
            print(f"{name:<12} {size:>7}  plain GET           {base:6.2f} GB/s   1.00x", flush=True)
            for streams in STREAMS:
                pool = ThreadPoolExecutor(streams)

                def fetch() -> None:
                    got = list(pool.map(lambda item: tier.get(item[0], item[1]), items))
                    assert all(isinstance(g, Fetched) for g in got)

                rate = kv_bytes / timed(fetch, args.rounds) / 1e9
                pool.shutdown()
                print(f"{name:<12} {size:>7}  kvblend, {streams} stream{'s' if streams > 1 else ' '}  "
                      f"{rate:6.2f} GB/s  {rate / base:5.2f}x", flush=True)


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
