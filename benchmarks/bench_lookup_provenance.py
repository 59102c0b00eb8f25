"""What provenance adds to a lookup: ``shm.lookup.lookup`` (match, liveness, stored positions and
origin of the chosen chunks) against the fingerprint match with the liveness check alone, in
process, calls alternating.

A store holding the prompt's chunks (``--chunks`` of 256 tokens, one registration), a prompt of
exactly those chunks: every chunk is a candidate and every one is chosen.

Usage::

    python benchmarks/bench_lookup_provenance.py --chunks 128 --iters 1000
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvblend.shm.fingerprint import FingerprintIndex  # noqa: E402
from kvblend.shm.hashing import Namespace, chunk_hashes  # noqa: E402
from kvblend.shm.layout import ChunkClass, DType, KVLayout  # noqa: E402
from kvblend.shm.lookup import live_checker, lookup  # noqa: E402
from kvblend.shm.names import destroy  # noqa: E402
from kvblend.shm.store import ChunkKey, Store, StoreConfig  # noqa: E402

C = 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--chunks", type=int, default=128)
    p.add_argument("--iters", type=int, default=1000)
    args = p.parse_args()
    prefix = f"kvbench_{uuid.uuid4().hex[:8]}"
    store = Store.open(prefix, StoreConfig(capacity_bytes=256 << 20, page_bytes=4 << 20,
                                           min_slot_bytes=4096))
    fp = FingerprintIndex.open(prefix, C, 1 << 16)
    try:
        ns = Namespace("m", 1)
        cid = store.register_class(ChunkClass.of("m", 1, KVLayout(1, 1024, 8, DType.parse("float16")),
                                                 C))
        prompt = np.random.default_rng(0).integers(0, 2**31, args.chunks * C).astype(np.uint32)
        keys = chunk_hashes(ns, prompt, C)
        for i, h in enumerate(keys):
            res = store.reserve(cid, ChunkKey(ns.id, h), prompt[i * C:(i + 1) * C])
            assert res is not None
            res.commit()
        fp.register(ns, prompt, keys)
        bare = lambda: fp.match(ns, prompt, is_live=live_checker(store, ns))  # noqa: E731
        full = lambda: lookup(store, fp, ns, prompt)  # noqa: E731
        assert len(bare()) == len(full().matches) == args.chunks
        times: dict[str, list[float]] = {"bare": [], "full": []}
        for _ in range(args.iters):
            for name, f in (("bare", bare), ("full", full)):
                t = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t)
        b, f = np.median(times["bare"]), np.median(times["full"])
        print(f"{len(prompt)} tokens, {args.chunks} matches, {args.iters} alternating calls: "
              f"match + liveness {1e6 * b:.0f} us, lookup with provenance {1e6 * f:.0f} us "
              f"({f / b - 1:+.1%})")
    finally:
        fp.close()
        store.close()
        destroy(prefix)


if __name__ == "__main__":
    main()
