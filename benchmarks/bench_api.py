"""End-to-end HTTP lookup through ``kvblend serve`` against the in-process ``lookup`` (the floor).

A 32k-token prompt holding 30 stored chunks at unaligned offsets (the rest random tokens of a
128,256-token vocabulary) is looked up against 100k registered and stored chunks (chunk size 256,
sequences of 64 chunks), as a JSON body and as a binary body (little-endian uint32). Reported:
p50 / p99 latency with one client, and lookups/s with 4 concurrent client processes, for each API
worker count asked for; beside them, the same lookup called in-process (``shm.lookup.lookup``).

Bodies are encoded once before timing, so the client's own JSON encoding is not counted; the
clients run on the same machine as the server and compete with it for the CPU.

Run: ``python benchmarks/bench_api.py [--chunks 100000] [--workers 1,2]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests package
from kvblend.api.settings import Settings  # noqa: E402
from kvblend.api.supervisor import prepare  # noqa: E402
from kvblend.shm.fingerprint import FingerprintIndex  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402
from kvblend.shm.layout import ChunkClass, KVLayout  # noqa: E402
from kvblend.shm.lookup import lookup  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from kvblend.shm.store import ChunkKey, Store  # noqa: E402
from tests.harness import Service  # noqa: E402

CHUNK = 256
SEQ_CHUNKS = 64
VOCAB = 128_256
PROMPT = 32_768
HITS = 30
MODEL = "bench-model"
LAYOUT = KVLayout(num_layers=1, num_tokens=SEQ_CHUNKS * CHUNK, hidden_dim=2, dtype="float16")


def populate(settings: Settings, n_chunks: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Store and register ``n_chunks`` chunks in sequences of 64; returns the sequences."""
    ns = Namespace(MODEL)
    store = Store.open(settings.shm_prefix)
    fps = FingerprintIndex.open(settings.shm_prefix, CHUNK, settings.fingerprint_capacity)
    cid = store.register_class(ChunkClass.of(MODEL, 1, LAYOUT, CHUNK))
    seqs = []
    for s in range(0, n_chunks, SEQ_CHUNKS):
        tokens = rng.integers(0, VOCAB, min(SEQ_CHUNKS, n_chunks - s) * CHUNK, dtype=np.uint32)
        keys = chunk_hashes(ns, tokens, CHUNK)
        for i, h in enumerate(keys):
            res = store.reserve(cid, ChunkKey(ns.id, h), tokens[i * CHUNK:(i + 1) * CHUNK])
            if res is not None:
                res.commit()
        fps.register(ns, tokens, keys)
        seqs.append(tokens)
    assert store.stats().num_objects == n_chunks, "the store is too small for the chunks"
    fps.close()
    store.close()
    return seqs


def make_prompt(seqs: list[np.ndarray], rng: np.random.Generator) -> np.ndarray:
    """32k tokens: 10 runs of 3 consecutive stored chunks at unaligned offsets, random between."""
    runs = [seqs[int(i)][c * CHUNK:(c + 3) * CHUNK]
            for i, c in zip(rng.choice(len(seqs) - 1, 10, replace=False),
                            rng.integers(0, SEQ_CHUNKS - 3, 10))]
    gap_total = PROMPT - sum(len(r) for r in runs)
    cuts = np.sort(rng.choice(gap_total, len(runs), replace=False))
    gaps = np.diff(np.concatenate([[0], cuts, [gap_total]]))
    parts = []
    for g, run in zip(gaps, [*runs, None]):
        parts.append(rng.integers(0, VOCAB, int(g), dtype=np.uint32))
        if run is not None:
            parts.append(run)
    return np.concatenate(parts)


def in_process(settings: Settings, prompt: np.ndarray, iters: int) -> tuple[list[float], int]:
    store = Store.open(settings.shm_prefix)
    fps = FingerprintIndex.open(settings.shm_prefix, CHUNK, settings.fingerprint_capacity)
    ns = Namespace(MODEL)
    times, hit = [], 0
    for i in range(iters + 20):
        t0 = time.perf_counter()
        res = lookup(store, fps, ns, prompt)
        if i >= 20:
            times.append(time.perf_counter() - t0)
        hit = res.hit_tokens
    fps.close()
    store.close()
    return times, hit


