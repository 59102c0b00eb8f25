"""Two hosts sharing chunks through the remote tier, measured end to end in one run.

    python benchmarks/remote_share.py [--docs 200] [--chunks 160] [--cluster] [--layers 8]
                                      [--hidden 1024]

Starts its own redis-server on loopback (with ``--cluster`` a 3-master cluster as well, as
``tests/remote`` does) and, on each, two ``kvblend serve --backend cpu --remote URL`` with shm
prefixes of their own: host A and host B. Every chunk is 256 fresh random token ids and KV
``[2, layers, 256, hidden]`` of bf16 (8 MiB by default). For each remote, in this order:

- *write-behind*: A stores ``--chunks`` chunks, ``--per-call`` per store call, as fast as it
  can. The local rate comes from the store calls' wall time; the write-behind rate from the first
  store's start until A's ``kvblend_remote_written_chunks_total`` (polled) counts them all, with
  the chunks dropped (the queue holds 4096), skipped or failed meanwhile. Beside them, as the
  reference for one writer thread: one redis-py client's plain SET and GET of values of the same
  size, and ``encode`` (copy and SHA-256) in this process.
- *store on A to visible on B*: for each of ``--docs`` one-chunk documents, the time from A's
  ``store_pre_computed(...).wait()`` returning to the first lookup on B that finds the chunk
  (B's HTTP lookup polled in a loop, every ``--poll-ms``; its round trip alone is reported, as
  the resolution). Once idle, once while another client stores on A at half the write-behind
  rate measured above.
- *retrieve on B*: ``--retrieve-chunks`` chunks found remote on B, retrieved without a
  prefetch, right after a prefetch returned, and after the prefetch's promotions ended; against
  retrieving the same chunks again once they are local (medians over ``--rounds``).

A's store is sized to hold every chunk of the write-behind run, so none is evicted before its
turn; /dev/shm needs about A's plus B's ``--storage-mb`` and the buffers (3 GiB by default).
Between parts the chunk values are removed from the remote (the record stream stays), and the
servers run with ``maxmemory`` of ``--redis-mb`` in all and ``volatile-lru``: the loaded part alone
writes several GB, and the server evicts the oldest values (counted, per part).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import redis
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kvblend.dataplane.client import BlendClient  # noqa: E402
from kvblend.dataplane.remote import ChunkId, encode  # noqa: E402
from kvblend.shm.hashing import Namespace  # noqa: E402
from kvblend.shm.header import ORIGIN_STANDALONE  # noqa: E402
from kvblend.shm.layout import DType  # noqa: E402
from tests.harness import Service, poll, remove_prefix, unique_prefix  # noqa: E402
from tests.remote.conftest import KEY, KEY_TEXT, ClusterProcs, RedisProc, started  # noqa: E402

C = 256
MODEL = "bench-share"
VOCAB = 50_000
DEADLINE_S = 120.0
#: between /metrics reads while waiting for a counter: each read costs the API a few ms of CPU,
#: which the writer thread would otherwise have (the resolution this leaves is in the tables)
WRITE_POLL_S = 0.05
PROMOTE_POLL_S = 0.01
LOAD_DOC_CHUNKS = 2     # chunks per store of the background load
REFERENCE_VALUES = 24   # values of the plain SET/GET reference
#: a document B has not found by then is lost (A evicted it before its writer got to it: A's
#: skipped count says so); the part stops after GIVE_UP lost documents
LOST_AFTER_S = 30.0
GIVE_UP = 3
WRITE_COUNTERS = {"written": "remote_written_chunks", "dropped": "remote_dropped_chunks",
                  "skipped": "remote_skipped_chunks", "failed": "remote_failed_writes"}


@dataclass(frozen=True)
class Geometry:
    """The benchmark's model: bf16 KV of ``layers`` x ``hidden`` per token."""

    layers: int
    hidden: int

    @property
    def chunk_bytes(self) -> int:
        return 2 * self.layers * C * self.hidden * 2

    def chunk_id(self, chunk_hash: bytes) -> ChunkId:
        return ChunkId(Namespace(MODEL).root, chunk_hash, 0, DType.BFLOAT16, self.layers, C,
                       self.hidden)


