"""A fleet model: N hosts sharing KV chunks through the remote tier, simulated from measured costs.

    python benchmarks/fleet_model.py [--seed 0] [--hosts 1,2,4,8,16,32,64] [--models 8b,70b]
                                     [--gpus h100,h200] [--requests 300] [--rate 1.0] ...
    python benchmarks/fleet_model.py --validate [--chunk-mib 8] [--write-gbps ...] ...

A discrete-event simulation over one trace per N (seeded, shared by every model and GPU):
- each host receives RAG requests as a Poisson process (``--rate`` per second, ``--requests``
  each); a request is ``--k`` distinct documents drawn Zipf(``--zipf``) from ``--docs``
  documents of ``--doc-chunks`` chunks, plus ``--question`` tokens always computed;
- each document is a *local hit* (in the host's LRU store of ``--store-gib``), a *remote hit*
  (another host computed it and its write-behind ended before the request came), or a *miss*;
- a remote hit is fetched as one job per request through two FIFO queues at once: the host's
  fetch path (``--link-gbps``) and the shared tier (``--tier-gbps``, all hosts); the job ends
  when the slower of the two has served it, plus ``--latency-ms``. The queueing delay is the
  job's end less its unloaded time;
- TTFT with the tier = copy of every hit chunk to the GPU (``--local-gbps``) + the fetch wait +
  prefill of the missed tokens, the question and ``--blend-ratio`` of the hit tokens. Against it:
  the same fleet without the tier (local stores only) and recompute-only (no store at all);
- a missed document enters the host's store when its request ends, and is written behind
  through the host's writer queue (``--write-gbps``); it is fetchable by others
  ``--discovery-ms`` after its write ends. A fetched document enters the store, not written again.

Not modelled: GPU queueing and batching (each request has its GPU at once); prefill slowing with
prompt length (one rate per model and GPU); the tier's capacity and evictions (it keeps every
document); the write-behind queue's bound and drops; service-time variance (every transfer runs
at its rate); CPU contention between a host's writers, fetches and stores; faults. Hit rates count
from cold stores. ``--validate`` replays ``benchmarks/remote_share.py``'s trace at N=2 instead.
"""

from __future__ import annotations

import argparse
import heapq
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

import numpy as np

GB = 1e9
C = 256  #: tokens per chunk, kvblend's default chunk_size

# -- costs: measured (with the line of docs/ that holds the number) or assumed (then a flag) -----
#: local hit, shm slab -> GPU: paged retrieve of 1 GiB on the H200, GPU span 51.6-51.9 GB/s, the
#: call's CPU work 1.0-1.3 ms more (docs/benchmarks.md:573-577); rounded down to 50
LOCAL_GBPS = 50.0
#: a host's fetch path end to end (read, every check, copy into the slab): retrieve of 32 remote
#: chunks on B, 3 masters, 16-core host (docs/benchmarks.md:1003; 0.81 GB/s from one server)
LINK_GBPS = 1.49
#: one redis-server fed 8 chunks at once: 2.0-2.2 GB/s (docs/benchmarks.md:906), a lower bound on
#: what one master serves. ASSUMED: the tier serves ``masters`` times that (--tier-gbps)
MASTER_GBPS = 2.1
MASTERS = 3
#: write-behind, 4 writers, 3 masters, 16-core host: 1.00 GB/s (docs/benchmarks.md:999)
WRITE_GBPS = 1.00
#: the record reaching another host's XREAD and index: "about 1-5 ms" (docs/benchmarks.md:984-986)
DISCOVERY_S = 0.003
#: ASSUMED: one fetch request's round trip and server turn across a network (only loopback was
#: measured here: B's whole HTTP lookup is 1.3-1.7 ms, docs/benchmarks.md:966)
LATENCY_S = 0.0005
#: prefill tokens/s. Measured: Llama-3.1-8B shape on one H200, 8,192 tokens in 270.2 ms
#: (docs/blend.md:27; 26,700/s at 16k, 22,500/s at 32k). ASSUMED: an H100 at 0.9 of that (same
#: compute, slower memory); 70B scaled by parameters (8.0 / 70.6) at the same compute per GPU,
#: one GPU's worth (a TP group of t GPUs: pass --prefill-tps t times it)
PREFILL_8B_H200 = 30_300.0
GPU_SCALE = {"h200": 1.0, "h100": 0.9}