def requests_for(prompt: np.ndarray) -> dict[str, dict]:
    body = json.dumps({"model_name": MODEL, "world_size": 1, "token_ids": prompt.tolist(),
                       "cache_salt": ""}).encode()
    return {
        "json": dict(content=body, headers={"content-type": "application/json"}),
        "binary": dict(content=prompt.astype("<u4").tobytes(), params={"model_name": MODEL},
                       headers={"content-type": "application/octet-stream"}),
    }


def one_client(url: str, req: dict, iters: int) -> tuple[list[float], int]:
    times, hit = [], 0
    with httpx.Client(base_url=url, timeout=30.0) as http:
        for i in range(iters + 20):
            t0 = time.perf_counter()
            r = http.post("/v1/lookup", **req)
            if i >= 20:
                times.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
            hit = r.json()["hit_tokens"]
    return times, hit


def _client_proc(url: str, req: dict, start_at: float, seconds: float, out: "mp.Queue") -> None:
    n = 0
    with httpx.Client(base_url=url, timeout=30.0) as http:
        http.post("/v1/lookup", **req)
        while time.time() < start_at:
            time.sleep(0.001)  # a start line shared by all clients
        end = start_at + seconds
        while time.time() < end:
            r = http.post("/v1/lookup", **req)
            assert r.status_code == 200
            n += 1
    out.put(n)


def concurrent(url: str, req: dict, clients: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 3.0
    procs = [ctx.Process(target=_client_proc, args=(url, req, start_at, seconds, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    total = sum(out.get(timeout=seconds + 60) for _ in procs)
    for p in procs:
        p.join()
    return total / seconds


def serve(settings: Settings, workers: int) -> Service:
    """``kvblend serve`` with ``settings`` (in its environment) and ``workers`` API workers, on a
    free port; returns once ready."""
    return Service(settings.shm_prefix, defaults=(),
                   env=settings.model_copy(update={"workers": workers}).to_env())


def pct(times: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(times) * 1e3, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=100_000)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--workers", default="1,2", help="API worker counts to run, comma-separated")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    slot = max(4096, ChunkClass.of(MODEL, 1, LAYOUT, CHUNK).slot_bytes)  # min_slot_kb=4
    storage_mb = args.chunks * slot * 11 // 10 // (1 << 20) + 16
    settings = Settings(shm_prefix=f"kvbbench_{os.getpid()}", storage_mb=storage_mb,
                        backend="cpu", chunk_size=CHUNK, min_slot_kb=4, log_level="warning",
                        fingerprint_capacity=max(1 << 20, 2 * args.chunks))
    load_before = os.getloadavg()
    try:
        prepare(settings)
        t0 = time.perf_counter()
        seqs = populate(settings, args.chunks, rng)
        print(f"stored and registered {args.chunks:,} chunks in {time.perf_counter() - t0:.1f} s")
        prompt = make_prompt(seqs, rng)
        floor, hit = in_process(settings, prompt, args.iters)
        assert hit == HITS * CHUNK, f"expected {HITS} chunks hit, got {hit // CHUNK}"
        rows = [("in-process lookup()", "-", pct(floor, 50), pct(floor, 99), None)]
        for workers in (int(w) for w in args.workers.split(",")):
            svc = serve(settings, workers)
            try:
                for kind, req in requests_for(prompt).items():
                    times, hit = one_client(svc.url, req, args.iters)
                    assert hit == HITS * CHUNK
                    rate = concurrent(svc.url, req, args.clients, args.seconds)
                    rows.append((f"HTTP {kind}", str(workers), pct(times, 50), pct(times, 99),
                                 rate))
            finally:
                svc.stop()
        print(f"\n{args.chunks:,} registered chunks, {PROMPT:,}-token prompt, {HITS} hits, "
              f"{args.iters} timed lookups; {args.clients} clients for {args.seconds:.0f} s; "
              f"1-min load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} after\n")
        print(f"| path | API workers | p50 (1 client) | p99 (1 client) | lookups/s "
              f"({args.clients} clients) |")
        print("|---|---:|---:|---:|---:|")
        for name, workers, p50, p99, rate in rows:
            print(f"| {name} | {workers} | {p50:.2f} ms | {p99:.2f} ms | "
                  f"{'-' if rate is None else f'{rate:,.0f}'} |")
    finally:
        destroy(settings.shm_prefix)


if __name__ == "__main__":
    main()