def log(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def random_kv(kv: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    kv.view(torch.int16).copy_(torch.randint(-2**15, 2**15, tuple(kv.shape), generator=g,
                                             dtype=torch.int16))


class Host:
    """One ``kvblend serve --remote`` and a client with a CPU buffer of ``buffer_chunks`` chunks
    registered on it; ``close()`` stops the service and removes its prefix, also half-started."""

    def __init__(self, remote: str, storage_mb: int, buffer_chunks: int, geo: Geometry,
                 seed: int) -> None:
        self.prefix = unique_prefix("kvbs")
        self.service: Service | None = None
        self.client: BlendClient | None = None
        try:
            self.service = Service(self.prefix, "--remote", remote, "--storage-mb", str(storage_mb),
                                   env={"KVBLEND_REMOTE_KEY": KEY_TEXT})
            self.client = BlendClient(self.service.url)
            self.kv = self.client.cpu_kv_buffer(num_layers=geo.layers, num_tokens=buffer_chunks * C,
                                                hidden_dim=geo.hidden, dtype=torch.bfloat16)
            random_kv(self.kv, seed)
            self.inst = self.client.register_kv_cache(self.kv, model_name=MODEL)
        except BaseException:
            self.close()
            raise

    @property
    def api(self) -> BlendClient:
        assert self.client is not None, "Host used after close()"
        return self.client

    def counters(self, *names: str) -> dict[str, float]:
        assert self.service is not None, "Host used after close()"
        got = self.service.metrics()
        return {n: got.get(f"kvblend_{n}_total", 0.0) for n in names}

    def close(self) -> None:
        try:
            if self.client is not None:
                self.client.close()
        finally:
            if self.service is not None:
                self.service.stop()
            remove_prefix(self.prefix)


class Load:
    """Another client storing fresh ``LOAD_DOC_CHUNKS``-chunk documents on a host at ``rate``
    chunks/s, from a thread of its own, until ``close()``."""

    def __init__(self, host: Host, rate: float, geo: Geometry, seed: int) -> None:
        assert host.service is not None, "Load on a closed host"
        self.client = BlendClient(host.service.url)
        try:
            kv = self.client.cpu_kv_buffer(num_layers=geo.layers, num_tokens=LOAD_DOC_CHUNKS * C,
                                           hidden_dim=geo.hidden, dtype=torch.bfloat16)
            random_kv(kv, seed)
            self.inst = self.client.register_kv_cache(kv, model_name=MODEL)
        except BaseException:
            self.client.close()
            raise
        self.rate, self.seed = rate, seed
        self.stored = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        rng = np.random.default_rng(self.seed)
        due = time.perf_counter()
        try:
            while not self._stop.is_set():
                tokens = rng.integers(0, VOCAB, LOAD_DOC_CHUNKS * C, dtype=np.uint32)
                res = self.client.store_pre_computed(self.inst, tokens).wait(timeout=DEADLINE_S)
                assert res.ok, res
                self.stored += LOAD_DOC_CHUNKS
                due += LOAD_DOC_CHUNKS / self.rate
                # pacing of the load generator: the next store is due then, nothing waits on it
                self._stop.wait(max(0.0, due - time.perf_counter()))
        except BaseException as exc:  # left for the report: the part goes on without load
            self.error = exc

    def close(self) -> None:
        """Stops the load; its error, if it failed, is left in ``error`` for the report."""
        self._stop.set()
        self._thread.join(DEADLINE_S)
        self.client.close()


@dataclass
class Remote:
    """A remote tier under test: its ``--remote`` URL, a plain client of it, its servers."""

    name: str
    url: str
    plain: Any  # redis.Redis or redis.RedisCluster
    nodes: list[RedisProc]
    results: dict[str, Any] = field(default_factory=dict)

    def limit(self, max_mb: int) -> None:
        """``maxmemory`` of ``max_mb`` over all nodes, evicting keys with a TTL (the chunk values,
        never the record stream): the loaded part writes faster than any part drops values."""
        for node in self.nodes:
            with node.client() as c:
                c.config_set("maxmemory", f"{max_mb // len(self.nodes)}mb")
                c.config_set("maxmemory-policy", "volatile-lru")
        with self.nodes[0].client() as c:
            self.results["version"] = c.info("server")["redis_version"]

    def memory(self) -> tuple[float, int]:
        """(the largest node's peak memory in MiB, keys evicted on all nodes)."""
        peak, evicted = 0.0, 0
        for node in self.nodes:
            with node.client() as c:
                peak = max(peak, c.info("memory")["used_memory_peak"] / 2**20)
                evicted += int(c.info("stats")["evicted_keys"])
        return peak, evicted

    def drop_values(self) -> None:
        """Remove every chunk value (the record streams ``kvblend:1:fp*`` stay)."""
        for key in list(self.plain.scan_iter(match="kvblend:1:*:*", count=1000)):
            if not key.startswith(b"kvblend:1:fp"):  # a cluster's streams: kvblend:1:fp:{N}
                self.plain.unlink(key)


class Docs:
    """Fresh random documents: no two share a chunk."""

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def __call__(self, chunks: int) -> np.ndarray:
        return self._rng.integers(0, VOCAB, chunks * C, dtype=np.uint32)


def poll_counters(host: Host, names: tuple[str, ...], before: dict[str, float], n: int,
                  every_s: float) -> tuple[float, dict[str, float]]:
    """Reads ``host``'s counters until ``names`` together grew by ``n``; returns when that was
    seen (perf_counter) and each one's growth."""
    def grown() -> tuple[float, dict[str, float]] | None:
        now = host.counters(*names)
        seen = time.perf_counter()
        grew = {k: now[k] - before.get(k, 0.0) for k in names}
        return (seen, grew) if sum(grew.values()) >= n else None
    return poll(grown, DEADLINE_S, f"{names} to grow by {n}", every_s=every_s)


def write_behind(a: Host, docs: Docs, chunks: int, per_call: int) -> dict[str, Any]:
    """A stores ``chunks`` chunks as fast as it can; the local and the write-behind rates."""
    names = tuple(WRITE_COUNTERS.values())
    before = a.counters(*names)
    t0 = time.perf_counter()
    left = chunks
    while left:
        n = min(per_call, left)
        res = a.api.store_pre_computed(a.inst, docs(n)).wait(timeout=DEADLINE_S)
        assert res.ok and res.copied == n, res
        left -= n
    local_s = time.perf_counter() - t0
    seen, grew = poll_counters(a, names, before, chunks, WRITE_POLL_S)
    return {"chunks": chunks, "local_s": local_s, "remote_s": seen - t0,
            **{k: grew[v] for k, v in WRITE_COUNTERS.items()}}


def reference(remote: Remote, geo: Geometry, n: int) -> dict[str, float]:
    """Seconds per value of one plain client's SET and GET of a value as large as a chunk's,
    and of ``encode`` in this process."""
    chunk = geo.chunk_id(bytes(16))
    kv = np.random.default_rng(0).integers(0, 2**16, geo.chunk_bytes // 2, dtype=np.uint16)
    tokens = np.arange(C, dtype=np.uint32)
    t0 = time.perf_counter()
    for _ in range(n):
        value = encode(chunk, tokens, kv, 0, ORIGIN_STANDALONE, key=KEY)
    encode_s = (time.perf_counter() - t0) / n
    keys = [f"bench:set:{i}" for i in range(n)]
    t0 = time.perf_counter()
    for key in keys:
        remote.plain.set(key, value)
    set_s = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for key in keys:
        assert len(remote.plain.get(key)) == len(value)
    get_s = (time.perf_counter() - t0) / n
    for key in keys:
        remote.plain.unlink(key)
    return {"encode": encode_s, "set": set_s, "get": get_s, "value_bytes": len(value)}


def lookup_rtt(b: Host, docs: Docs, n: int) -> list[float]:
    """B's lookup round trip alone (a miss), as the loop below polls it."""
    times = []
    for _ in range(n):
        tokens = docs(1)
        t0 = time.perf_counter()
        b.api.lookup(tokens, model_name=MODEL)
        times.append(time.perf_counter() - t0)
    return times


def visible_after(a: Host, b: Host, tokens: np.ndarray, poll_s: float
                  ) -> tuple[float, str] | None:
    """Stores ``tokens`` on A; seconds from the store's end until B's lookup finds its chunk,
    and the location B's lookup gave; None when B did not within ``LOST_AFTER_S``."""
    res = a.api.store_pre_computed(a.inst, tokens).wait(timeout=DEADLINE_S)
    t0 = time.perf_counter()
    assert res.ok, res
    while True:
        matches = b.api.lookup(tokens, model_name=MODEL).matches
        if matches:
            return time.perf_counter() - t0, matches[0].location
        if time.perf_counter() - t0 > LOST_AFTER_S:
            return None
        if poll_s:
            time.sleep(poll_s)  # the poll's period (--poll-ms), a measurement knob


def visibility(a: Host, b: Host, docs: Docs, n: int, poll_s: float) -> dict[str, Any]:
    names = tuple(WRITE_COUNTERS.values())
    before = a.counters(*names)
    got: list[tuple[float, str]] = []
    lost = 0
    while len(got) + lost < n and lost < GIVE_UP:
        seen = visible_after(a, b, docs(1), poll_s)
        if seen is None:
            lost += 1
        else:
            got.append(seen)
    after = a.counters(*names)
    return {"ms": [s * 1000 for s, _ in got], "lost": lost,
            "not_remote": sum(loc != "remote" for _, loc in got),
            **{k: after[v] - before[v] for k, v in WRITE_COUNTERS.items()}}


def visibility_loaded(a: Host, b: Host, docs: Docs, n: int, poll_s: float, rate: float,
                      geo: Geometry) -> dict[str, Any]:
    load = Load(a, rate, geo, seed=99)
    t0 = time.perf_counter()
    try:
        out = visibility(a, b, docs, n, poll_s)
    finally:
        load.close()
    out["load_rate"] = load.stored / (time.perf_counter() - t0)
    out["load_error"] = None if load.error is None else repr(load.error)
    return out


def share(a: Host, b: Host, docs: Docs, k: int) -> tuple[np.ndarray, list[Any]]:
    """A stores ``k`` chunks (documents of its buffer's size); returns B's prompt of them all
    and B's matches once every one is found, remote."""
    per_call = a.kv.shape[2] // C
    parts = [docs(min(per_call, k - i)) for i in range(0, k, per_call)]
    for part in parts:
        assert a.api.store_pre_computed(a.inst, part).wait(timeout=DEADLINE_S).ok
    prompt = np.concatenate(parts)
    def found() -> list[Any] | None:
        matches = b.api.lookup(prompt, model_name=MODEL).matches
        return matches if len(matches) >= k else None
    matches = poll(found, DEADLINE_S, f"{k} chunks found on B", every_s=PROMOTE_POLL_S)
    assert [m.location for m in matches] == ["remote"] * k, matches
    return prompt, matches


def timed_retrieve(a: Host, b: Host, prompt: np.ndarray, matches: list[Any]) -> float:
    """Seconds of B's retrieve of ``matches``; checks the first and last chunk's bytes."""
    b.kv.view(torch.int16)[:, :, :len(prompt)].fill_(-1)
    t0 = time.perf_counter()
    res = b.api.retrieve(b.inst, prompt, matches, offset=0).wait(timeout=DEADLINE_S)
    took = time.perf_counter() - t0
    assert res.ok and res.copied == len(matches), res
    per_call = a.kv.shape[2] // C
    for j in (0, len(matches) - 1):
        src = (j % per_call) * C  # A stored every document from the start of its buffer
        got, want = b.kv[:, :, j * C:(j + 1) * C], a.kv[:, :, src:src + C]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), j  # NaN bits too
    return took


def retrieve_round(a: Host, b: Host, docs: Docs, k: int) -> dict[str, float]:
    out: dict[str, float] = {}
    prompt, matches = share(a, b, docs, k)
    out["remote"] = timed_retrieve(a, b, prompt, matches)
    local = b.api.lookup(prompt, model_name=MODEL).matches
    assert [m.location for m in local] == ["local"] * k, local
    out["local"] = timed_retrieve(a, b, prompt, local)

    prompt, matches = share(a, b, docs, k)
    t0 = time.perf_counter()
    assert b.api.prefetch(b.inst, prompt, matches) == k
    out["prefetch_call"] = time.perf_counter() - t0
    out["after_prefetch"] = timed_retrieve(a, b, prompt, matches)
    out["prefetch_total"] = out["prefetch_call"] + out["after_prefetch"]

    prompt, matches = share(a, b, docs, k)
    names = ("remote_promoted_chunks", "remote_fetch_misses")
    before = b.counters(*names)
    t0 = time.perf_counter()
    assert b.api.prefetch(b.inst, prompt, matches) == k
    seen, grew = poll_counters(b, names, before, k, PROMOTE_POLL_S)
    assert grew["remote_promoted_chunks"] == k, grew
    out["promotion"] = seen - t0
    out["after_promotion"] = timed_retrieve(a, b, prompt, matches)
    return out


@contextmanager
def hosts(remote: Remote, args: argparse.Namespace, geo: Geometry) -> Iterator[tuple[Host, Host]]:
    """A (sized for every write-behind chunk) and B on ``remote``; stopped afterwards."""
    mib = geo.chunk_bytes / 2**20
    a_mb = max(args.storage_mb, math.ceil(args.chunks * mib * 1.2 + 8 * mib))
    made: list[Host] = []
    try:
        made.append(Host(remote.url, a_mb, args.per_call, geo, seed=1))
        made.append(Host(remote.url, args.storage_mb, args.retrieve_chunks, geo, seed=2))
        yield made[0], made[1]
    finally:
        for h in made:
            h.close()


def measure(remote: Remote, args: argparse.Namespace, geo: Geometry) -> None:
    r = remote.results
    docs = Docs(seed=7)
    poll_s = args.poll_ms / 1000
    r["evicted"] = {}

    def part(name: str, what: str, run: Callable[[], Any]) -> None:
        log(f"{remote.name}: {what}")
        _, before = remote.memory()
        r[name] = run()
        r["peak_mb"], after = remote.memory()
        r["evicted"][name] = after - before
        remote.drop_values()

    def retrieve() -> dict[str, float]:
        rounds = []
        for _ in range(args.rounds):
            rounds.append(retrieve_round(a, b, docs, args.retrieve_chunks))
            remote.drop_values()  # the next round's chunks must not be what the server evicts
        return {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}

    with hosts(remote, args, geo) as (a, b):
        r["reference"] = reference(remote, geo, min(REFERENCE_VALUES, args.chunks))
        part("write", f"write-behind of {args.chunks} chunks",
             lambda: write_behind(a, docs, args.chunks, args.per_call))
        r["rtt_ms"] = [s * 1000 for s in lookup_rtt(b, docs, 200)]
        part("idle", f"visibility of {args.docs} documents, idle",
             lambda: visibility(a, b, docs, args.docs, poll_s))
        rate = 0.5 * r["write"]["written"] / r["write"]["remote_s"]
        part("loaded", f"visibility of {args.docs} documents, A also storing {rate:.0f} chunks/s",
             lambda: visibility_loaded(a, b, docs, args.docs, poll_s, rate, geo))
        part("retrieve", f"retrieve of {args.retrieve_chunks} chunks on B, {args.rounds} rounds",
             retrieve)


# -- printing --------------------------------------------------------------------------------

def machine() -> str:
    cpu = platform.processor()
    if not cpu:  # empty on many Linux systems
        try:
            with open("/proc/cpuinfo") as f:
                cpu = next(line.split(":", 1)[1].strip() for line in f
                           if line.startswith("model name"))
        except (OSError, StopIteration):
            cpu = platform.machine()
    return f"{cpu}, {os.cpu_count()} CPUs"


def print_write(remotes: list[Remote], geo: Geometry, args: argparse.Namespace) -> None:
    print(f"\nWrite-behind vs local store: {args.chunks} chunks, {args.per_call} per store call "
          f"({args.chunks * geo.chunk_bytes / 1e9:.2f} GB of KV)")
    print(f"{'remote':<11} {'what':<36} {'chunks/s':>9} {'GB/s':>7} {'vs local':>9}")
    for rm in remotes:
        w, ref = rm.results.get("write"), rm.results.get("reference")
        if w is None:
            continue
        local = w["chunks"] / w["local_s"]
        rows = [("A's store calls (local)", local),
                ("A's write-behind to the remote", w["written"] / w["remote_s"]),
                ("plain SET, 1 redis-py client", 1 / ref["set"]),
                ("plain GET, 1 redis-py client", 1 / ref["get"]),
                ("encode (copy + SHA-256), 1 thread", 1 / ref["encode"])]
        for what, rate in rows:
            print(f"{rm.name:<11} {what:<36} {rate:9.1f} {rate * geo.chunk_bytes / 1e9:7.2f} "
                  f"{rate / local:8.2f}x")
        print(f"{rm.name:<11} write-behind took {w['remote_s']:.2f} s for {w['written']:.0f} "
              f"written, {w['dropped']:.0f} dropped, {w['skipped']:.0f} skipped, "
              f"{w['failed']:.0f} failed (store calls {w['local_s']:.2f} s; counter polled every "
              f"{WRITE_POLL_S * 1000:.0f} ms)")


def pct(ms: list[float]) -> str:
    if not ms:
        return f"{'-':>7} {'-':>7} {'-':>7} {'-':>7}"
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return f"{p50:7.1f} {p90:7.1f} {p99:7.1f} {max(ms):7.1f}"


def print_visibility(remotes: list[Remote], args: argparse.Namespace) -> None:
    print(f"\nStore on A -> visible on B (ms): {args.docs} one-chunk documents, B's lookup polled "
          f"every {args.poll_ms:g} ms")
    print(f"{'remote':<11} {'load on A':<24} {'n':>5} {'p50':>7} {'p90':>7} {'p99':>7} {'max':>7}"
          f"  A's write-behind meanwhile")
    for rm in remotes:
        r = rm.results
        if "rtt_ms" in r:
            print(f"{rm.name:<11} {'(B lookup round trip)':<24} {len(r['rtt_ms']):5d} "
                  f"{pct(r['rtt_ms'])}  the poll's resolution")
        ref = r.get("reference")
        if ref is not None:  # what A's writer does per chunk, less the XADD and the slab read
            one = (ref["encode"] + ref["set"]) * 1000
            print(f"{rm.name:<11} {'(encode + plain SET)':<24} {'':>5} {one:7.1f} {'':>23}  "
                  f"one chunk, this process, unloaded")
        for key in ("idle", "loaded"):
            v = r.get(key)
            if v is None:
                continue
            load = "idle" if key == "idle" else f"{v['load_rate']:.1f} chunks/s stored"
            odd = f", {v['not_remote']} found local" if v["not_remote"] else ""
            odd += f", {v['lost']} never found (gave up)" if v["lost"] else ""
            odd += f"; the load stopped: {v['load_error']}" if v.get("load_error") else ""
            print(f"{rm.name:<11} {load:<24} {len(v['ms']):5d} {pct(v['ms'])}  "
                  f"{v['written']:.0f} written, {v['dropped']:.0f} dropped, "
                  f"{v['skipped']:.0f} skipped, {v['failed']:.0f} failed{odd}")


def print_retrieve(remotes: list[Remote], geo: Geometry, args: argparse.Namespace) -> None:
    k = args.retrieve_chunks
    gb = k * geo.chunk_bytes / 1e9
    print(f"\nRetrieve on B: {k} chunks ({gb:.2f} GB of KV), median of {args.rounds} rounds")
    print(f"{'remote':<11} {'what':<46} {'ms':>8} {'GB/s':>7}")
    rows = [("remote, no prefetch: retrieve", "remote"),
            ("remote: prefetch call", "prefetch_call"),
            ("remote: retrieve right after prefetch returned", "after_prefetch"),
            ("remote: prefetch + retrieve (total)", "prefetch_total"),
            ("remote: prefetch until all promoted", "promotion"),
            ("remote: retrieve after promotion ended", "after_promotion"),
            ("local (same chunks again, fresh lookup)", "local")]
    for rm in remotes:
        got = rm.results.get("retrieve")
        if got is None:
            continue
        for what, key in rows:
            s = got[key]
            rate = "" if key == "prefetch_call" else f"{gb / s:7.2f}"
            print(f"{rm.name:<11} {what:<46} {s * 1000:8.1f} {rate:>7}")


def report(remotes: list[Remote], geo: Geometry, args: argparse.Namespace) -> None:
    if not remotes:
        return
    value = remotes[0].results.get("reference", {}).get("value_bytes", 0)
    print(f"\nmachine: {machine()}; redis-server {remotes[0].results.get('version', '?')}, "
          f"maxmemory {args.redis_mb} MiB (volatile-lru)")
    for rm in remotes:
        if "peak_mb" in rm.results:
            evicted = ", ".join(f"{k} {v}" for k, v in rm.results["evicted"].items())
            print(f"{rm.name}: peak used memory {rm.results['peak_mb']:.0f} MiB (largest node); "
                  f"chunk values evicted by the server, per part: {evicted}")
    print(f"chunk: {C} tokens x {geo.layers} layers x {geo.hidden} hidden, bf16: "
          f"{geo.chunk_bytes} B of KV ({value} B as a remote value)")
    print_write(remotes, geo, args)
    print_visibility(remotes, args)
    print_retrieve(remotes, geo, args)


# -- main ------------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--docs", type=int, default=200, help="one-chunk documents timed to B")
    p.add_argument("--chunks", type=int, default=160, help="chunks of the write-behind run")
    p.add_argument("--per-call", type=int, default=8, help="chunks per store call")
    p.add_argument("--retrieve-chunks", type=int, default=32, help="chunks B retrieves")
    p.add_argument("--rounds", type=int, default=3, help="rounds of the retrieve part")
    p.add_argument("--cluster", action="store_true", help="also on a 3-master cluster")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--storage-mb", type=int, default=1024, help="B's store (A's is larger)")
    p.add_argument("--poll-ms", type=float, default=0.0, help="sleep between B's lookups")
    p.add_argument("--redis-mb", type=int, default=2048, help="the remote's maxmemory")
    return p.parse_args()


def run_on(remotes: list[Remote], remote: Remote, args: argparse.Namespace,
           geo: Geometry) -> None:
    remotes.append(remote)
    remote.limit(args.redis_mb)
    measure(remote, args, geo)


def main() -> None:
    args = parse_args()
    geo = Geometry(args.layers, args.hidden)
    remotes: list[Remote] = []
    closers: list[Callable[[], None]] = []
    try:
        server = started()
        closers.append(server.close)
        plain = server.client(socket_timeout=60)
        closers.append(plain.close)
        run_on(remotes, Remote("standalone", server.url, plain, [server]), args, geo)
        if args.cluster:
            cluster = ClusterProcs(3)
            closers.append(cluster.close)
            cluster.wait_ok()
            plain = redis.RedisCluster(startup_nodes=[redis.cluster.ClusterNode(h, p)
                                                      for h, p in cluster.seeds],
                                       socket_timeout=60)
            closers.append(plain.close)
            run_on(remotes, Remote("3 masters", cluster.cluster_url, plain, cluster.nodes), args, geo)
    finally:
        try:
            report(remotes, geo, args)
        finally:
            for close in reversed(closers):
                close()


if __name__ == "__main__":
    main()