@dataclass(frozen=True)
class Shape:
    """A model's KV geometry: bf16 K and V of ``layers`` x ``kv_heads`` x ``head_dim`` per token."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params_b: float

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * self.kv_heads * self.head_dim * 2 * 2

    @property
    def chunk_bytes(self) -> int:
        return self.kv_bytes_per_token * C

    def prefill_tps(self, gpu: str) -> float:
        return PREFILL_8B_H200 * GPU_SCALE[gpu] * MODELS["8b"].params_b / self.params_b


MODELS = {"8b": Shape("Llama-3.1-8B", 32, 8, 128, 8.03),
          "70b": Shape("Llama-3.1-70B", 80, 8, 128, 70.6)}


@dataclass(frozen=True)
class Costs:
    """Per-byte and per-token costs of one host; rates in bytes or tokens per second."""

    local: float = LOCAL_GBPS * GB
    link: float = LINK_GBPS * GB
    tier: float = MASTER_GBPS * MASTERS * GB
    latency_s: float = LATENCY_S
    write: float = WRITE_GBPS * GB
    discovery_s: float = DISCOVERY_S
    prefill: float = PREFILL_8B_H200
    blend_ratio: float = 0.0


@dataclass(frozen=True)
class Workload:
    docs: int = 10_000
    zipf: float = 1.0
    k: int = 4
    doc_chunks: int = 4
    question: int = 256
    rate: float = 1.0
    requests: int = 300
    store_bytes: float = 64 * 2**30  #: math.inf: every document stays


class Fifo:
    """One first-come first-served server of ``rate`` bytes/s (``math.inf``: no wait, no time)."""

    def __init__(self, rate: float) -> None:
        self.rate, self.free, self.busy = rate, 0.0, 0.0

    def serve(self, t: float, nbytes: float) -> float:
        """Offers a job of ``nbytes`` at ``t``, after every job offered before it; its end."""
        took = nbytes / self.rate
        self.free = max(t, self.free) + took
        self.busy += took
        return self.free


Request = tuple[float, int, tuple[int, ...]]  # arrival time, host, documents


def draw_docs(cdf: np.ndarray, k: int, rng: np.random.Generator) -> tuple[int, ...]:
    """``k`` distinct documents, each Zipf-distributed (drawn until ``k`` differ)."""
    got: dict[int, None] = {}
    while len(got) < k:
        for d in np.searchsorted(cdf, rng.random(2 * k), side="right"):
            got.setdefault(int(min(d, len(cdf) - 1)), None)
    return tuple(list(got)[:k])


def make_trace(hosts: int, w: Workload, seed: int) -> list[Request]:
    """Every host's Poisson arrivals, merged in time order; seeded by (seed, hosts)."""
    rng = np.random.default_rng([seed, hosts])
    weights = 1.0 / np.arange(1, w.docs + 1, dtype=np.float64) ** w.zipf
    cdf = np.cumsum(weights) / weights.sum()
    out: list[Request] = []
    for h in range(hosts):
        times = np.cumsum(rng.exponential(1.0 / w.rate, w.requests))
        out.extend((float(t), h, draw_docs(cdf, w.k, rng)) for t in times)
    out.sort(key=lambda r: (r[0], r[1]))
    return out


@dataclass
class Result:
    """What one simulation saw; per-document counts, per-request times (seconds)."""

    local: int = 0
    remote: int = 0  #: tier hits, ``own`` of them written by no other host (evicted here)
    own: int = 0
    miss: int = 0
    queue: list[float] = field(default_factory=list)  #: per fetch job
    ttft: list[float] = field(default_factory=list)
    saved_tokens: float = 0.0  #: prefill avoided by remote hits
    fetch_s: float = 0.0  #: what remote hits cost instead: fetch wait and copy
    tier_busy: float = 0.0
    horizon: float = 0.0  #: the last arrival

    def rate(self, n: int) -> float:
        return n / max(1, self.local + self.remote + self.miss)

    @property
    def break_even(self) -> float:
        """The prefill rate below which fetching the remote hits beat recomputing them."""
        return self.saved_tokens / self.fetch_s if self.fetch_s else math.nan


