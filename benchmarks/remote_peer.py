"""The remote tier's costs in one run: reads at 2, 8 and 32 MiB by 1 and 4 clients (a Redis GET
with a warm allocator, the tier's checked read, a peer read of the holder's slab), write-behind
against the local store, Redis memory per chunk, and the break-even prefill rate per model.

    python benchmarks/remote_peer.py [--rounds 5] [--mib 2 8 32] [--clients 1 4]

Needs the ``peer`` extra (Mooncake's transfer engine). Starts its own ``redis-server`` on loopback
(as ``tests/remote`` does) and, per chunk size, a holder host in a process of its own
(``tests.remote.peer_holder``: a store, its slab registered with the transfer engine, its chunks'
records written without values). This process is the reader host: the same chunks are also
written as values to Redis. Chunks of 16 tokens, bf16, whose layers and hidden size give 2, 8 and
32 MiB of KV; ``--total-mib`` of KV per row and round. Parts, per size:

- *Redis memory*: the server's ``used_memory`` before and after the values were written, per
  chunk, against the chunk's raw KV bytes; and ``MEMORY USAGE`` of the record stream per record
  (what ``--remote-peer-records-only`` keeps instead of a value).
- *reads*, each row by 1 and by 4 clients at once (threads, each reading its share of the chunks
  into a buffer of its own):

  - *GET, warm allocator*: redis-py, one GET after another, the bytes only, a connection per
    client. glibc is told never to use mmap for a block and never to trim its heap
    (``mallopt``), and every row runs once before timing, so a GET's reply lands in memory
    touched before, not in fresh pages;
  - *get_into + check*: ``RemoteTier.get_into`` (one stream) into the reader's slab, every check;
  - *peer read, bytes only*: the transfer engine's one-sided read (TCP) into the reader's
    registered slab, no check;
  - *peer read + check*: ``Peer.read_into``: the same read into a staging buffer, its copy into
    the reader's slab and the HMAC of the KV against the record's digest (what a promotion does
    before it commits).

- *write-behind*: a third store (the writer host, in this process) commits the chunks (reserve,
  copy of the KV into the slab, commit: the local store's own work, without the engine's channel),
  then ``WriteBehind`` with 4 writers (``--remote-streams`` 8, the default) writes them behind, as
  values and records, then as records only (``--remote-peer-records-only``); each from its offer
  until its flush returns.

Then the break-even: ``fleet_model``'s model shapes give KV bytes per token; a remote chunk pays
when it is fetched faster than it is prefilled, so fetching wins below ``GB/s / KV per token``
tokens/s of prefill, for each checked read at the largest size.

Prints GB/s of KV (median over rounds) and each row's ratio (median, within a round) to the GET by
as many clients, or to the local store; and the load average before and after.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import msgspec
import numpy as np
import redis
from fleet_model import MODELS, Shape  # benchmarks/, this script's folder

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from kvblend.dataplane.peerread import Endpoint, Engine, Peer, endpoint_key  # noqa: E402
from kvblend.dataplane.peerread import unavailable  # noqa: E402
from kvblend.dataplane.remote import STREAM, Fetched, RemoteTier, encode  # noqa: E402
from kvblend.dataplane.writebehind import WriteBehind  # noqa: E402
from kvblend.shm.header import ORIGIN_STANDALONE  # noqa: E402
from tests.harness import remove_prefix, unique_prefix  # noqa: E402
from tests.remote.conftest import KEY, started  # noqa: E402
from tests.remote.peer_setup import (C, HOST, POS0, Document, commit_chunks, document,  # noqa: E402
                                     open_store)

SEED = 7
WRITERS = 4  # write-behind threads of a served data plane: half of --remote-streams (8)
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters
GET, LOCAL = "GET, warm allocator", "local store (commit)"  # the rows the others compare with
Row = tuple[str, int, Callable[[], None]]  # label, clients, one pass over every chunk
Results = dict[tuple[int, str, int], float]  # (MiB, label, clients) -> GB/s


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


def slot_bytes(kv_bytes: int) -> int:
    return -(-(kv_bytes + 8192) // 4096) * 4096


def spread(pool: ThreadPoolExecutor, clients: int, n: int, one: Callable[[int, int], None]
           ) -> Callable[[], None]:
    """A pass over chunks 0..n-1 by ``clients`` at once: client k reads chunks k, k+clients, ...
    with ``one(client, chunk)``."""
    def part(k: int) -> None:
        for i in range(k, n, clients):
            one(k, i)

    def run() -> None:
        for f in [pool.submit(part, k) for k in range(clients)]:
            f.result()

    return run


def read_rows(doc: Document, reader: Peer, url: str, tier: RemoteTier, dests: list[np.ndarray],
              engine: Engine, pool: ThreadPoolExecutor, clients: int, closing: ExitStack
              ) -> list[Row]:
    """The four read rows by ``clients`` at once, each client into ``dests[client]``."""
    places = [reader.place(cid) for cid in doc.ids]
    assert all(p is not None for p in places), "the holder's records were not all found"
    plains = [closing.enter_context(redis.Redis.from_url(url)) for _ in range(clients)]
    endpoint = msgspec.json.decode(plains[0].get(endpoint_key(places[0].at.holder)),
                                   type=Endpoint)
    ids, rows, n = doc.ids, doc.rows, len(doc.ids)

    def get(k: int, i: int) -> None:
        assert plains[k].get(ids[i].key) is not None

    def get_into(k: int, i: int) -> None:
        assert isinstance(tier.get_into(ids[i], rows[i], dests[k]), Fetched)

    def peer_bytes(k: int, i: int) -> None:
        assert engine.read(endpoint.session, int(dests[k].ctypes.data),
                           endpoint.base + places[i].at.offset, ids[i].kv_bytes)

    def peer_checked(k: int, i: int) -> None:
        assert isinstance(reader.read_into(ids[i], rows[i], dests[k], places[i]), Fetched)

    return [(label, clients, spread(pool, clients, n, fn)) for label, fn in (
        (GET, get), ("get_into + check", get_into),
        ("peer read, bytes only", peer_bytes), ("peer read + check", peer_checked))]


def write_rows(doc: Document, tier: RemoteTier, prefix: str, closing: ExitStack) -> list[Row]:
    """The local store's commit of the chunks, and their write-behind (values, then records
    only), each pass on an emptied store."""
    store = open_store(prefix, len(doc.ids) * slot_bytes(doc.ids[0].kv_bytes) + (1 << 20),
                       max(1 << 18, slot_bytes(doc.ids[0].kv_bytes)))
    closing.callback(store.close)
    records_only = Peer(tier, store, f"{HOST}/{prefix}", Engine(HOST), values=False)
    closing.callback(records_only.close)
    committed: list[tuple[int, list]] = []

    def local() -> None:
        store.clear()
        committed[:] = [commit_chunks(store, doc)]

    def behind(peer: Peer | None) -> Callable[[], None]:
        def run() -> None:
            class_id, keys = committed[0]
            wb = WriteBehind(store, tier, writers=WRITERS, peer=peer)
            wb.offer(class_id, doc.ns.root, keys, doc.rows)
            assert wb.flush(timeout=120) and wb.counts["written"] == len(keys), wb.counts
            wb.close(timeout=10)
        return run

    rows = [(LOCAL, 1, local), ("write-behind, values", WRITERS, behind(None)),
            ("write-behind, records only", WRITERS, behind(records_only))]
    return rows


def redis_memory(plain: redis.Redis, doc: Document, url: str) -> tuple[float, float]:
    """Write ``doc``'s values on connections of their own, closed before ``used_memory`` is read
    again (a connection's query buffer would count); (used_memory added, ``MEMORY USAGE`` of a
    value) per value."""
    before = plain.info("memory")["used_memory"]
    with RemoteTier(url, key=KEY, timeout_s=30) as tier:
        for i, (cid, tokens) in enumerate(zip(doc.ids, doc.rows)):
            assert tier.put(cid, encode(cid, tokens, doc.kvs[i], POS0 + i * C,
                                        ORIGIN_STANDALONE, key=KEY), publish=False)
    plain.ping()
    added = (plain.info("memory")["used_memory"] - before) / len(doc.ids)
    usage = statistics.mean(plain.memory_usage(cid.key, samples=0) for cid in doc.ids)
    return added, usage


def per_record(plain: redis.Redis) -> tuple[float, int]:
    """``MEMORY USAGE`` of the record stream per record, and its records."""
    records = plain.xlen(STREAM)
    return plain.memory_usage(STREAM, samples=0) / max(1, records), records


def run(mib: int, chunks: int, url: str, args: argparse.Namespace, results: Results) -> None:
    layers, hidden = layout(mib)
    doc = document(chunks, SEED, layers, hidden)
    kv_bytes = doc.ids[0].kv_bytes
    holder_prefix, reader_prefix, writer_prefix = (unique_prefix(f"kvbpeerb{x}") for x in "ABW")
    clients = max(args.clients)
    with subprocess.Popen([sys.executable, "-m", "tests.remote.peer_holder", holder_prefix, url,
                           str(chunks), str(SEED), str(layers), str(hidden)], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as holder, \
            ThreadPoolExecutor(clients) as pool, redis.Redis.from_url(url) as plain:
        try:
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            # the holder wrote its endpoint record once, with its TTL, and renews nothing: keep
            # it for the run, which can outlast the TTL on a loaded machine
            assert plain.persist(endpoint_key(f"{HOST}/{holder_prefix}"))
            added, usage = redis_memory(plain, doc, url)
            stride = slot_bytes(kv_bytes)
            with ExitStack() as closing:  # closed in reverse: the peers before their stores
                store = open_store(reader_prefix, clients * stride + (1 << 20))
                closing.callback(store.close)
                tier = closing.enter_context(RemoteTier(url, key=KEY, timeout_s=30))
                reader = Peer(tier, store, f"{HOST}/{reader_prefix}", Engine(HOST),
                              staging=clients, staging_bytes=kv_bytes, read_timeout_s=60)
                closing.callback(reader.close)
                bare = Engine(HOST)  # the bytes-only row's: the same transport, nothing else
                closing.callback(bare.close)
                reader.learn([r for _, r in tier.records("0", 10 * chunks) or [] if r])
                dests = [store.slab[k * stride:k * stride + kv_bytes] for k in range(clients)]
                table = [row for n in args.clients for row in
                         read_rows(doc, reader, url, tier, dests, bare, pool, n, closing)]
                table += write_rows(doc, tier, writer_prefix, closing)
                for _, _, fn in table:  # warm-up: the allocator's heap, the connections
                    fn()
                times = [[timed(fn) for _, _, fn in table] for _ in range(args.rounds)]
                record, records = per_record(plain)
        finally:
            holder.kill()
            for prefix in (holder_prefix, reader_prefix, writer_prefix):
                remove_prefix(prefix)
    print(f"\n{mib} MiB of KV a chunk, {chunks} chunks ({chunks * mib} MiB) per row and round")
    print(f"  Redis per value: used_memory {added / 2**20:.3f} MiB = {added / kv_bytes:.3f}x "
          f"the raw KV, MEMORY USAGE {usage / 2**20:.3f} MiB = {usage / kv_bytes:.3f}x")
    print(f"  Redis per record ({C} tokens): {record:,.0f} B = {record / kv_bytes:.5f}x the raw "
          f"KV (a stream of {records} records)")
    show(table, times, chunks * kv_bytes, mib, results)


def show(rows: list[Row], times: list[list[float]], nbytes: int, mib: int, results: Results
         ) -> None:
    """Each row's GB/s and its ratio to its reference: the GET by as many clients, or the local
    store."""
    def col(i: int) -> list[float]:
        return [t[i] for t in times]

    where = {(label, clients): i for i, (label, clients, _) in enumerate(rows)}
    for i, (label, clients, _) in enumerate(rows):
        writing = label.startswith(("local", "write"))
        ref = where[LOCAL, 1] if writing else where[GET, clients]
        rate = nbytes / statistics.median(col(i)) / 1e9
        results[mib, label, clients] = rate
        ratio = statistics.median(r / t for r, t in zip(col(ref), col(i)))
        who = "writers" if label.startswith("write") else (
            "thread " if writing else "clients" if clients > 1 else "client ")
        print(f"  {label:<27} {clients} {who}  {rate:6.2f} GB/s  "
              f"{ratio:5.2f}x {'local' if writing else 'GET'}", flush=True)


def break_even(results: Results, mib: int, clients: Sequence[int]) -> None:
    print(f"\nBreak-even at {mib} MiB a chunk: fetching wins below this prefill rate "
          "(tokens/s; H200 prefill: fleet_model's)")
    shapes: list[Shape] = list(MODELS.values())
    print(f"  {'read':<21} {'clients':>7} {'GB/s':>6}" + "".join(
        f" {s.name:>14}" for s in shapes))
    for label in (GET, "get_into + check", "peer read + check"):
        for n in clients:
            gbps = results[mib, label, n]
            print(f"  {label:<21} {n:>7} {gbps:6.2f}" + "".join(
                f" {gbps * 1e9 / s.kv_bytes_per_token:14,.0f}" for s in shapes))
    print(f"  {'prefill, one H200':<36}" + "".join(
        f" {s.prefill_tps('h200'):14,.0f}" for s in shapes))
    print("  KV per token: " + ", ".join(f"{s.name} {s.kv_bytes_per_token >> 10} KiB"
                                         for s in shapes))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--mib", type=int, nargs="+", default=[2, 8, 32])
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4])
    p.add_argument("--total-mib", type=int, default=128, help="KV read per row and round")
    args = p.parse_args()
    reason = unavailable()
    if reason is not None:
        sys.exit(f"remote_peer: {reason}")
    warm_allocator()
    print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    server = started()
    results: Results = {}
    try:
        for mib in args.mib:
            with server.client() as raw:
                raw.flushall()
            run(mib, max(max(args.clients), args.total_mib // mib), server.url, args, results)
    finally:
        server.close()
    break_even(results, max(args.mib), args.clients)
    print("load average after: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))


if __name__ == "__main__":
    main()
