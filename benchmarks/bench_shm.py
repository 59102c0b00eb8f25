"""Store throughput and index speed, side by side with plain memcpy in the same run.

    python benchmarks/bench_shm.py [--rounds 5] [--objects-mib 256] [--index-objects 1000000]

Put = reserve + copy into the slot + commit; get = pin + copy out + unpin. The memcpy column is
``np.copyto`` of the same bytes into/out of the same pre-faulted shared memory, so the ratio is the
cost of the store's bookkeeping. Index operations run on a store holding ``--index-objects`` tiny
objects. Prints medians over rounds.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import time
import uuid

import numpy as np

from kvblend.shm.layout import ChunkClass
from kvblend.shm.store import ChunkKey, Store, StoreConfig, destroy
from kvblend.shm.storefile import meta_size as _meta_size

SIZES = {  # object size -> a layout class with exactly that many KV bytes (chunk 256, bf16)
    "256 KiB": ChunkClass("bench", 1, 4, 64, "bfloat16", 256),
    "2 MiB": ChunkClass("bench", 1, 8, 256, "bfloat16", 256),
    "32 MiB": ChunkClass("bench", 1, 32, 1024, "bfloat16", 256),
}


def keys(n: int, salt: int = 0) -> list[ChunkKey]:
    return [ChunkKey(1, hashlib.blake2b(f"{salt}:{i}".encode(), digest_size=16).digest(), 0)
            for i in range(n)]


BATCH = 16  # objects per batch call (reserve_slots / commit_slots / pin_slots)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def bench_size(label: str, cc: ChunkClass, budget: int, rounds: int) -> dict[str, float]:
    n = max(4, budget // cc.slot_bytes)
    page = max(cc.slot_bytes, min(256 << 20, cc.slot_bytes * n))
    pages = -(-n * cc.slot_bytes // page)
    prefix = f"kvbench_{uuid.uuid4().hex[:8]}"
    cfg = StoreConfig(capacity_bytes=pages * page, page_bytes=page, min_slot_bytes=cc.slot_bytes)
    store = Store.open(prefix, cfg)
    try:
        c = store.register_class(cc)
        tokens = np.arange(cc.chunk_size, dtype=np.uint32)
        src = np.full(cc.kv_shape, 7, cc.numpy_dtype())
        dst = np.zeros_like(src)
        res: dict[str, list[float]] = {
            "put": [], "get": [], "put_batch": [], "get_batch": [], "memcpy_in": [], "memcpy_out": []}
        batch_tokens = np.tile(tokens, (BATCH, 1))
        flat_src = src.reshape(-1).view(np.uint8)
        flat_dst = dst.reshape(-1).view(np.uint8)
        for r in range(rounds):
            store.clear()
            ks = keys(n, r)
            t0 = time.perf_counter()
            for k in ks:
                slot = store.reserve(c, k, tokens)
                np.copyto(slot.kv, src)
                slot.commit()
            res["put"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            t0 = time.perf_counter()
            for k in ks:
                (chunk,) = store.pin([k])
                np.copyto(dst, chunk.kv)
                chunk.release()
            res["get"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            store.clear()
            ks = keys(n, rounds + r)
            t0 = time.perf_counter()
            for b in range(0, n, BATCH):
                batch = ks[b:b + BATCH]
                slots = store.reserve_slots(c, batch, batch_tokens[:len(batch)])
                for off in store.kv_offsets(slots).tolist():
                    np.copyto(store.slab[off:off + cc.kv_bytes], flat_src)
                store.commit_slots(slots, batch)
            res["put_batch"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            t0 = time.perf_counter()
            for b in range(0, n, BATCH):
                slots = store.pin_slots(ks[b:b + BATCH])
                for off in store.kv_offsets(slots).tolist():
                    np.copyto(flat_dst, store.slab[off:off + cc.kv_bytes])
                store.unpin_slots(slots)
            res["get_batch"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            pins = store.pin(ks)
            views = [p.kv for p in pins]
            t0 = time.perf_counter()
            for v in views:
                np.copyto(v, src)
            res["memcpy_in"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            t0 = time.perf_counter()
            for v in views:
                np.copyto(dst, v)
            res["memcpy_out"].append(gbps(n * cc.kv_bytes, time.perf_counter() - t0))
            store.unpin(pins)
        out = {k: statistics.median(v) for k, v in res.items()}
        # ratios per round, then the median: each round's copies share the machine's conditions
        for op, base in (("put", "memcpy_in"), ("put_batch", "memcpy_in"),
                         ("get", "memcpy_out"), ("get_batch", "memcpy_out")):
            out[op + "_ratio"] = statistics.median(a / b for a, b in zip(res[op], res[base]))
        return out | {"objects": n}
    finally:
        store.close()
        destroy(prefix)


def bench_index(n: int, ops: int) -> dict[str, float]:
    cc = ChunkClass("bench-index", 1, 1, 8, "float16", 16)  # 512 B of KV, 768 B slots
    per_page = 4096
    cfg = StoreConfig(capacity_bytes=-(-n // per_page) * per_page * cc.slot_bytes,
                      page_bytes=per_page * cc.slot_bytes, min_slot_bytes=cc.slot_bytes)
    prefix = f"kvbench_{uuid.uuid4().hex[:8]}"
    store = Store.open(prefix, cfg)
    try:
        c = store.register_class(cc)
        tokens = np.arange(16, dtype=np.uint32)
        ks = keys(n)
        t0 = time.perf_counter()
        for k in ks:
            store.reserve(c, k, tokens).commit()
        fill = n / (time.perf_counter() - t0)
        rng = np.random.default_rng(0)
        sample = [ks[i] for i in rng.integers(0, n, ops)]
        t0 = time.perf_counter()
        for k in sample:
            store.contains_key(k)
        lookup = ops / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        found = store.contains(sample)
        batched = ops / (time.perf_counter() - t0)
        assert found.all()
        t0 = time.perf_counter()
        for k in sample:
            store.unpin(store.pin([k]))
        pin = ops / (time.perf_counter() - t0)
        stats = store.stats()
        return {"reserve+commit/s": fill, "lookup/s": lookup, "lookup batched/s": batched,
                "pin+unpin/s": pin, "objects": stats.num_objects}
    finally:
        store.close()
        destroy(prefix)


def meta_overhead(capacity: int) -> str:
    cc = SIZES["2 MiB"]
    cfg = StoreConfig(capacity_bytes=capacity)
    per_page = min(cfg.page_bytes // cc.slot_bytes, cfg.slots_per_page)
    objects = cfg.num_pages * per_page
    meta = _meta_size(cfg) + objects * (cc.slot_bytes - cc.kv_bytes)
    return (f"2 MiB class, {capacity >> 30} GiB store, default geometry: {objects} objects, "
            f"{meta / objects:.0f} B metadata per object (meta segment + slot header/padding) = "
            f"{100 * meta / (objects * cc.slot_bytes):.2f} % of slab bytes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--objects-mib", type=int, default=256, help="bytes of objects per size")
    ap.add_argument("--index-objects", type=int, default=1_000_000)
    ap.add_argument("--index-ops", type=int, default=200_000)
    args = ap.parse_args()
    print(f"GB/s, median of {args.rounds} rounds; ratio = median of the per-round ratios to the "
          f"memcpy column; batch = {BATCH} objects per store call")
    print(f"{'object':>8} {'n':>5} {'memcpy in':>10} {'put':>6} {'ratio':>6} {'put batch':>10} "
          f"{'ratio':>6} {'memcpy out':>11} {'get':>6} {'ratio':>6} {'get batch':>10} {'ratio':>6}")
    for label, cc in SIZES.items():
        r = bench_size(label, cc, args.objects_mib << 20, args.rounds)
        mi, mo = r["memcpy_in"], r["memcpy_out"]
        print(f"{label:>8} {r['objects']:>5} {mi:>10.2f} {r['put']:>6.2f} {r['put_ratio']:>6.0%} "
              f"{r['put_batch']:>10.2f} {r['put_batch_ratio']:>6.0%} {mo:>11.2f} "
              f"{r['get']:>6.2f} {r['get_ratio']:>6.0%} {r['get_batch']:>10.2f} "
              f"{r['get_batch_ratio']:>6.0%}")
    r = bench_index(args.index_objects, args.index_ops)
    print(f"index with {r.pop('objects')} objects: " +
          ", ".join(f"{k} {v / 1e3:.0f}k" for k, v in r.items()))
    print(meta_overhead(64 << 30))


if __name__ == "__main__":
    main()