class Fleet:
    """N hosts' stores, writers and fetch paths, and the tier's record of fetchable documents."""

    def __init__(self, hosts: int, shape: Shape, costs: Costs, w: Workload, tier: bool) -> None:
        self.costs, self.w, self.tier_on = costs, w, tier
        self.doc_bytes = shape.chunk_bytes * w.doc_chunks
        cap = w.store_bytes / self.doc_bytes
        self.capacity = cap if math.isinf(cap) else int(cap)
        self.stores: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(hosts)]
        self.links = [Fifo(costs.link) for _ in range(hosts)]
        self.writers = [Fifo(costs.write) for _ in range(hosts)]
        self.tier = Fifo(costs.tier)
        self.visible: dict[int, dict[int, float]] = {}  #: doc -> {writer: fetchable from}
        self.pending: list[tuple[float, int, int, int, bool]] = []  #: (t, seq, host, doc, write)
        self.seq = 0
        self.res = Result()

    def later(self, t: float, host: int, doc: int, write: bool) -> None:
        heapq.heappush(self.pending, (t, self.seq, host, doc, write))
        self.seq += 1

    def settle(self, now: float) -> None:
        """Every request end up to ``now``: its documents enter the store, misses are written."""
        while self.pending and self.pending[0][0] <= now:
            t, _, h, d, write = heapq.heappop(self.pending)
            store = self.stores[h]
            store[d] = None
            store.move_to_end(d)
            while len(store) > self.capacity:
                store.popitem(last=False)
            if write and self.tier_on:
                seen = self.writers[h].serve(t, self.doc_bytes) + self.costs.discovery_s
                by = self.visible.setdefault(d, {})
                by[h] = min(by.get(h, math.inf), seen)

    def classify(self, t: float, h: int, docs: tuple[int, ...]) -> tuple[list[int], list[int],
                                                                          list[int]]:
        """Local hits, tier hits, misses. A tier hit is any host's write, the host's own
        included (it tails its own records too): ``own`` counts those no other host wrote."""
        local, remote, miss = [], [], []
        store = self.stores[h]
        for d in docs:
            if d in store:
                store.move_to_end(d)
                local.append(d)
                continue
            by = [w for w, seen in self.visible.get(d, {}).items() if seen <= t]
            if by:
                remote.append(d)
                self.res.own += by == [h]
            else:
                miss.append(d)
        return local, remote, miss

    def fetch(self, t: float, h: int, nbytes: float) -> float:
        """The fetch job of one request through its host's path and the tier; its wait."""
        if not nbytes:
            return 0.0
        c = self.costs
        done = max(self.links[h].serve(t, nbytes), self.tier.serve(t, nbytes)) + c.latency_s
        queued = done - t - c.latency_s - nbytes / min(c.link, c.tier)
        self.res.queue.append(queued if queued > 1e-9 else 0.0)  # not rounding noise
        return done - t

    def request(self, t: float, h: int, docs: tuple[int, ...]) -> None:
        self.settle(t)
        local, remote, miss = self.classify(t, h, docs)
        c, r, tokens = self.costs, self.res, self.w.doc_chunks * C
        fetched = len(remote) * self.doc_bytes
        wait = self.fetch(t, h, fetched)
        copy = (len(local) + len(remote)) * self.doc_bytes / c.local
        hit_tokens = (len(local) + len(remote)) * tokens
        compute = len(miss) * tokens + self.w.question + c.blend_ratio * hit_tokens
        ttft = copy + wait + compute / c.prefill
        r.ttft.append(ttft)
        r.local, r.remote, r.miss = r.local + len(local), r.remote + len(remote), r.miss + len(miss)
        if remote:
            r.saved_tokens += len(remote) * tokens * (1 - c.blend_ratio)
            r.fetch_s += wait + fetched / c.local
        for d in remote:
            self.later(t + ttft, h, d, write=False)
        for d in miss:
            self.later(t + ttft, h, d, write=True)
        r.horizon = t

    def run(self, trace: list[Request]) -> Result:
        for t, h, docs in trace:
            self.request(t, h, docs)
        self.res.tier_busy = self.tier.busy
        return self.res


def simulate(trace: list[Request], hosts: int, shape: Shape, costs: Costs, w: Workload,
             tier: bool = True) -> Result:
    return Fleet(hosts, shape, costs, w, tier).run(trace)


def recompute_ttft(w: Workload, costs: Costs) -> float:
    return (w.k * w.doc_chunks * C + w.question) / costs.prefill


# -- the grid ----------------------------------------------------------------------------------

def ms(xs: list[float], q: float | None = None) -> str:
    if not xs:
        return "-"
    v = float(np.mean(xs)) if q is None else float(np.percentile(xs, q))
    return f"{v * 1000:.1f}" if v < 10 else f"{v:.0f} s"  # seconds: an overloaded queue


def row(n: int, tiered: Result, alone: Result) -> str:
    q, util = tiered.queue, tiered.tier_busy / max(tiered.horizon, 1e-9)  # offered: > 1 grows
    be = "-" if math.isnan(tiered.break_even) else f"{tiered.break_even:,.0f}"
    pct = [100 * tiered.rate(x) for x in (tiered.local, tiered.remote - tiered.own, tiered.own)]
    cells = [f"{n:>3}", *(f"{x:6.1f}" for x in pct), f"{100 * alone.rate(alone.local):6.1f}",
             *(f"{ms(q, p):>6}" for p in (None, 50, 99)),
             *(f"{ms(x.ttft, p):>7}" for x in (tiered, alone) for p in (None, 99)),
             f"{util:5.2f}", f"{be:>10}"]
    return " ".join(cells)


#: local/remote/own %: local hits, tier hits of others' writes, of the host's own evicted ones;
#: alone: local hits, no tier. queue, TTFT: ms. util: the tier's offered load. pays below: tokens/s
HEADER = ("  N local% remote%  own% alone%  queue    p50    p99  tier TTFT   p99  alone TTFT   p99"
          " util pays below")


def grid(args: argparse.Namespace, w: Workload) -> None:
    hosts = [int(x) for x in args.hosts.split(",")]
    traces = {n: make_trace(n, w, args.seed) for n in hosts}
    for model in args.models.split(","):
        shape = MODELS[model]
        for gpu in args.gpus.split(","):
            costs = costs_from(args, args.prefill_tps or shape.prefill_tps(gpu))
            print(f"\n{shape.name}: {shape.kv_bytes_per_token // 1024} KiB of KV per token, "
                  f"{shape.chunk_bytes / 2**20:.0f} MiB a chunk; {gpu.upper()} prefill "
                  f"{costs.prefill:,.0f} tokens/s; recompute-only TTFT "
                  f"{recompute_ttft(w, costs) * 1000:.1f} ms; no-queue break-even "
                  f"{costs.link * (1 - costs.blend_ratio) / shape.kv_bytes_per_token:,.0f}/s")
            print(HEADER)
            for n in hosts:
                grown = costs.tier + n * args.tier_per_host_gbps * GB
                tiered = simulate(traces[n], n, shape, replace(costs, tier=grown), w, tier=True)
                alone = simulate(traces[n], n, shape, costs, w, tier=False)
                print(row(n, tiered, alone))


def costs_from(args: argparse.Namespace, prefill: float) -> Costs:
    gbps = {k: (math.inf if v == 0 else v * GB) for k, v in
            (("local", args.local_gbps), ("link", args.link_gbps), ("tier", args.tier_gbps),
             ("write", args.write_gbps))}
    return Costs(latency_s=args.latency_ms / 1000, discovery_s=args.discovery_ms / 1000,
                 prefill=prefill, blend_ratio=args.blend_ratio, **gbps)


# -- validation: benchmarks/remote_share.py's trace at N=2 --------------------------------------

def replay(costs: Costs, shape: Shape, n: int, load_cps: float, lookup_s: float
           ) -> tuple[list[float], Fleet]:
    """remote_share's visibility part through the fleet: host A stores ``n`` one-chunk
    documents, each once B found the one before; B looks each up when it becomes fetchable.
    Meanwhile A stores fresh 2-chunk documents at ``load_cps`` chunks/s (0: idle). Returns the
    seconds from each store to B's lookup finding it, and the fleet (B's hits in ``res``)."""
    w = Workload(docs=n, k=1, doc_chunks=1, question=0, store_bytes=math.inf)
    fleet = Fleet(2, shape, replace(costs, prefill=math.inf), w, tier=True)  # nothing computed
    out, t, fresh = [], 0.0, n
    next_load = 0.0 if load_cps else math.inf

    def load_until(now: float) -> None:
        nonlocal next_load, fresh
        while next_load <= now:
            fleet.request(next_load, 0, (fresh, fresh + 1))
            next_load, fresh = next_load + 2 / load_cps, fresh + 2

    for doc in range(n):
        load_until(t)
        fleet.request(t, 0, (doc,))  # A's store: a miss on A, then written behind
        fleet.settle(t)
        seen = fleet.visible[doc][0] + lookup_s / 2
        load_until(seen)
        fleet.request(seen, 1, (doc,))  # B's lookup that finds it
        out.append(seen - t)
        t = seen + lookup_s / 2
    return out, fleet


def validate(args: argparse.Namespace) -> None:
    costs = costs_from(args, args.prefill_tps or PREFILL_8B_H200)
    chunk = args.chunk_mib * 2**20
    shape = Shape("remote_share.py", 1, 1, round(chunk / (4 * C)), 0.0)  # one chunk's bytes
    print(f"remote_share.py at N=2: {args.chunk_mib:g} MiB chunks; write-behind "
          f"{args.write_gbps} GB/s, fetch path {args.link_gbps} GB/s, local copy "
          f"{args.local_gbps} GB/s, discovery {args.discovery_ms} ms, lookup {args.lookup_ms} ms")
    for name, load in (("idle", 0.0), (f"A storing {args.load_cps:g} chunks/s", args.load_cps)):
        v, fleet = replay(costs, shape, args.val_docs, load, args.lookup_ms / 1000)
        b = fleet.res.remote / args.val_docs  # B requested only A's documents
        print(f"visible on B, {name}: p50 {ms(v, 50)} ms, p99 {ms(v, 99)} ms; B's lookups "
              f"found {100 * b:.1f} % of A's documents remote")
    k = args.retrieve_chunks
    two = Fleet(2, shape, costs, replace(Workload(), store_bytes=math.inf), tier=True)
    wait = two.fetch(0.0, 1, k * chunk)
    copy = k * chunk / costs.local
    print(f"retrieve of {k} remote chunks on B: fetch {wait * 1000:.1f} ms + copy "
          f"{copy * 1000:.1f} ms = {(wait + copy) * 1000:.1f} ms; once local {copy * 1000:.1f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a = p.add_argument
    a("--seed", type=int, default=0)
    a("--hosts", default="1,2,4,8,16,32,64")
    a("--models", default="8b,70b", help=f"of {','.join(MODELS)}")
    a("--gpus", default="h100,h200", help=f"of {','.join(GPU_SCALE)}")
    a("--prefill-tps", type=float, default=0.0, help="one prefill rate for all (0: the table)")
    a("--docs", type=int, default=Workload.docs)
    a("--zipf", type=float, default=Workload.zipf, help="Zipf exponent s (ASSUMED 1.0)")
    a("--k", type=int, default=Workload.k, help="documents per request")
    a("--doc-chunks", type=int, default=Workload.doc_chunks)
    a("--question", type=int, default=Workload.question, help="tokens always computed")
    a("--rate", type=float, default=Workload.rate, help="requests/s per host (Poisson)")
    a("--requests", type=int, default=Workload.requests, help="requests per host")
    a("--store-gib", type=float, default=64.0, help="each host's store (0: unbounded)")
    a("--local-gbps", type=float, default=LOCAL_GBPS, help="0 in any rate: infinitely fast")
    a("--link-gbps", type=float, default=LINK_GBPS, help="a host's fetch path")
    a("--tier-gbps", type=float, default=MASTER_GBPS * MASTERS, help="ASSUMED, all hosts")
    a("--tier-per-host-gbps", type=float, default=0.0, help="added to the tier per host")
    a("--write-gbps", type=float, default=WRITE_GBPS)
    a("--latency-ms", type=float, default=LATENCY_S * 1000, help="ASSUMED, per fetch")
    a("--discovery-ms", type=float, default=DISCOVERY_S * 1000)
    a("--blend-ratio", type=float, default=0.0, help="share of hit tokens still recomputed")
    a("--validate", action="store_true", help="replay remote_share.py at N=2 instead")
    a("--chunk-mib", type=float, default=8.0, help="--validate: remote_share's chunk")
    a("--val-docs", type=int, default=60, help="--validate: remote_share's --docs")
    a("--load-cps", type=float, default=15.0, help="--validate: the load on A, chunks/s")
    a("--lookup-ms", type=float, default=1.0, help="--validate: B's lookup round trip")
    a("--retrieve-chunks", type=int, default=16, help="--validate: remote_share's")
    return p.parse_args(argv)


def workload(args: argparse.Namespace) -> Workload:
    store = math.inf if args.store_gib == 0 else args.store_gib * 2**30
    return Workload(args.docs, args.zipf, args.k, args.doc_chunks, args.question, args.rate,
                    args.requests, store)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    t0 = time.perf_counter()
    if args.validate:
        validate(args)
    else:
        w = workload(args)
        print(f"seed {args.seed}; {w.docs} documents of {w.doc_chunks} chunks, Zipf s={w.zipf}, "
              f"{w.k} a request + {w.question} question tokens; {w.rate:g} requests/s per host, "
              f"{w.requests} each; stores of {args.store_gib:g} GiB; fetch path "
              f"{args.link_gbps:g} GB/s per host, tier {args.tier_gbps:g} GB/s "
              f"+ {args.tier_per_host_gbps:g} a host, "
              f"{args.latency_ms} ms a fetch; write-behind {args.write_gbps} GB/s per host")
        grid(args, w)
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
